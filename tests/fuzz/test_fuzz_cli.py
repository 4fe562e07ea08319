"""``composer-ops`` under hostile arguments: exit 0, 1 or 2, never a traceback; on
failure exactly one line on stderr and nothing written; with exit 0 exactly the
expected write."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from composer_ops import Engine
from composer_ops.cli import main
from composer_ops.testing.servers import Server
from tests.fuzz.conftest import examples
from tests.fuzz.strategies import bad_json, json_values, mutated_specs, nest, run_id_like, texts, tried

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("workflow_definitions", "workflow_runs", "task_instances", "workflow_events", "task_outbox")
SPEC = {"id": "fz", "nodes": [{"id": "ask", "type": "WAIT_FOR_SIGNAL", "signal": "go"}]}
#: Commands that neither block (coordinator, worker, db) nor run for long (report, simulate, migrate).
COMMANDS = ["start", "signal", "cancel", "runs", "partitions", "deploy"]


class Cli:
    def __init__(self, url: str) -> None:
        self.url = url
        with Engine.connect(url, pool_size=1) as engine:
            engine.deploy(SPEC)
            self.run_id = engine.start("fz")
        self.conn = psycopg.connect(url, autocommit=True)

    def counts(self) -> tuple[int, ...]:
        query = " UNION ALL ".join(f"SELECT count(*) FROM {t}" for t in TABLES)
        return tuple(int(r[0]) for r in self.conn.execute(query.encode()))

    def run(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:               # argparse reports bad arguments by exiting
                code = int(exc.code or 0) if not isinstance(exc.code, str) else 2
        return code, out.getvalue(), err.getvalue()

    def check(self, *argv: str, writes: tuple[int, ...] | None = None) -> int:
        """Run; a failure must be one line and write nothing; success must write ``writes``
        (per table) when given."""
        before = self.counts()
        code, _out, err = self.run(*argv)
        assert code in (0, 1, 2), (code, err)
        assert "Traceback" not in err, err
        after = self.counts()
        if code == 0:
            if writes is not None:
                assert tuple(a - b for a, b in zip(after, before, strict=True)) == writes, argv
        else:
            assert err.count("\n") == 1 and err.startswith("composer-ops:"), repr(err)
            assert after == before, argv
        return code


@pytest.fixture(scope="module")
def cli(server: Server, template_db: str) -> Iterator[Cli]:
    with server.database(template=template_db) as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMPOSER_DATABASE_URL", url)      # every subcommand's --database-url default
        c = Cli(url)
        yield c
        c.conn.close()


def _json_text(value: Any) -> str:
    """JSON text for ``value`` where one exists (NaN included), else something like it."""
    try:
        return json.dumps(value, allow_nan=True)
    except RecursionError:                      # deeper than json.dumps goes: deeper than json.loads too
        return "[" * 900 + "]" * 900
    except (TypeError, ValueError):
        try:
            return repr(value)[:200]
        except ValueError:                      # an integer too long to print
            return "1" * 5000


json_texts = st.one_of(texts, json_values.map(json.dumps), bad_json.map(_json_text),
                       st.integers(65, 900).map(lambda d: json.dumps(nest(d))),
                       st.sampled_from(['"\udcff"', "\udcff", '{"a": "\\u0000"}', '"\\ud800"', "NaN", "[1,]",
                                        "{'a': 1}", "1e999", "-Infinity", '{"a":1,"a":2}', "\ufeff{}", "null",
                                        "1" * 5000]))


@examples(50)
@given(json_texts)
def test_start_input(cli: Cli, text: str) -> None:
    tried("cli: start --input")
    cli.check("start", "fz", "--input", text, writes=(0, 1, 1, 0, 0))


@examples(30)
@given(run_id_like, texts, json_texts)
def test_signal_cancel_show(cli: Cli, run_id: str, name: str, payload: str) -> None:
    tried("cli: signal / cancel / runs show")
    assert cli.check("signal", run_id, name, "--payload", payload) != 0
    assert cli.check("cancel", run_id) != 0
    assert cli.check("runs", "show", run_id) != 0
    if name != "go":
        assert cli.check("signal", cli.run_id, name, "--payload", payload) != 0


@examples(40)
@given(st.one_of(texts, st.just("fz")), st.one_of(texts, st.integers().map(str)), run_id_like)
def test_start_arguments(cli: Cli, workflow: str, version: str, run_id: str) -> None:
    tried("cli: start arguments")
    assert cli.check("start", workflow, "--version", version, "--run-id", run_id) != 0


@examples(30)
@given(st.one_of(texts, st.integers(max_value=-1).map(str), st.integers(121, 10**30).map(str)))
def test_partitions_months_ahead(cli: Cli, months: str) -> None:
    tried("cli: partitions ensure --months-ahead")
    assert cli.check("partitions", "ensure", "--months-ahead", months) != 0


@examples(50)
@given(st.one_of(mutated_specs().map(_json_text), st.binary(max_size=200), texts,
                 st.integers(65, 400).map(lambda d: "x: " + "[" * d + "]" * d)),
       st.sampled_from(["spec.json", "spec.yaml", "spec"]))
def test_deploy_file(cli: Cli, tmp_path_factory: pytest.TempPathFactory, content: Any, name: str) -> None:
    tried("cli: deploy FILE")
    path = tmp_path_factory.mktemp("deploy") / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogateescape"))
    before = cli.counts()[0]
    if cli.check("deploy", str(path)) == 0:
        assert cli.counts()[0] == before + 1


TOKENS = st.one_of(st.sampled_from(COMMANDS + ["show", "list", "ensure", "--input", "--payload", "--version",
                                               "--run-id", "--json", "--months-ahead", "--reason", "--debug=1",
                                               "fz", "go", "{}", "--", "-x", "--help=x"]), texts)


@examples(80)
@given(st.sampled_from(COMMANDS), st.lists(TOKENS.filter(lambda t: t not in ("-", "--help", "-h")), max_size=5))
def test_random_argument_lists(cli: Cli, command: str, rest: list[str]) -> None:
    tried("cli: random argument lists")
    cli.check(command, *rest)


@pytest.mark.parametrize("raw", [b"\xff", b'"\xff\xfe"', b'{"k": "\xc3\x28"}'])
def test_invalid_utf8_arguments_from_a_real_shell(cli: Cli, raw: bytes) -> None:
    """argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)."""
    tried("cli: invalid UTF-8 argv (subprocess)")
    before = cli.counts()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable.encode(), b"-m", b"composer_ops", b"start", b"fz", b"--input", raw],
                          env=env, capture_output=True, timeout=60, check=False)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert cli.counts() == before


def test_json_nested_deeper_than_the_parser_can_go(cli: Cli) -> None:
    assert cli.check("start", "fz", "--input", "[" * 5000 + "]" * 5000) == 2


def test_yaml_nested_deeper_than_the_parser_can_go(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000)
    assert cli.check("deploy", str(path)) == 2


def test_yaml_control_characters(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("id: x\x1f")
    assert cli.check("deploy", str(path)) == 2


def test_argparse_echoes_a_newline(cli: Cli) -> None:
    assert cli.check("start", "fz", "a\nb") == 2

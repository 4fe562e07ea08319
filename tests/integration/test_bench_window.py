"""The sustained measurement's window counts the system's sessions, not the benchmark's.

bench/scenario.py starts the window ``warmup`` seconds after the producer's first item
(its pool and its backlog session have grown by then) and reads the database clock on a
connection opened before it. Before, the window started ``warmup`` after the producer
was spawned, while it was still importing and connecting, and each clock read opened a
connection: the sessions opened in the window were the benchmark's own (on Citus, each
a backend on the coordinator). A short warmup makes that visible here. The producer
stops when the window ends (``--until-eof``), so no measurement waits out its slack."""

from __future__ import annotations

from typing import Any

import pytest

from bench import scenario, sides
from bench.cpu import server_cpu
from bench.procs import ROOT
from bench.workload import COMPOSER, WORKFLOWS
from composer_ops.testing.servers import Server

TEMPLATE = "bench_tpl_window"


def test_the_sustained_window_opens_no_session(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # A producer timed to outlast the window by a minute: one that stops when the window
    # ends does so long before, however loaded the machine (one that does not, after).
    monkeypatch.setattr(scenario, "PRODUCER_SLACK_S", 60.0)
    sides.make_template(server, ROOT, TEMPLATE, [WORKFLOWS["one"]])
    try:
        url = server.create_database("bench_window", template=TEMPLATE)
        try:
            out: dict[str, Any] = scenario.sustained_on(COMPOSER, url, workers=1, duration=2.0, warmup=0.5,
                                                        max_backlog=20, cpu=server_cpu(server, url))
        finally:
            server.drop_database("bench_window")
    finally:
        server.drop_database(TEMPLATE)
    # Sessions opened in the window, per run: none (the worker's, the producer's and the
    # clock's were all opened before it); and the window measured runs.
    assert out["cpu"]["sessions_per_item"] == 0, out["cpu"]
    assert out["runs_per_s"] > 0 and out["producer"]["submitted"] > 0
    # The producer stopped when the window ended (its input closed), not when its
    # seconds, timed to outlast the window, ran out.
    seconds = 0.5 + 2.0 + scenario.PRODUCER_SLACK_S
    assert out["producer"]["elapsed_s"] < seconds - 0.5, out["producer"]

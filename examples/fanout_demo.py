"""`make demo`'s MAP and SUB_WORKFLOW runs: the examples deployed and run, so the reports
show them.

Deploys examples/charge_all.json, examples/refund.json and examples/returns.json, runs
two charge-all runs (one with an invoice that cannot be charged: its item fails, the MAP
continues) and two returns runs (each starting a refund child) through
examples/fanout_worker.py until they finish, then starts one more charge-all run and
leaves it in flight (its items PENDING: active_tasks counts them).

    python -m examples.fanout_demo     # COMPOSER_DATABASE_URL, else the embedded server
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from composer_ops import Engine
from examples.fanout_worker import make_worker

HERE = Path(__file__).resolve().parent


def run(url: str | None = None, *, timeout_s: float = 120) -> dict[str, str]:
    """The demo's runs by label, after the finished ones finished."""
    with Engine.connect(url) as engine:
        for name in ("charge_all", "refund", "returns"):
            engine.deploy(json.loads((HERE / f"{name}.json").read_text()))
        runs = {"charge-all": engine.start("charge-all", input={"day": "today"}),
                "charge-all (a bad invoice)": engine.start("charge-all", input={"day": "today", "bad": True}),
                "returns 1": engine.start("returns", input={"order": "o-1"}),
                "returns 2": engine.start("returns", input={"order": "o-2"})}
        worker = make_worker(engine)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + timeout_s
            while any(engine.get_run(r).status == "RUNNING" for r in runs.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the demo's runs did not finish in {timeout_s:g} s")
                time.sleep(0.2)
        finally:
            worker.stop()
            thread.join(60)
        runs["charge-all (in flight)"] = engine.start("charge-all", input={"day": "tomorrow"})
        return runs


def main(argv: list[str] | None = None) -> int:
    runs: dict[str, Any] = run()
    for label, run_id in runs.items():
        print(f"{label}: {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

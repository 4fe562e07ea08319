"""A start refused inside another transaction on Citus (mirrors
tests/integration/test_starts.py): the refusal is raised by the start's statement, on the
run's worker node for a taken run ID, and rolled back to the savepoint ``start_in`` took;
the distributed transaction goes on and commits what it wrote before and after."""

from __future__ import annotations

import psycopg
import pytest

from composer_ops import Engine
from composer_ops.engine.requests import Request
from composer_ops.engine.starts import start_in
from composer_ops.errors import Conflict, Invalid

SPEC = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]}


def test_a_start_refused_in_the_callers_transaction_leaves_it_usable(db_url: str) -> None:
    with Engine.connect(db_url, pool_size=1) as engine:
        engine.deploy(SPEC)
        engine.deploy({**SPEC, "id": "off"})
        engine.set_enabled("off", False)
        taken = engine.start("one")
        with engine.pool.connection() as conn, conn.transaction():
            with pytest.raises(Conflict, match="already exists"):
                start_in(conn, engine.shell, workflow_id="one", version=None, input=None, run_id=taken,
                         minted=[], request=Request())
            with pytest.raises(Invalid, match="disabled"):
                start_in(conn, engine.shell, workflow_id="off", version=None, input=None, run_id=None,
                         minted=[], request=Request())
            started, _ = start_in(conn, engine.shell, workflow_id="one", version=None, input=None, run_id=None,
                                  minted=[], request=Request())
            conn.execute("UPDATE workflow_runs SET updated_at = updated_at WHERE id = %s", (taken,))
    with psycopg.connect(db_url) as check:
        assert sorted(r[0] for r in check.execute("SELECT id FROM workflow_runs").fetchall()) == sorted(
            [taken, started])
        assert check.execute("SELECT count(*) FROM task_instances").fetchone() == (2,)
        assert check.execute("SELECT count(*) FROM task_outbox").fetchone() == (2,)
        assert check.execute("SELECT count(*) FROM run_history WHERE kind = 'started'").fetchone() == (2,)

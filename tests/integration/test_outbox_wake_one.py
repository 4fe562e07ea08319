"""A dispatch wakes the workers it needs, not every worker listening.

An idle worker is registered by its own claim with its free slots and woken on its own
channel, where a notification hands it wake-ups (its payload: the total handed to it so
far), each standing for one task. Tasks no registered worker has room for are handed to
busy registered workers, one each, two beyond a worker's room at most; one task left is
told to the least over-promised worker with an empty payload. Only the tasks left
beyond that (or every task, when a worker woken does not serve them all) are announced
on the shared channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from composer_ops import Engine, Worker
from composer_ops.repo import clock, outbox, tasks
from composer_ops.repo.outbox import dispatch_groups
from composer_ops.repo.rows import Dispatch
from composer_ops.testing.processes import TERMINAL, wait_for
from tests.integration.helpers import add_definition, add_run

#: The channel :meth:`Wakes.notified` ends its listening on.
SENTINEL = "test_wakes_heard"


@dataclass
class Wakes:
    """The definition ``wf`` on an autocommit connection, and a second connection
    listening on the shared channel and on the wake channels of workers a, b and c."""

    conn: psycopg.Connection[Any]
    listen: psycopg.Connection[Any]
    channels: dict[str, str]          # channel name -> "shared" or the worker

    def idle(self, worker: str, names: list[str] | None = None, room: int = 2, seen: int | None = None) -> None:
        """An empty claim of ``worker`` with its wake channel: registers it as idle with
        ``room`` free slots, having taken up ``seen`` wake-ups (None: all handed out)."""
        assert outbox.claim(self.conn, ["default"], worker, room, task_names=names, claim_id=f"idle-{worker}-{seen}",
                            wake=outbox.wake_channel(worker), seen=seen) == []

    def dispatch(self, run_id: str | None = None, nodes: tuple[str, ...] = ("t",), task_name: str | None = "t") -> None:
        """A PENDING task of ``task_name`` (None: named after its node) for each node of
        ``run_id`` (a new run by default), their dispatches enqueued in one call."""
        run_id = run_id or add_run(self.conn)
        now = clock.now(self.conn)
        for node in nodes:
            assert tasks.insert_task(self.conn, run_id, task_id=f"{run_id[:8]}-{node}", node_id=node,
                                     node_type="TASK", queue="default", state="PENDING", now=now)
        outbox.enqueue(self.conn, [Dispatch(run_id=run_id, task_id=f"{run_id[:8]}-{node}", attempt=0,
                                            queue="default", task_name=task_name or node, lease_s=30)
                                   for node in nodes], now=now)

    def notified(self) -> list[str]:
        """Who was told since the last call (a wake channel's worker, or "shared")."""
        return sorted(w for w, _ in self.told())

    def told(self) -> list[tuple[str, str]]:
        """Who was told since the last call, with the payloads: (worker, wake-ups handed
        to it so far) on a wake channel, ("shared", queue) on the shared channel; what the
        listener hears before a notification sent now, after them. A listener hears
        notifications in the order their transactions committed, so nothing is counted in
        a window a loaded machine could overrun."""
        self.conn.execute(f"NOTIFY {SENTINEL}")
        heard: list[tuple[str, str]] = []
        for n in self.listen.notifies(timeout=60):
            if n.channel == SENTINEL:
                return sorted(heard)
            heard.append((self.channels[n.channel], n.payload))
        raise AssertionError(f"the listener did not hear {SENTINEL} within 60 s (before it: {heard})")


@pytest.fixture
def wakes(db_url: str) -> Iterator[Wakes]:
    channels = {outbox.CHANNEL: "shared", **{outbox.wake_channel(w): w for w in "abc"}}
    with psycopg.connect(db_url, autocommit=True) as listen, psycopg.connect(db_url, autocommit=True) as conn:
        for channel in (*channels, SENTINEL):
            outbox.listen(listen, channel)
        add_definition(conn)
        yield Wakes(conn, listen, channels)


def test_one_dispatch_wakes_the_most_recently_idle_worker_only(wakes: Wakes) -> None:
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert wakes.told() == [("b", "1")]
    wakes.dispatch()                                # b has room for a second
    assert wakes.told() == [("b", "2")]
    wakes.dispatch()                                # b's room is handed out: a is next
    assert wakes.told() == [("a", "1")]
    wakes.dispatch()
    assert wakes.told() == [("a", "2")]
    # No room registered: one more wake-up for a busy worker, the least over-promised
    # first, then the most recently registered; not the shared channel.
    wakes.dispatch()
    assert wakes.told() == [("b", "3")]
    wakes.dispatch()
    assert wakes.told() == [("a", "3")]
    wakes.dispatch()
    assert wakes.told() == [("b", "4")]
    wakes.dispatch()
    assert wakes.told() == [("a", "4")]
    wakes.dispatch()                                # two beyond the room of each: b is told
    assert wakes.told() == [("b", "")]


def test_a_dispatch_of_several_tasks_hands_them_to_one_worker_with_room(wakes: Wakes) -> None:
    """One notification hands a worker as many tasks as it has room for: the shared
    channel is not told, nor a second worker."""
    wakes.idle("a", room=1)
    wakes.idle("b", room=3)
    wakes.dispatch(nodes=("x", "y", "z"))
    assert wakes.told() == [("b", "3")]


def test_a_dispatch_of_more_tasks_than_one_has_room_for_wakes_as_many_workers(wakes: Wakes) -> None:
    for w in "abc":
        wakes.idle(w, room=1)
    wakes.dispatch(nodes=("x", "y"))
    assert wakes.told() == [("b", "1"), ("c", "1")]


def test_more_tasks_than_registered_room_go_to_busy_workers(wakes: Wakes) -> None:
    """The tasks beyond the registered room are handed to busy registered workers, one
    each, as wake-ups beyond their room, claimed when one of their slots frees; never
    more than two beyond a worker's room, so a worker killed while busy, or one whose
    handlers run long, holds back two tasks at most. One task left over is told to the
    least over-promised worker (no wake-up handed); more go to the shared channel."""
    for w in "abc":
        wakes.idle(w, room=1)
    wakes.dispatch(nodes=("p", "q", "r", "s", "t"))
    # One each for their room, then one more for the two most recently registered.
    assert wakes.told() == [("a", "1"), ("b", "1"), ("b", "2"), ("c", "1"), ("c", "2")]
    assert [_room(wakes.conn, w) for w in "abc"] == [0, -1, -1]
    wakes.dispatch(nodes=("u", "v", "w", "x"))
    # One each, a (the least over-promised) first; the fourth is told to a, now the least.
    assert wakes.told() == [("a", ""), ("a", "2"), ("b", "3"), ("c", "3")]
    assert [_room(wakes.conn, w) for w in "abc"] == [-1, -2, -2]
    wakes.dispatch(nodes=("y", "z", "zz"))
    assert wakes.told() == [("a", "3"), ("shared", "default")]
    assert [_room(wakes.conn, w) for w in "abc"] == [-2, -2, -2]


def test_a_claim_of_its_wake_ups_keeps_a_worker_with_room_registered(db_url: str, wakes: Wakes) -> None:
    """Woken twice (once beyond its room), now with 3 free slots, a worker claims its two
    tasks and stays registered for its last slot (sql/R__claim.sql). A task dispatched
    while its registration is held by a transaction not yet committed is told to it with
    no wake-up handed; a claim that fills its room and leaves that task ready hands it
    one more wake-up, and leaves it no room."""
    conn = wakes.conn
    wakes.idle("a", room=1)
    wakes.dispatch()
    wakes.dispatch()
    assert wakes.told() == [("a", "1"), ("a", "2")]
    got = outbox.claim(conn, ["default"], "a", 2, claim_id="woken", wake=outbox.wake_channel("a"), room=3, seen=2)
    assert len(got) == 2
    assert wakes.told() == []
    wakes.dispatch()                                # a has room for 1 more: woken alone
    assert wakes.told() == [("a", "3")]
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT 1 FROM task_waiters WHERE worker = 'a' FOR UPDATE")
        wakes.dispatch()
        assert wakes.told() == [("a", "")]
    got = outbox.claim(conn, ["default"], "a", 1, claim_id="full", wake=outbox.wake_channel("a"), room=1, seen=3)
    assert len(got) == 1                            # of 2 ready: a is handed one more wake-up
    assert wakes.told() == [("a", "4")]
    assert _room(conn, "a") == -1
    wakes.dispatch()                                # a is busy: one more beyond its room
    assert wakes.told() == [("a", "5")]


def test_wake_ups_on_their_way_to_a_worker_are_not_handed_out_again(wakes: Wakes) -> None:
    """A worker between its wake-up and its next claim stays registered for the rest of
    its room. Its claim says how many wake-ups it has taken up: those handed out after
    it read its channel are still owed, so its room for more is what is left of them."""
    conn = wakes.conn
    wakes.idle("a", room=2)
    wakes.dispatch()
    wakes.dispatch()                                # before a claims: a has room for it
    assert wakes.told() == [("a", "1"), ("a", "2")]
    # a read only the first wake-up before it claimed: one task, one still on its way
    got = outbox.claim(conn, ["default"], "a", 1, claim_id="first", wake=outbox.wake_channel("a"), room=2, seen=1)
    assert len(got) == 1
    wakes.dispatch()                                # a's two slots: one busy, one owed: one beyond
    assert wakes.told() == [("a", "3")]
    got = outbox.claim(conn, ["default"], "a", 1, claim_id="second", wake=outbox.wake_channel("a"), room=1, seen=2)
    assert len(got) == 1                            # full, the third task left for a's third wake-up
    assert wakes.told() == []
    assert _room(conn, "a") == -1


def _room(conn: psycopg.Connection[Any], worker: str) -> int:
    row = conn.execute("SELECT slots - (promised - seen) FROM task_waiters WHERE worker = %s", (worker,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_woken_worker_that_does_not_serve_every_task_also_tells_the_shared_channel(wakes: Wakes) -> None:
    """Workers a (tasks x and y) and b (x only), one dispatch of x and y: both are woken,
    but b's claim cannot take y, and a's may take x; so every worker is told too."""
    wakes.idle("a", names=["x", "y"], room=1)
    wakes.idle("b", names=["x"], room=1)
    wakes.dispatch(nodes=("x", "y"), task_name=None)
    assert wakes.notified() == ["a", "b", "shared"]


def test_a_busy_worker_handed_a_task_that_does_not_serve_every_task_also_tells_the_shared_channel(
        wakes: Wakes) -> None:
    """The same rule for busy workers: a (x only, the most recent) and b (x and y), both
    busy; one dispatch of x and y hands x to a and y to b, but b's claim may take x."""
    wakes.idle("b", names=["x", "y"], room=1)
    wakes.idle("a", names=["x"], room=1)
    wakes.conn.execute("UPDATE task_waiters SET slots = 0")
    wakes.dispatch(nodes=("x", "y"), task_name=None)
    assert wakes.told() == [("a", "1"), ("b", "1"), ("shared", "default")]


def test_a_claim_that_registers_again_never_waits_for_a_dispatch(db_url: str, wakes: Wakes) -> None:
    """A claim writes its worker's registration after it has locked its tasks. A dispatch
    that took that registration meanwhile and has not committed must not make it wait
    there, holding its task while the dispatch may come to need it: the claim leaves the
    registration as the dispatch wrote it."""
    wakes.idle("a", room=2, seen=0)
    wakes.dispatch(nodes=("x",))
    assert wakes.told() == [("a", "1")]
    run_id = add_run(wakes.conn)
    got: list[Any] = []
    with psycopg.connect(db_url, autocommit=True) as claimer, psycopg.connect(db_url) as blocker, \
            psycopg.connect(db_url) as dispatcher:
        claim = threading.Thread(target=lambda: got.append(outbox.claim(
            claimer, ["default"], "a", 2, claim_id="c", wake=outbox.wake_channel("a"), room=2, seen=1)))
        with blocker.transaction():                 # holds the claim at its task update
            blocker.execute("SELECT 1 FROM task_instances WHERE node_id = 'x' FOR UPDATE")
            claim.start()
            wait_for(partial(_lock_waits, wakes.conn, 1), what="the claim waiting at its task")
            Wakes(dispatcher, wakes.listen, wakes.channels).dispatch(run_id, nodes=("y",))  # takes a's row
        assert not _waited_for(claim, dispatcher), "the claim waited for the uncommitted dispatch, holding its task"
    assert [len(g) for g in got] == [1]
    assert wakes.told() == [("a", "2")]             # a had room for y: one slot free, one owed
    assert _room(wakes.conn, "a") == 0


def test_a_claim_that_cannot_write_its_registration_tells_its_own_worker(db_url: str, wakes: Wakes) -> None:
    """A claim that fills its slot and leaves a task no wake-up covers hands its worker
    one more wake-up in its registration; with the registration held by a transaction
    not yet committed, it tells its own worker instead (an empty payload),
    not every worker."""
    wakes.idle("a", room=1, seen=0)
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT 1 FROM task_waiters WHERE worker = 'a' FOR UPDATE")
        wakes.dispatch(nodes=("x", "y"))            # a is held: two rows, so every worker is told
        assert wakes.told() == [("shared", "default")]
        got = outbox.claim(wakes.conn, ["default"], "a", 1, claim_id="held", wake=outbox.wake_channel("a"),
                           room=1, seen=0)
        assert len(got) == 1
        assert wakes.told() == [("a", "")]


def test_a_claim_never_waits_for_a_dispatch_writing_its_registration(db_url: str, wakes: Wakes) -> None:
    """A dispatch that handed worker a a wake-up holds a's registration until it commits.
    a's claim meanwhile, which begins by registering a if it is not yet (sql/R__claim.sql,
    step 1), must not wait for it: it takes its task and leaves the registration as the
    dispatch wrote it."""
    wakes.idle("a", room=2, seen=0)
    wakes.dispatch()
    assert wakes.told() == [("a", "1")]
    got: list[Any] = []
    with psycopg.connect(db_url, autocommit=True) as claimer, psycopg.connect(db_url) as dispatcher:
        Wakes(dispatcher, wakes.listen, wakes.channels).dispatch()      # uncommitted: holds a's row
        claim = threading.Thread(target=lambda: got.append(outbox.claim(
            claimer, ["default"], "a", 1, claim_id="c", wake=outbox.wake_channel("a"), room=2, seen=1)))
        claim.start()
        assert not _waited_for(claim, dispatcher), "the claim waited for the uncommitted dispatch"
    assert [len(g) for g in got] == [1]
    assert wakes.told() == [("a", "2")]


def _waited_for(claim: threading.Thread, holder: psycopg.Connection[Any]) -> bool:
    """Whether ``claim`` (a thread started) was still running after 30 s, while ``holder``
    had not committed; then ``holder`` commits and the claim is given 30 s more to end."""
    claim.join(30)
    waited = claim.is_alive()
    holder.commit()
    claim.join(30)
    return waited


def _lock_waits(conn: psycopg.Connection[Any], n: int) -> bool:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()
    return row is not None and row[0] >= n


def test_a_worker_without_a_handler_for_the_task_is_not_woken(wakes: Wakes) -> None:
    wakes.idle("b", names=["other"], room=1)
    wakes.dispatch(task_name="t")                   # no registered worker serves t
    assert wakes.told() == [("shared", "default")]
    assert len(outbox.claim(wakes.conn, ["default"], "a", 1, task_names=["t"], claim_id="a-first",
                            wake=outbox.wake_channel("a"), room=2)) == 1       # that task, one slot left
    wakes.dispatch(task_name="t")
    assert wakes.notified() == ["a"]
    wakes.dispatch(task_name="t")                   # a is busy; b does not serve t either way
    assert wakes.notified() == ["a"]


def test_a_claim_that_gets_all_it_has_room_for_leaves_no_room_registered(wakes: Wakes) -> None:
    conn = wakes.conn
    wakes.dispatch()
    wakes.dispatch()
    assert wakes.notified() == ["shared", "shared"]
    got = outbox.claim(conn, ["default"], "a", 2, claim_id="full", wake=outbox.wake_channel("a"))
    assert len(got) == 2
    assert _room(conn, "a") == 0
    wakes.dispatch()                                # a is busy: no room, one wake-up beyond it
    assert wakes.told() == [("a", "1")]
    assert _room(conn, "a") == -1


def test_a_rolled_back_dispatch_wakes_nobody_and_keeps_the_registration(db_url: str, wakes: Wakes) -> None:
    wakes.idle("a")
    run_id = add_run(wakes.conn)
    with wakes.conn.transaction():
        wakes.dispatch(run_id)
        raise psycopg.Rollback()
    assert wakes.notified() == []
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert _room(conn, "a") == 2



@pytest.mark.parametrize(("groups", "why"), [
    ((["default"], ["t"], [2], [1, 2]), None),
    ((["default"], ["t"], [1], [1]), "2 rows, 1 places"),
    ((["default"], ["t", "u"], [2], [1, 2]), "groups of 1 queues, 2 names"),
    ((["default", "default"], ["t", "u"], [1, 2], [1, 2]), "2 rows, groups counting 3"),
    (([], [], [], [1, 2]), "groups of 0 queues"),
    ((["default", "default"], ["t", "u"], [2, None], [1, 2]), r"group 2 is \(default, u\) counting <NULL>"),
    ((["default", "default"], ["t", "u"], [2, 0], [1, 2]), r"group 2 is \(default, u\) counting 0"),
    (([None], ["t"], [2], [1, 2]), r"group 1 is \(<NULL>, t\) counting 2"),
], ids=["right", "places", "names", "counts", "none", "null-count", "zero-count", "null-queue"])
def test_a_dispatch_whose_groups_disagree_with_its_rows_writes_nothing(wakes: Wakes, groups: tuple[Any, ...],
                                                                       why: str | None) -> None:
    """composer_enqueue takes the rows' groups from its caller (outbox.dispatch_groups): groups
    that do not add up to the rows, or a group unnamed or uncounted, are refused, and the
    dispatch with them (nothing written, nobody told)."""
    wakes.idle("a")
    run_id = add_run(wakes.conn)
    rows = [{"q": "default", "r": run_id, "t": f"x{i}", "a": 0, "n": "t", "l": 30, "w": 3600} for i in range(2)]
    call = ("SELECT composer_enqueue(%s, now(), interval '0', %s::text[], %s::text[], %s::int[], %s::int[])",
            (psycopg.types.json.Jsonb(rows), *groups))
    if why is None:                             # the right groups: written, handed to a
        wakes.conn.execute(*call)
        assert wakes.told() == [("a", "2")]
        return
    with pytest.raises(psycopg.errors.RaiseException, match=why):
        wakes.conn.execute(*call)
    assert wakes.notified() == []
    assert wakes.conn.execute("SELECT count(*) FROM task_outbox WHERE run_id = %s", (run_id,)).fetchone() == (0,)
    assert _room(wakes.conn, "a") == 2



#: What a queue or task name can hold: any text but NUL, which PostgreSQL's text cannot.
_NAMED = st.characters(codec="utf-8", exclude_characters="\x00")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example([{"q": "NULL", "n": ""}, {"q": " a ", "n": "\\"}, {"q": '"', "n": "{"}, {"q": ",", "n": "}"},
          {"q": "é\\\"", "n": "NULL"}])
@given(st.lists(st.fixed_dictionaries({"q": st.text(_NAMED, min_size=1, max_size=6), "n": st.text(_NAMED, max_size=6)}),
                min_size=1, max_size=6))
def test_the_groups_reach_the_dispatch_as_they_were(wakes: Wakes, rows: list[dict[str, str]]) -> None:
    """outbox.dispatch_groups passes each group as an array literal: whatever a queue or task
    name holds (quotes, backslashes, commas, braces), the server reads back outbox.groups."""
    literals = dispatch_groups(rows)
    got = wakes.conn.execute("SELECT %s::text[], %s::text[], %s::int[], %s::int[]", literals).fetchone()
    assert got == outbox.groups(rows)


ONE = {"id": "one", "nodes": [{"id": "a", "type": "TASK", "task": "noop"}]}


@contextmanager
def _idle_workers(db_url: str, engine: Engine, n: int = 4) -> Iterator[dict[str, int]]:
    """``n`` workers of 4 slots, each counting its claims and the empty ones, started,
    registered and idle; the counts start at zero then."""
    counts = {"claims": 0, "empty": 0}
    lock = threading.Lock()
    workers = []
    for i in range(n):
        w_engine = Engine.connect(db_url, pool_size=2)
        claim = w_engine.claim

        def counted(*args: Any, _claim: Any = claim, **kwargs: Any) -> Any:
            got = _claim(*args, **kwargs)
            with lock:
                counts["claims"] += 1
                counts["empty"] += not got
            return got

        w_engine.claim = counted  # type: ignore[method-assign]
        # No poll within the test, however long a loaded machine makes it: every claim
        # counted is one a dispatch's wake-up started (a poll while nothing is queued is
        # an empty claim, and the number of polls grows with the test's duration).
        worker = Worker(w_engine, concurrency=4, poll_interval=3600.0, worker_id=f"w{i}")
        worker.handler("noop")(lambda _input, _ctx: None)
        workers.append(worker)
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: counts["claims"] >= n, what="every worker's first claim")
        wait_for(lambda: _waiting(engine) == n, what="every worker registered")
        with lock:
            counts.update(claims=0, empty=0)
        yield counts
    finally:
        for w in workers:
            w.stop()
        for t in threads:
            t.join(60)
        for w in workers:
            w.engine.close()


FOUR = {"id": "four", "nodes": [{"id": n, "type": "TASK", "task": "noop"} for n in "abcd"]}


@pytest.mark.parametrize(("spec", "runs", "min_claims", "max_empty"), [(ONE, 20, 20, 2), (FOUR, 10, 10, 4)],
                         ids=["one-task-runs", "four-task-runs"])
def test_four_idle_workers_few_empty_claims(db_url: str, spec: dict[str, Any], runs: int, min_claims: int,
                                            max_empty: int) -> None:
    """Four idle workers of 4 slots, one run at a time. Runs of one task: each dispatch
    wakes one worker, so a claim comes back empty only when a wake-up races a poll (with
    every worker woken by each dispatch, three claims in four would be). Runs of four
    tasks, dispatched by one statement: the dispatch hands the four to one worker with
    room for them, which claims them (with the shared channel told, or a worker woken
    per task each claiming all it has room for, the others' claims would come back
    empty)."""
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(spec)
        with _idle_workers(db_url, engine) as counts:
            for _ in range(runs):
                run_id = engine.start(spec["id"])
                wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
                wait_for(lambda: _waiting(engine) == 4, what="every worker idle again")
    assert counts["claims"] >= min_claims
    assert counts["empty"] <= max_empty, counts


XY = {"id": "xy", "nodes": [{"id": "nx", "type": "TASK", "task": "x"}, {"id": "ny", "type": "TASK", "task": "y"}]}


def test_workers_serving_different_tasks_each_claim_theirs_at_once(db_url: str) -> None:
    """Idle workers A (tasks x and y) and B (x only, its claims 0.3 s slower), a run of x
    and y: each task is claimed well within the poll interval (5 s). Were A to claim
    one task for its one wake-up with nobody else told, it would take x and leave y for
    its next poll."""
    claimed: dict[str, float] = {}

    def slowly(claim: Any, delay: float) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            got = claim(*args, **kwargs)
            claimed.update((c.node_id, time.monotonic()) for c in got)
            return got
        return timed

    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(XY)
        running = []
        for worker_id, names, delay in (("B", ["x"], 0.3), ("A", ["x", "y"], 0.0)):
            w_engine = Engine.connect(db_url, pool_size=2)
            w_engine.claim = slowly(w_engine.claim, delay)  # type: ignore[method-assign]
            worker = Worker(w_engine, concurrency=4, poll_interval=5.0, worker_id=worker_id)
            for name in names:
                worker.handler(name)(lambda _input, _ctx: None)
            thread = threading.Thread(target=worker.run, daemon=True)
            thread.start()
            running.append((worker, thread))
            wait_for(partial(_registered, engine, worker_id), what=f"{worker_id} idle")
        try:
            began = time.monotonic()
            run_id = engine.start("xy")
            wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
        finally:
            for worker, thread in running:
                worker.stop()
                thread.join(60)
                worker.engine.close()
    assert {node: round(at - began, 2) for node, at in claimed.items() if at - began > 1.0} == {}


def test_a_stopped_worker_is_no_longer_registered(db_url: str) -> None:
    """A worker's registration goes with its clean stop: a dispatch would otherwise wake
    a worker that can no longer claim."""
    with Engine.connect(db_url, pool_size=2) as engine:
        worker = Worker(engine, concurrency=2, poll_interval=5.0, worker_id="leaving")
        worker.handler("noop")(lambda _input, _ctx: None)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        wait_for(lambda: _waiters(engine) == ["leaving"], what="the worker registered")
        worker.stop()
        thread.join(60)
        assert _waiters(engine) == []


def _finished(engine: Engine, run_id: str) -> bool:
    return engine.get_run(run_id).status in TERMINAL


def _waiters(engine: Engine) -> list[str]:
    with engine.pool.connection() as conn:
        return [r[0] for r in conn.execute("SELECT worker FROM task_waiters WHERE slots > promised - seen "
                                           "ORDER BY worker").fetchall()]


def _registered(engine: Engine, worker_id: str) -> bool:
    return worker_id in _waiters(engine)


def _waiting(engine: Engine) -> int:
    return len(_waiters(engine))


def test_a_worker_counts_its_claims_by_what_started_them(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker.claim_counts, which the benchmark reads to say where empty claims come
    from: the first claim (``room``) finds nothing; a dispatch wakes the worker on its
    own channel (``own``) and its claim gets the task; a notification on the shared
    channel with nothing queued (``shared``) makes a claim that comes back empty, as does
    an empty one on its own channel (counted ``shared`` too). All but the first claim
    say they were woken (they leave tasks handed to other workers to them)."""
    with Engine.connect(db_url, pool_size=2) as engine:
        engine.deploy(ONE)
        w_engine = Engine.connect(db_url, pool_size=2)
        woken: list[bool] = []
        claim = w_engine.claim

        def recording(*args: Any, **kwargs: Any) -> Any:
            woken.append(kwargs["woken"])
            return claim(*args, **kwargs)

        monkeypatch.setattr(w_engine, "claim", recording)
        worker = Worker(w_engine, concurrency=4, poll_interval=30.0, worker_id="counting")
        worker.handler("noop")(lambda _input, _ctx: None)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for(partial(_registered, engine, "counting"), what="the worker idle")
            run_id = engine.start("one")
            wait_for(partial(_finished, engine, run_id), what=f"run {run_id}")
            with engine.pool.connection() as conn:
                conn.execute("SELECT pg_notify(%s, 'default')", (outbox.CHANNEL,))
            wait_for(lambda: worker.claim_counts()["shared"]["claims"] == 1, what="the shared wake-up's claim")
            with engine.pool.connection() as conn:
                conn.execute("SELECT pg_notify(%s, '')", (outbox.wake_channel("counting"),))
            wait_for(lambda: worker.claim_counts()["shared"]["claims"] == 2, what="the told claim")
        finally:
            worker.stop()
            thread.join(60)
            w_engine.close()
    assert worker.claim_counts() == {"own": {"claims": 1, "empty": 0}, "shared": {"claims": 2, "empty": 2},
                                     "room": {"claims": 1, "empty": 1}}
    assert woken == [False, True, True, True]


def test_a_worker_that_unregisters_passes_on_what_it_was_woken_for(wakes: Wakes) -> None:
    """A stopping worker's registration goes (outbox.unregister): dispatches hand its
    room to the others, and wake-ups it had not taken up, or the word it was told and
    had not claimed for, are told on the shared channel; nothing else is."""
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert wakes.told() == [("b", "1")]
    assert outbox.unregister(wakes.conn, "b", seen=0, told=False)       # its wake-up not taken up
    assert wakes.told() == [("shared", "default")]
    assert not outbox.unregister(wakes.conn, "b", seen=0, told=False)   # gone already
    wakes.dispatch()
    assert wakes.told() == [("a", "1")]
    assert not outbox.unregister(wakes.conn, "a", seen=1, told=False)   # all taken up: no one told
    assert wakes.notified() == []
    wakes.idle("c", names=["other"])              # the rows above wait: it claims none of them
    assert outbox.unregister(wakes.conn, "c", seen=0, told=True)        # told, not yet claimed
    assert wakes.told() == [("shared", "default")]
    wakes.idle("c", names=["other"])
    wakes.dispatch(task_name="other")
    assert wakes.told() == [("c", "1")]
    assert outbox.unregister(wakes.conn, "c", seen=None, told=False)    # the row's own seen: 0 of 1
    assert wakes.told() == [("shared", "default")]
    with wakes.conn.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM task_waiters").fetchone() == (0,)


def _handed(conn: psycopg.Connection[Any]) -> list[str | None]:
    """The worker each ready outbox row was handed to, in ID order."""
    return [h for (h,) in conn.execute("SELECT handed_to FROM task_outbox ORDER BY id")]


def _claim(wakes: Wakes, worker: str, *, woken: bool, room: int = 2, ready_s: float = 0.0) -> list[str]:
    """A claim of ``worker`` for ``room`` slots, woken (as its own wake-ups or the word
    it was told make it claim) or not (its poll): the task IDs it took. Every ready row
    has been ready ``ready_s`` seconds when it claims, by the clock of its transaction
    (no time passes between the two on a loaded machine)."""
    with wakes.conn.transaction():
        wakes.conn.execute("UPDATE task_outbox SET available_at = now() - make_interval(secs => %s)", (ready_s,))
        got = outbox.claim(wakes.conn, ["default"], worker, room, claim_id=f"{worker}-{woken}-{time.monotonic_ns()}",
                           wake=outbox.wake_channel(worker), room=room, woken=woken)
    return [c.task_id for c in got]


def test_a_woken_claim_leaves_the_task_handed_to_another_worker(wakes: Wakes) -> None:
    """The row a dispatch handed to b records b; a's claim, woken (on the shared
    channel, say), leaves it to b, whose wake-up is for it; a's poll takes any row."""
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert wakes.told() == [("b", "1")]
    assert _handed(wakes.conn) == ["b"]
    assert _claim(wakes, "a", woken=True) == []
    assert _handed(wakes.conn) == ["b"]
    assert len(_claim(wakes, "a", woken=False)) == 1
    assert _handed(wakes.conn) == []


def test_the_woken_worker_takes_the_task_handed_to_it(wakes: Wakes) -> None:
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert _handed(wakes.conn) == ["b"]
    assert len(_claim(wakes, "b", woken=True)) == 1


def test_a_task_handed_to_a_worker_no_longer_registered_is_any_woken_claims(wakes: Wakes) -> None:
    """b stops (its registration deleted, its wake-up told on the shared channel): a's
    woken claim takes the row handed to b."""
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert outbox.unregister(wakes.conn, "b", seen=0, told=False)
    assert wakes.told() == [("b", "1"), ("shared", "default")]
    assert len(_claim(wakes, "a", woken=True)) == 1


def test_a_task_handed_to_another_worker_a_second_ago_is_any_woken_claims(wakes: Wakes) -> None:
    """b was killed (its registration outlives it) or runs long handlers: once the row
    handed to it has been ready a second, a's woken claim takes it."""
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert _claim(wakes, "a", woken=True, ready_s=0.9) == []
    assert len(_claim(wakes, "a", woken=True, ready_s=1.1)) == 1


def test_every_task_handed_out_records_its_worker(wakes: Wakes) -> None:
    """Rows handed to workers with room, to busy workers beyond their room, and the one
    row told with no wake-up handed each record the worker; rows told on the shared
    channel none. A woken claim takes its own rows and those handed to nobody."""
    for w in "ab":
        wakes.idle(w, room=1)
    wakes.dispatch(nodes=("p", "q", "r", "s", "t"))
    # a and b one each for their room, one each beyond it, then the fifth told to b
    assert wakes.told() == [("a", "1"), ("a", "2"), ("b", ""), ("b", "1"), ("b", "2")]
    assert sorted(_handed(wakes.conn), key=str) == ["a", "a", "b", "b", "b"]
    wakes.dispatch(nodes=("u", "v", "w"))       # one more beyond each, the third told to b
    assert wakes.told() == [("a", "3"), ("b", ""), ("b", "3")]
    wakes.dispatch(nodes=("x", "y"))            # both at two beyond: the shared channel
    assert wakes.told() == [("shared", "default")]
    assert sorted(_handed(wakes.conn), key=str) == [None, None, "a", "a", "a", "b", "b", "b", "b", "b"]
    got = _claim(wakes, "a", woken=True, room=10)
    assert len(got) == 5                         # its three and the two handed to nobody
    assert _handed(wakes.conn) == ["b"] * 5


def test_a_task_handed_to_a_worker_with_no_wake_up_to_take_up_is_any_woken_claims(wakes: Wakes) -> None:
    """b has taken up the wake-up handed to it (its claim took another row, and no
    wake-up was owed to it for this one): b will not claim for it, so a's woken claim
    takes the row rather than leave it to a poll."""
    wakes.idle("a")
    wakes.idle("b")
    wakes.dispatch()
    assert wakes.told() == [("b", "1")]
    assert _claim(wakes, "a", woken=True) == []
    wakes.conn.execute("UPDATE task_waiters SET seen = promised WHERE worker = 'b'")
    assert len(_claim(wakes, "a", woken=True)) == 1


def test_a_task_ready_later_is_handed_to_nobody(wakes: Wakes) -> None:
    """A row written to be ready later (a retry's backoff) is written with no worker:
    whoever claims when it is ready takes it."""
    wakes.idle("a")
    run_id = add_run(wakes.conn)
    now = clock.now(wakes.conn)
    assert tasks.insert_task(wakes.conn, run_id, task_id="later", node_id="t", node_type="TASK", queue="default",
                             state="PENDING", now=now)
    outbox.enqueue(wakes.conn, [Dispatch(run_id=run_id, task_id="later", attempt=0, queue="default",
                                         task_name="t", lease_s=30, available_at=now + timedelta(seconds=30))],
                   now=now)
    assert wakes.told() == [("a", "1")]
    assert _handed(wakes.conn) == [None]


def test_rows_of_several_tasks_are_each_handed_to_a_worker_serving_them(wakes: Wakes) -> None:
    """One dispatch of rows of two task names, interleaved: each row is written with the
    worker that serves its task (the shared channel is told too, as each worker serves
    only some of the rows)."""
    wakes.idle("a", names=["x"], room=3)
    wakes.idle("b", names=["y"], room=3)
    run_id = add_run(wakes.conn)
    now = clock.now(wakes.conn)
    names = ["x", "y", "x", "y", "y"]
    for i in range(len(names)):
        assert tasks.insert_task(wakes.conn, run_id, task_id=f"t{i}", node_id=f"n{i}", node_type="TASK",
                                 queue="default", state="PENDING", now=now)
    outbox.enqueue(wakes.conn, [Dispatch(run_id=run_id, task_id=f"t{i}", attempt=0, queue="default",
                                         task_name=name, lease_s=30) for i, name in enumerate(names)], now=now)
    assert wakes.told() == [("a", "2"), ("b", "3"), ("shared", "default")]
    rows = wakes.conn.execute("SELECT task_id, handed_to FROM task_outbox ORDER BY task_id").fetchall()
    assert rows == [("t0", "a"), ("t1", "b"), ("t2", "a"), ("t3", "b"), ("t4", "b")]

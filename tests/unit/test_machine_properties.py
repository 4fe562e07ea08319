"""Property tests: random workflows driven by random, duplicated and stale events.

``Sim`` (from ``machine_sim``) already asserts, on every applied action, that a node
gets at most one task, is created only after all its dependencies are terminal, is
SKIPPED exactly when it has no live dependency, and that a finished run keeps no
active task. These tests add an independent oracle for staleness, check that a
finished run never changes, and that draining a run always finishes it.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer_ops.core import model
from composer_ops.core.model import NodeType, RunStatus, TaskState
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Conflict

from .machine_sim import Sim

LABELS = ("a", "b", "c")
EVENT_NAMES = ("e1", "e2")
VALID_AT = "2030-01-01T00:00:00Z"
#: The node types these random graphs use; MAP items and SUB_WORKFLOW children have
#: tests of their own (test_machine_map, test_machine_children).
GRAPH_TYPES = [t for t in NodeType if t not in (NodeType.MAP, NodeType.SUB_WORKFLOW)]


@st.composite
def workflows(draw: st.DrawFn) -> dict[str, Any]:
    """A random DAG: edges only point backwards in declaration order, so it is acyclic."""
    count = draw(st.integers(1, 10))
    ids = [f"n{i}" for i in range(count)]
    # Dependencies favour the few preceding nodes, and a node is often a twin of the
    # previous one (same dependencies, same type), so siblings that become ready in
    # the same decision, and compete for one buffered signal, are common.
    deps: list[list[str]] = []
    kinds: list[NodeType] = []
    twins: list[bool] = []
    for i in range(count):
        twin = i > 1 and draw(st.integers(0, 3)) == 0
        twins.append(twin)
        if twin:
            deps.append(deps[i - 1])
            kinds.append(kinds[i - 1])
        else:
            deps.append(sorted(draw(st.sets(st.sampled_from(ids[max(0, i - 4) : i]), max_size=3))) if i else [])
            kinds.append(draw(st.sampled_from(GRAPH_TYPES)))
    nodes: list[dict[str, Any]] = []
    for i, node_id in enumerate(ids):
        node: dict[str, Any] = {"id": node_id, "type": str(kinds[i]), "depends_on": deps[i]}
        kind = kinds[i]
        if kind is NodeType.TASK:
            node["task"] = "work"
            node["retry"] = {
                "max_attempts": draw(st.integers(1, 3)),
                "initial_backoff_s": draw(st.sampled_from([0, 1])),
            }
            node["optional"] = draw(st.booleans())
            node["lease_s"] = draw(st.sampled_from([2, 5, 30]))
            if len(deps[i]) > 0 and draw(st.booleans()):
                node["input"] = {"x": f"$.nodes.{draw(st.sampled_from(deps[i]))}.output.v", "k": f"$.input.k{i}"}
        elif kind is NodeType.SWITCH:
            dependents = [ids[j] for j in range(i + 1, count) if node_id in deps[j]]
            if len(deps[i]) > 0 and draw(st.booleans()):
                node["expression"] = f"$.nodes.{draw(st.sampled_from(deps[i]))}.output.v"
            else:
                node["expression"] = f"$.input.k{i}"
            branch_lists = st.lists(st.sampled_from(dependents), unique=True) if dependents else st.just([])
            node["cases"] = {label: draw(branch_lists) for label in draw(st.sets(st.sampled_from(LABELS)))}
            if draw(st.booleans()):
                node["default"] = draw(branch_lists)
        elif kind is NodeType.WAIT:
            if draw(st.integers(0, 3)) == 0:
                node["until"] = "$.input.at"
                node["optional"] = draw(st.booleans())
            else:
                node["duration_s"] = draw(st.sampled_from([0, 1, 5]))
        else:
            node["signal"] = nodes[i - 1]["signal"] if twins[i] else draw(st.sampled_from(EVENT_NAMES))
            timeout = draw(st.sampled_from([None, 2, 10]))
            if timeout is not None:
                node["timeout_s"] = timeout
            node["on_timeout"] = draw(st.sampled_from(["fail", "continue"]))
            node["optional"] = draw(st.booleans())
        nodes.append(node)
    # A node whose every dependency is a SWITCH that names it nowhere can never run, and
    # deploy refuses it (core/spec.py): the first of those switches takes it as a default.
    by_id = {n["id"]: n for n in nodes}
    for node in nodes:
        switches = [by_id[d] for d in node["depends_on"]]
        if switches and all(d["type"] == "SWITCH" and not any(
                node["id"] in targets for targets in [*d["cases"].values(), d.get("default", [])]) for d in switches):
            switches[0]["default"] = [*switches[0].get("default", []), node["id"]]
    return {"id": "random", "nodes": nodes}


def run_inputs(count: int = 10) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {f"k{i}": st.sampled_from(LABELS) for i in range(count)} | {"at": st.sampled_from([VALID_AT, "garbage"])}
    )


def state_of(sim: Sim) -> tuple[Any, ...]:
    return (sim.status, dict(sim.nodes), len(sim.signals), frozenset(sim.consumed), sim.minted)


def expected_current(sim: Sim, event: model.Event) -> bool:
    """Independent oracle: does this event change the run (i.e. is it not stale)?"""
    if sim.status not in model.ACTIVE_RUN_STATUSES:
        return False
    if isinstance(event, model.StartRun):
        return not sim.nodes
    if isinstance(event, model.TimerDue):
        state = sim.nodes.get(event.node_id)
        return (
            state is not None
            and state.task_id == event.task_id
            and state.state is TaskState.WAITING
            and sim.spec.nodes[event.node_id].type in (NodeType.WAIT, NodeType.WAIT_FOR_SIGNAL)
        )
    assert isinstance(event, model.TaskCompleted | model.TaskFailed | model.LeaseExpired)
    ref = event.ref
    state = sim.nodes.get(ref.node_id)
    if (
        state is None
        or ref.run_id != sim.run_id
        or state.task_id != ref.task_id
        or state.attempt != ref.attempt
        or state.state is not TaskState.RUNNING
        or (ref.lease_owner is not None and ref.lease_owner != state.lease_owner)
    ):
        return False
    lapsed = state.lease_expires_at is not None and state.lease_expires_at <= event.now
    return lapsed if isinstance(event, model.LeaseExpired) else not lapsed


def send_checked(sim: Sim, event: model.Event) -> model.Decision | None:
    """Send an event and check it against the oracle; ``None`` when it raised Conflict."""
    before = state_of(sim)
    finished = sim.status not in model.ACTIVE_RUN_STATUSES
    if isinstance(event, model.SignalReceived | model.CancelRun):
        if finished:
            try:
                sim.send(event)
            except Conflict:
                assert state_of(sim) == before
                return None
            raise AssertionError("signal or cancel on a finished run must raise Conflict")
        # The signal's waiters, earliest-created first (database clock, then task id);
        # those whose timeout has passed by the event's clock time out first.
        waiters = sorted(
            (s.created_at, s.task_id, n, s.wake_at)
            for n, s in sim.nodes.items()
            if isinstance(event, model.SignalReceived) and s.state is TaskState.WAITING and s.signal_name == event.name
        )
        decision = sim.send(event)
        assert not decision.stale and decision.actions
        if isinstance(event, model.SignalReceived):
            check_signal(decision, event, [(task_id, node_id, wake) for _, task_id, node_id, wake in waiters])
        return decision
    current = expected_current(sim, event)
    decision = sim.send(event)
    assert decision.stale is (not current), (event, decision)
    if decision.stale:
        assert state_of(sim) == before, "a stale event changed the run"
    else:
        assert decision.actions
    if finished:
        assert state_of(sim) == before, "a finished run changed"
    return decision


def check_signal(decision: model.Decision, event: model.SignalReceived, waiters: list[tuple[str, str, Any]]) -> None:
    """Timed-out waiters are resolved by their timers, in creation order; then the signal
    resolves exactly one live waiter, or is buffered, or (the timeouts finished the run)
    is refused. It never resolves more than one node."""
    timed_out: list[str] = []
    live: tuple[str, str] | None = None
    for task_id, node_id, wake in waiters:
        if wake is not None and wake <= event.now:
            timed_out.append(node_id)
            continue
        live = (task_id, node_id)
        break
    existing = {node_id for _, node_id, _ in waiters}
    resolved = [a for a in decision.actions if isinstance(a, model.ResolveWait) and a.node_id in existing]
    timers = [a.node_id for a in resolved if a.timer]
    assert timers == timed_out[: len(timers)], (timers, timed_out)
    by_signal = [a for a in resolved if not a.timer]
    buffers = [a for a in decision.actions if isinstance(a, model.BufferSignal)]
    assert len(by_signal) + len(buffers) <= 1, decision
    if decision.refused is not None:
        assert not by_signal and not buffers and decision.finish is not None
        return
    assert timers == timed_out
    if live is not None:
        assert [(a.task_id, a.node_id) for a in by_signal] == [live] and by_signal[0].output == event.payload
    else:
        assert not by_signal and [(b.name, b.payload) for b in buffers] == [(event.name, event.payload)]


def moves(sim: Sim) -> list[tuple[Any, ...]]:
    """Everything a worker, the timer loop, the sweeper or a client could do now."""
    out: list[tuple[Any, ...]] = [("start",), ("replay",)]
    for node_id, state in sorted(sim.nodes.items()):
        if state.state in (TaskState.PENDING, TaskState.QUEUED):
            out += [("claim", node_id), ("unclaimed_result", node_id)]
        elif state.state is TaskState.RUNNING:
            out += [("complete", node_id), ("fail", node_id), ("expire", node_id), ("intruder", node_id)]
        elif state.state is TaskState.WAITING:
            out.append(("fire", node_id))
        else:
            out.append(("fire_done", node_id))
        if state.attempt > 0:
            out.append(("old_attempt", node_id))
    out += [("signal", name) for name in sorted({n.signal_name for n in sim.spec.nodes.values() if n.signal_name})]
    return out


def perform(sim: Sim, move: tuple[Any, ...], data: st.DataObject, history: list[model.Event]) -> None:
    kind = move[0]
    event: model.Event | None = None
    if kind == "start":
        event = model.StartRun(now=sim.now)
    elif kind == "replay":
        if history:
            event = data.draw(st.sampled_from(history))
            if isinstance(event, model.SignalReceived):
                event = None
    elif kind == "claim":
        node_id = move[1]
        available = sim.rows[node_id].available_at
        if available is not None and available > sim.now:
            sim.now = available
        sim.claim(node_id, owner=data.draw(st.sampled_from(["w1", "w2"])))
    elif kind == "unclaimed_result":
        event = model.TaskCompleted(ref=sim.ref(move[1]), output=None, now=sim.now)
    elif kind == "complete":
        output = {"v": data.draw(st.sampled_from(LABELS))}
        event = model.TaskCompleted(ref=sim.ref(move[1], sim.nodes[move[1]].lease_owner), output=output, now=sim.now)
    elif kind == "fail":
        event = model.TaskFailed(
            ref=sim.ref(move[1], sim.nodes[move[1]].lease_owner),
            error="boom",
            retryable=data.draw(st.booleans()),
            now=sim.now,
        )
    elif kind == "expire":
        expires = sim.nodes[move[1]].lease_expires_at
        assert expires is not None
        if data.draw(st.booleans()):
            sim.now = max(sim.now, expires)
        event = model.LeaseExpired(ref=sim.ref(move[1], None), now=sim.now)
    elif kind == "intruder":
        event = model.TaskCompleted(ref=sim.ref(move[1], "intruder"), output=None, now=sim.now)
    elif kind in ("fire", "fire_done"):
        wake_at = sim.rows[move[1]].wake_at
        if wake_at is not None and wake_at > sim.now:
            sim.now = wake_at
        event = model.TimerDue(task_id=sim.nodes[move[1]].task_id, node_id=move[1], now=sim.now)
    elif kind == "old_attempt":
        state = sim.nodes[move[1]]
        ref = model.TaskRef(task_id=state.task_id, run_id=sim.run_id, node_id=move[1], attempt=state.attempt - 1)
        event = model.TaskCompleted(ref=ref, output=None, now=sim.now)
    elif kind == "signal":
        event = model.SignalReceived(name=move[1], payload={"v": data.draw(st.sampled_from(LABELS))}, now=sim.now)
    elif kind == "cancel":
        event = model.CancelRun(reason="random cancel", now=sim.now)
    if event is not None:
        history.append(event)
        send_checked(sim, event)
    sim.tick(data.draw(st.sampled_from([0, 0, 1, 3])))


def drain(sim: Sim) -> None:
    """Report every outstanding task until the run finishes; it must not get stuck."""
    for _ in range(300):
        if sim.status not in model.ACTIVE_RUN_STATUSES:
            return
        for node_id, state in sorted(sim.nodes.items()):
            if state.state is TaskState.RUNNING:
                assert state.lease_expires_at is not None
                if state.lease_expires_at <= sim.now:
                    send_checked(sim, model.LeaseExpired(ref=sim.ref(node_id, None), now=sim.now))
                else:
                    send_checked(sim, model.TaskCompleted(ref=sim.ref(node_id, None), output={"v": "a"}, now=sim.now))
                break
            if state.state in (TaskState.PENDING, TaskState.QUEUED):
                available = sim.rows[node_id].available_at
                if available is not None and available > sim.now:
                    sim.now = available
                sim.claim(node_id)
                break
            if state.state is TaskState.WAITING:
                node = sim.spec.nodes[node_id]
                if node.type is NodeType.WAIT_FOR_SIGNAL:
                    assert node.signal_name is not None
                    send_checked(sim, model.SignalReceived(name=node.signal_name, payload={"v": "b"}, now=sim.now))
                else:
                    wake_at = sim.rows[node_id].wake_at
                    assert wake_at is not None
                    sim.now = max(sim.now, wake_at)
                    send_checked(sim, model.TimerDue(task_id=state.task_id, node_id=node_id, now=sim.now))
                break
        else:
            raise AssertionError(f"run is {sim.status} but no task can make progress: {sim.nodes}")
    raise AssertionError("run did not finish")


def check_final(sim: Sim) -> None:
    assert sim.status not in model.ACTIVE_RUN_STATUSES
    assert not [n for n, s in sim.nodes.items() if s.state in model.ACTIVE_TASK_STATES]
    task_ids = [s.task_id for s in sim.nodes.values()]
    assert len(task_ids) == len(set(task_ids))
    if sim.status is RunStatus.SUCCEEDED:
        assert set(sim.nodes) == set(sim.spec.nodes)
        assert set(sim.run_output) == set(sim.spec.sinks())
        for node_id, node in sim.spec.nodes.items():
            skipped = bool(node.depends_on) and not any(sim.live(d, node_id) for d in node.depends_on)
            assert (sim.nodes[node_id].state is TaskState.SKIPPED) == skipped
            if sim.nodes[node_id].state is TaskState.FAILED:
                assert node.optional
    elif sim.status is RunStatus.FAILED:
        failed = [n for n, s in sim.nodes.items() if s.state is TaskState.FAILED and not sim.spec.nodes[n].optional]
        assert len(failed) == 1
        assert sim.run_reason is not None and f'node "{failed[0]}"' in sim.run_reason
    for state in sim.nodes.values():
        assert state.state in model.TERMINAL_TASK_STATES


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=workflows(), run_input=run_inputs(), data=st.data())
def test_random_event_orders_keep_the_invariants(doc: dict[str, Any], run_input: dict[str, Any], data: Any) -> None:
    sim = Sim(doc, input=run_input)
    history: list[model.Event] = []
    start = model.StartRun(now=sim.now)
    history.append(start)
    send_checked(sim, start)
    for _ in range(data.draw(st.integers(0, 40), label="steps")):
        options = moves(sim)
        if data.draw(st.integers(0, 19), label="cancel?") == 0:
            options.append(("cancel",))
        perform(sim, data.draw(st.sampled_from(options), label="move"), data, history)
    drain(sim)
    check_final(sim)

    frozen = state_of(sim)
    for event in history[-15:]:
        send_checked(sim, event)
    for event in (model.CancelRun(reason="late", now=sim.now),
                  model.SignalReceived(name="e1", payload=None, now=sim.now)):
        send_checked(sim, event)
    assert state_of(sim) == frozen


@settings(max_examples=200, deadline=None)
@given(doc=workflows())
def test_random_specs_round_trip(doc: dict[str, Any]) -> None:
    spec = parse_spec(doc)
    assert parse_spec(spec.to_json()) == spec
    order = spec.topological_order()
    assert sorted(order) == sorted(spec.nodes)
    position = {n: i for i, n in enumerate(order)}
    for node in spec.nodes.values():
        assert all(position[d] < position[node.id] for d in node.depends_on)
        for dependent in spec.dependents(node.id):
            assert node.id in spec.nodes[dependent].depends_on


@settings(max_examples=100, deadline=None)
@given(doc=workflows(), run_input=run_inputs())
def test_happy_path_reaches_a_terminal_status(doc: dict[str, Any], run_input: dict[str, Any]) -> None:
    """With no failures injected, a run never fails unless a wait cannot resolve."""
    sim = Sim(doc, input=run_input)
    send_checked(sim, model.StartRun(now=sim.now))
    drain(sim)
    check_final(sim)
    if sim.status is RunStatus.FAILED:
        # Only a wait can fail here: a WAIT whose `until` is garbage, or a WAIT_FOR_SIGNAL
        # whose signal came (by the clock) after its timeout.
        failed = [n for n, s in sim.nodes.items() if s.state is TaskState.FAILED]
        for node_id in failed:
            if sim.spec.nodes[node_id].type is NodeType.WAIT:
                assert run_input["at"] == "garbage"
            else:
                assert sim.spec.nodes[node_id].type is NodeType.WAIT_FOR_SIGNAL, sim.run_reason
                assert "timed out" in str(sim.rows[node_id].error), sim.rows[node_id].error


def test_stale_events_on_a_sample_run_are_reported() -> None:
    """A deterministic smoke test of the oracle itself, so a broken oracle cannot pass silently."""
    sim = Sim({"id": "w", "nodes": [{"id": "a", "type": "TASK", "task": "t"}]})
    send_checked(sim, model.StartRun(now=sim.now))
    ref = sim.claim("a")
    assert expected_current(sim, model.TaskCompleted(ref=ref, output=1, now=sim.now))
    late = dataclasses.replace(ref, attempt=1)
    assert not expected_current(sim, model.TaskCompleted(ref=late, output=1, now=sim.now))
    assert not expected_current(sim, model.LeaseExpired(ref=ref, now=sim.now))
    assert expected_current(sim, model.LeaseExpired(ref=ref, now=sim.now + timedelta(seconds=30)))

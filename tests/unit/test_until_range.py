"""A WAIT ``until`` must be an instant the database stores and every session reads
back: a literal outside that range is refused at deploy, naming the node; a ``$.``
reference that resolves outside it fails the node when the run reaches it, clearly,
instead of writing a wake-up nobody can read."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from composer_ops.core.instants import EARLIEST_INSTANT, LATEST_INSTANT, instant_in_range
from composer_ops.core.model import TaskState
from composer_ops.core.spec import parse_spec
from composer_ops.errors import Invalid
from tests.unit.machine_sim import Sim, kinds, task, wf

OUTSIDE = [
    "9999-12-31T23:59:59-23:59",    # past year 9999 once in UTC
    "9999-12-31T00:00:00Z",         # a session 16 hours east of UTC would read year 10000
    "0001-01-01T00:00:00+01:00",    # before year 1 in UTC
    "0001-01-01T12:00:00Z",
]
INSIDE = ["0001-01-02T00:00:00Z", "9999-12-30T23:59:59Z", "9999-12-30T23:59:59.999999+00:00", "2030-01-01T00:00:00Z"]


@pytest.mark.parametrize("until", OUTSIDE)
def test_a_literal_until_out_of_range_is_refused_at_deploy(until: str) -> None:
    with pytest.raises(Invalid, match=r'node "w": until .* outside the instants the database can store') as caught:
        parse_spec(wf({"id": "w", "type": "WAIT", "until": until}))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("until", INSIDE)
def test_a_literal_until_in_range_is_accepted(until: str) -> None:
    assert parse_spec(wf({"id": "w", "type": "WAIT", "until": until})).nodes["w"].until == until


def test_the_range_ends() -> None:
    assert instant_in_range(EARLIEST_INSTANT) and instant_in_range(LATEST_INSTANT)
    assert not instant_in_range(datetime(9999, 12, 31, tzinfo=UTC))
    assert not instant_in_range(datetime(1, 1, 1, 23, 59, tzinfo=UTC))


@pytest.mark.parametrize("at", OUTSIDE)
def test_a_reference_resolving_out_of_range_fails_the_node(at: str) -> None:
    sim = Sim(wf(task("other"), {"id": "w", "type": "WAIT", "until": "$.input.at"}), input={"at": at})
    decision = sim.start()
    # "other" is created in the decision that fails the run: born CANCELLED, never dispatched.
    assert kinds(decision) == ["Create other CANCELLED", "Create w FAILED", "FinishRun FAILED"]
    error = sim.rows["w"].error
    assert error is not None and "outside the instants the database can store and read back" in error
    assert sim.rows["w"].wake_at is None
    assert sim.state("other") is TaskState.CANCELLED

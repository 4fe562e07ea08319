"""Signals and waits on Citus, judged by the one clock an event reads (the same tests
as on a single server): which waiter gets a signal, a signal before and after a
timeout, a task cancelled in the decision that created it."""

from tests.integration.test_signals import (  # noqa: F401
    test_a_signal_after_a_continue_timeout_goes_to_the_next_waiter,
    test_a_signal_after_the_timeout_fails_the_node_as_the_timer_would,
    test_a_signal_before_the_timeout_resolves_the_node,
    test_a_task_cancelled_in_the_decision_that_created_it_is_never_dispatched,
    test_the_waiter_created_first_by_the_database_clock_gets_the_signal,
)

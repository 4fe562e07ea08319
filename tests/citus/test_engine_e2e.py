"""The engine end to end, through real worker and coordinator processes, on Citus:
the same tests as on a single server (tests/integration/test_engine_e2e.py)."""

from tests.integration.test_engine_e2e import (  # noqa: F401
    test_cancel_during_a_running_task_makes_its_late_result_stale,
    test_fan_out_fan_in_200_runs_4_workers_2_coordinators,
    test_order_fulfilment_both_switch_branches_and_signal_before_and_after_wait,
    test_retries_then_success_and_retries_exhausted_and_non_retryable,
    test_sigkilled_worker_task_is_retried_after_its_lease,
    test_wait_for_event_timeout_both_ways,
)

"""MAP nodes on Citus: the same tests as on a single server (tests/integration/test_items.py),
but for the month's first statistics, which the worker nodes keep for their shards."""

from tests.integration.test_items import (  # noqa: F401
    test_a_failed_item_fails_the_node_and_cancels_the_other_items,
    test_a_worker_runs_a_map_with_its_handler_getting_item_and_index,
    test_an_item_event_loads_the_node_rows_only,
    test_cancelling_the_run_cancels_every_item,
    test_continue_policy_finishes_with_null_for_failed_items,
    test_items_not_a_list_fail_the_run_clearly,
    test_items_run_at_most_max_parallel_at_once_and_output_in_item_order,
    test_retrying_a_failed_map_runs_its_items_again,
)

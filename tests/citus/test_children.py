"""SUB_WORKFLOW nodes on Citus: the same tests as on a single server
(tests/integration/test_children.py). A child whose run ID hashes to another shard than
its parent's is started in the parent's transaction, which then spans two nodes."""

from tests.integration.test_children import (  # noqa: F401
    test_a_child_that_finishes_at_its_start_completes_the_node_in_the_same_transaction,
    test_a_failed_child_fails_the_parent,
    test_cancelling_the_parent_cancels_the_child_and_its_tasks,
    test_deploy_refuses_unknown_children_and_cycles,
    test_runs_show_links_parent_and_child_both_ways,
    test_the_child_runs_and_its_output_completes_the_parents_node,
)

"""Webhooks on Citus, against the coordinator: a delivery is recorded in the transaction
that finishes the run (the run on a worker node, the delivery on the coordinator), then
claimed, delivered, and on failure rescheduled (the same tests as on a single server)."""

from tests.integration.test_webhooks import (  # noqa: F401
    hook,
    test_failing_endpoint_is_retried_and_does_not_block_other_runs,
    test_webhook_delivered_once_with_a_valid_signature,
)

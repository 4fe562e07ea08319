"""Retention on Citus: the plan and the drop agree (the property test of the single-server legs)."""

from tests.integration.test_retention_plan import test_plan_equals_drop_for_random_layouts  # noqa: F401

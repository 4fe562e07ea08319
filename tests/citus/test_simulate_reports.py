"""``simulate`` at CI size and every report, against the coordinator."""

from tests.integration.test_reports import (  # noqa: F401
    test_report_all_writes_html_beside_the_executed_notebook_and_an_index,
)
from tests.integration.test_simulate_cmds import test_simulate_at_ci_size_leaves_the_promised_mix  # noqa: F401

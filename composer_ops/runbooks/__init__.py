"""Runbook notebooks: from a ``composer-ops check`` alert to a fix, in a notebook that
is also the incident's record.

:mod:`~composer_ops.runbooks.catalogue` names them, :mod:`~composer_ops.runbooks.steps`
holds what they call for plans and acts, :mod:`~composer_ops.runbooks.acting` the
confirm / role / audit gate, and :mod:`~composer_ops.runbooks.records` runs one and
lists the records kept.
"""

from composer_ops.runbooks.catalogue import RUNBOOKS, Runbook, get, names, runbook_of_alert

__all__ = ["RUNBOOKS", "Runbook", "get", "names", "runbook_of_alert"]

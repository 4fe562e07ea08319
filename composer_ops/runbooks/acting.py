"""The act part of a runbook: acting only with ``confirm=True``, only as a role that
may take operator actions, with an actor whose audit rows name the runbook's record.

``composer-ops runbook`` runs the notebook with ``COMPOSER_RUNBOOK_RECORD`` (the
executed notebook's path), ``COMPOSER_RUNBOOK_COMMAND`` (its command line, passwords
removed) and ``COMPOSER_RUNBOOK_CONFIRM`` (the command that acts as this run planned:
its ``-p`` parameters and ``-p confirm true``) in the kernel's environment; a notebook
opened in JupyterLab has none of them, and its audit rows say so.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from composer_ops.core.actor import Actor
from composer_ops.db import find_url

ENV_RECORD = "COMPOSER_RUNBOOK_RECORD"
ENV_COMMAND = "COMPOSER_RUNBOOK_COMMAND"
ENV_CONFIRM = "COMPOSER_RUNBOOK_CONFIRM"
#: The role operator actions need (docs/security.md).
OPERATOR_ROLE = "composer_ops_engine"

T = TypeVar("T")


def record_path() -> str | None:
    """The record this run of a runbook is kept as, when ``composer-ops runbook`` runs it."""
    return os.environ.get(ENV_RECORD) or None


def actor(runbook: str) -> Actor:
    """The audit rows' actor: the runbook's command line and its record's path."""
    command = os.environ.get(ENV_COMMAND) or f"runbook {runbook} (interactive)"
    record = record_path()
    return Actor(command=f"{command} [record {record}]" if record else command, host=socket.gethostname())


@dataclass(kw_only=True)
class Act:
    """One runbook's act part: whether it may act, and what it did (``did``, one line
    per action, for the record and the report index)."""

    runbook: str
    confirm: bool
    role: str = ""
    refused: str | None = None
    did: list[str] = field(default_factory=list)
    nothing: str | None = None

    @property
    def allowed(self) -> bool:
        return self.confirm and self.refused is None and self.nothing is None

    def message(self) -> str:
        """What the act part says when it does not act (Markdown)."""
        if self.nothing is not None:
            return f"**Nothing to act on from here:** {self.nothing}."
        if not self.confirm:
            again = os.environ.get(ENV_CONFIRM)
            how = (f"`{again}`" if again else
                   "`confirm = True` in the parameters cell, the other parameters as they are")
            return f"**Dry run:** nothing was changed. To act as planned above, run again with {how}."
        if self.refused is not None:
            return f"**Not acted:** {self.refused}. Nothing was changed."
        return "Acted: " + ("; ".join(self.did) or "nothing needed doing") + "."

    def run(self, what: str, action: Callable[[], T], describe: Callable[[T], str]) -> T | None:
        """Take ``action`` if allowed, and note what it did."""
        if not self.allowed:
            return None
        result = action()
        self.did.append(f"{what}: {describe(result)}")
        return result

    def figures(self) -> dict[str, Any]:
        return {"confirm": self.confirm, "acted": bool(self.did), "refused": self.refused, "did": self.did}


def start(runbook: str, database_url: str | None, confirm: bool, *, nothing: str | None = None) -> Act:
    """The act part of ``runbook``. With ``confirm``, checks first that the role may
    take operator actions (it can write the audit): the read-only role is refused, in
    one sentence, before anything is changed."""
    act = Act(runbook=runbook, confirm=bool(confirm), nothing=nothing)
    if not confirm or nothing is not None:
        return act
    from composer_ops.engine import oncall
    from composer_ops.engine.engine import Engine

    with Engine.connect(find_url(database_url), pool_size=1, application_name=f"runbook {runbook}") as engine:
        allowed, role = oncall.can_act(engine)
    act.role = role
    if not allowed:
        act.refused = (f"acting needs the operator role ({OPERATOR_ROLE} or the owner); this session's role "
                       f"{role} may only read, so the runbook diagnosed and planned only")
    return act

"""``composer-ops runbook NAME``: a runbook executed headlessly by the report machinery
(:mod:`composer_ops.reports`: parameters checked before a kernel starts, papermill, the
HTML page, the index), kept as ``reports/runbooks/<name>/<UTC timestamp>.ipynb`` and
``.html``: the incident's record, whose path the audit rows of its actions name."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_ops.runbooks import acting, catalogue


@dataclass(frozen=True, kw_only=True)
class RunbookRun:
    """One execution of a runbook: the report machinery's result, and its act part's figures."""

    name: str
    result: Any                 # composer_ops.reports.ReportResult
    act: dict[str, Any]

    @property
    def refused(self) -> str | None:
        refused = self.act.get("refused")
        return str(refused) if refused else None


def confirm_command(name: str, pairs: Sequence[tuple[str, str]]) -> str:
    """The command that runs runbook ``name`` again with the same ``-p`` pairs and
    ``-p confirm true``: what a dry run tells the operator to run to act as it planned
    (``database_url``, which may hold a password, left out)."""
    words = ["composer-ops", "runbook", name]
    for key, value in pairs:
        if key not in ("confirm", "database_url"):
            words += ["-p", key, value]
    return shlex.join([*words, "-p", "confirm", "true"])


def run(name: str, pairs: Sequence[tuple[str, str]], out_dir: Path, *, database_url: str | None, command: str,
        progress: bool = True, cell_timeout_s: int = 600, lock_wait_s: float | None = None) -> RunbookRun:
    """Execute runbook ``name`` with the ``-p`` pairs into ``out_dir/runbooks/name/``
    and rewrite ``out_dir/index.html``. An unknown runbook or parameter, or a bad
    value, is refused before a kernel starts (:class:`~composer_ops.errors.Invalid`,
    :class:`~composer_ops.errors.NotFound`)."""
    from composer_ops import reports

    catalogue.get(name)
    directory = catalogue.notebooks_dir()
    params = reports.resolve_parameters([name], list(pairs), directory, kind="runbook")
    params = reports.check_parameters(params, kind="runbook")
    from composer_ops.files import check_directory

    check_directory(out_dir / catalogue.FOLDER / name, "--out: directory")   # one line, exit 2, before a kernel
    kernel_env = {acting.ENV_COMMAND: command, acting.ENV_CONFIRM: confirm_command(name, pairs)}
    (result,) = reports.run_reports([name], params, out_dir / catalogue.FOLDER, database_url=database_url,
                                    progress=progress, cell_timeout_s=cell_timeout_s, directory=directory,
                                    kernel_env=kernel_env, record_env=acting.ENV_RECORD, index_dir=out_dir,
                                    lock_wait_s=lock_wait_s)
    figures = reports.key_figures(result.ipynb) if result.ipynb.exists() else None
    return RunbookRun(name=name, result=result, act=dict((figures or {}).get("act") or {}))


@dataclass(frozen=True, kw_only=True)
class Record:
    """A runbook record kept under ``reports/runbooks``."""

    runbook: str
    stem: str
    ok: bool
    path: Path
    did: list[str]
    refused: str | None
    confirm: bool


def records(out_dir: Path) -> list[Record]:
    """Every record under ``out_dir/runbooks``, newest first per runbook."""
    base = out_dir / catalogue.FOLDER
    found: list[Record] = []
    if not base.is_dir():
        return found
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        for summary_path in sorted(folder.glob("*.json"), reverse=True):
            try:
                summary = json.loads(summary_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            act = (summary.get("key_figures") or {}).get("act") or {}
            page = summary_path.with_suffix(".html")
            found.append(Record(runbook=folder.name, stem=summary_path.stem, ok=bool(summary.get("ok")),
                                path=page if page.exists() else summary_path.with_suffix(".ipynb"),
                                did=[str(d) for d in act.get("did") or []], refused=act.get("refused"),
                                confirm=bool(act.get("confirm"))))
    return found

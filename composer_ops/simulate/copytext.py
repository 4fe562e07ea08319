"""Replayed runs as COPY text: the lines the backfill streams into the run tables.

One line per row in PostgreSQL's text format (tab-separated, ``\\N`` for NULL,
backslashes doubled), columns in the order of :data:`RUN_COLUMNS`,
:data:`TASK_COLUMNS` and :data:`SIGNAL_COLUMNS`. Timestamps are written in UTC with
microseconds; JSON values compactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from composer_ops.core.model import NodeType
from composer_ops.simulate.replay import Replay, SignalRow, TaskRow

__all__ = ["SIGNAL_COLUMNS", "RUN_COLUMNS", "TASK_COLUMNS", "CopyText"]

RUN_COLUMNS = ("id", "workflow_definition_id", "workflow_version", "status", "input_json", "context_json",
               "error_json", "output_json", "created_at", "updated_at", "completed_at")
TASK_COLUMNS = ("id", "run_id", "node_id", "node_type", "queue", "state", "attempt", "input_json", "output_json",
                "last_error", "branches", "wake_at", "signal_name", "scheduled_at", "started_at", "finished_at",
                "completed_at", "created_at", "updated_at", "lease_owner", "lease_expires_at", "lease_expiries")
SIGNAL_COLUMNS = ("id", "run_id", "name", "payload", "created_at", "consumed_at")

_N = "\\N"
_encode: Callable[[Any], str] = json.JSONEncoder(separators=(",", ":")).encode
_make_encoder = getattr(json.encoder, "c_make_encoder", None)
if _make_encoder is not None:
    # The C encoder JSONEncoder.encode builds on every call, built once: the same
    # text (compact, ASCII, floats by repr) for the JSON values runs and tasks hold.
    _iterencode = _make_encoder(None, None, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)

    def _encode(value: Any) -> str:
        return "".join(_iterencode(value, 0))


def json_text(value: Any) -> str:
    """A jsonb value as COPY text; None is NULL."""
    if value is None:
        return _N
    return _encode(value).replace("\\", "\\\\")


class CopyText:
    """Formats replayed rows. Caches the text of minute prefixes for a whole backfill,
    and of instants for one run (a run's rows share a few instants: call
    :meth:`next_run` between runs)."""

    def __init__(self) -> None:
        self._minutes: dict[int, str] = {}
        self._instants: dict[datetime | None, str] = {None: _N}

    def next_run(self) -> None:
        self._instants.clear()
        self._instants[None] = _N

    def stamp(self, at: datetime | None) -> str:
        """A timestamptz as COPY text (UTC, microseconds); None is NULL."""
        try:
            return self._instants[at]
        except KeyError:
            text = self._instants[at] = self._format(at)  # type: ignore[arg-type]  # None is always cached
            return text

    def _format(self, at: datetime) -> str:
        micros = round(at.timestamp() * 1_000_000)
        sec, us = divmod(micros, 1_000_000)
        minute, second = divmod(sec, 60)
        prefix = self._minutes.get(minute)
        if prefix is None:
            prefix = self._minutes[minute] = time.strftime("%Y-%m-%d %H:%M:", time.gmtime(minute * 60))
        return f"{prefix}{second:02d}.{us:06d}+00"

    def run(self, replay: Replay, workflow_id: str, config_json: str) -> str:
        """The run's ``workflow_runs`` line; ``config_json`` is its definition's config as COPY text."""
        stamp = self.stamp
        input_json = json_text(replay.context.input)
        done = stamp(replay.completed_at)
        return "\t".join((
            replay.run_id, workflow_id, str(replay.workflow_version), str(replay.status), input_json,
            f'{{"input":{input_json},"config":{config_json}}}',
            json_text({"error": replay.run_reason}) if replay.run_reason else _N, json_text(replay.run_output),
            stamp(replay.created_at), done if replay.completed_at is not None else stamp(replay.created_at),
            done)) + "\n"

    def task(self, run_id: str, row: TaskRow) -> str:
        """A ``task_instances`` line (``scheduled_at`` is ``created_at``)."""
        stamp = self.stamp
        created = stamp(row.created_at)
        # States and node types are StrEnums: their text is their value.
        return "\t".join((
            row.task_id, run_id, row.node_id, row.node_type, row.queue or _N, row.state, str(row.attempt),
            json_text(row.input) if row.node_type is NodeType.TASK else _N, json_text(row.output),
            json_text({"error": row.error}) if row.error else _N,
            "{" + ",".join(row.branches) + "}" if row.branches is not None else _N,
            stamp(row.wake_at), row.signal_name or _N, created, stamp(row.started_at), stamp(row.finished_at),
            stamp(row.completed_at), created, stamp(row.updated_at), row.lease_owner or _N,
            stamp(row.lease_expires_at), str(row.lease_expiries))) + "\n"

    def signal(self, run_id: str, signal: SignalRow) -> str:
        """A ``workflow_events`` line."""
        return "\t".join((signal.id, run_id, signal.name, json_text(signal.payload), self.stamp(signal.created_at),
                          self.stamp(signal.consumed_at))) + "\n"

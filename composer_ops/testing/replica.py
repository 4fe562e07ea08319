"""A primary and its streaming hot standby on this machine, for read-replica tests.

:func:`start_pair` starts a primary (:func:`servers.start_cluster`) and a second server
made from a ``pg_basebackup`` of it, which streams its WAL and answers read-only
queries (a hot standby). Both listen on Unix sockets in their own directories (and on
a free TCP port each when asked). They form a :class:`servers.ServerGroup` with the
roles ``primary`` and ``standby``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import psycopg

from composer_ops.testing.servers import Server, ServerGroup, start_cluster

STANDBY = "standby"

#: Settings of the standby: it answers queries while it replays, and tells the primary
#: which rows its queries still need, so a long report is not cancelled by a
#: recovery conflict when the primary vacuums them away.
STANDBY_SETTINGS: Mapping[str, str] = {"hot_standby": "on", "hot_standby_feedback": "on"}


def start_standby(primary: Server, *, port: int | None = None, settings: Mapping[str, str] | None = None,
                  timeout_s: float = 60.0) -> Server:
    """A hot standby of ``primary`` (a server started here, so its binaries are known),
    returned once it streams from it."""
    if primary.bin_dir is None or not primary.owned:
        raise ValueError("a standby is made from a server started by composer_ops.testing.servers")
    standby = start_cluster(primary.bin_dir, port=port, settings={**STANDBY_SETTINGS, **(settings or {})},
                            standby_of=primary)
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(standby.admin_url, autocommit=True) as conn:
        while True:
            row = conn.execute("""SELECT pg_is_in_recovery(),
                                         EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming')"""
                               ).fetchone()
            if row is not None and row[0] and row[1]:
                return standby
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not start streaming within {timeout_s:g}s (log: {standby.log})")
            time.sleep(0.1)


def start_pair(bin_dir: str | Path, *, settings: Mapping[str, str] | None = None) -> ServerGroup:
    """A primary (role ``primary``) and its hot standby (role ``standby``)."""
    group = ServerGroup()
    primary = group.add(ServerGroup.PRIMARY, start_cluster(bin_dir, settings=settings))
    group.add(STANDBY, start_standby(primary))
    return group


def wait_replayed(primary: Server, standby: Server, timeout_s: float = 60.0) -> None:
    """Return once ``standby`` has replayed everything ``primary`` had written when called
    (the WAL position is the server's, whatever the database: both are read through
    ``postgres``, which exists on the standby before a new database's creation replays)."""
    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(standby.admin_url, autocommit=True) as conn:
        while True:
            done = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
            if done is not None and done[0]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not replay up to {target} within {timeout_s:g}s")
            time.sleep(0.05)

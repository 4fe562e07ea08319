"""A throwaway Citus cluster on this machine: a coordinator and N worker nodes.

Every node is a :func:`servers.start_cluster` server of Debian's PostgreSQL 15 with
Citus preloaded, on a Unix socket and a free TCP port of 127.0.0.1; together they form
a :class:`servers.ServerGroup` (``primary``, ``worker1``, ...).
:meth:`CitusCluster.create_database` creates the database and extension on every node
and registers the nodes; ``composer-ops migrate`` then distributes the tables. Citus
(AGPL) is not part of this project: :func:`ensure_installed` runs the installer named
by ``COMPOSER_CITUS_INSTALLER`` (or found beside the checkout) when it is missing.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from composer_ops.testing.servers import Server, ServerGroup, start_cluster_on_free_port

PG15_BIN = Path("/usr/lib/postgresql/15/bin")
ENV_INSTALLER = "COMPOSER_CITUS_INSTALLER"
#: Where the installer is looked for when ``COMPOSER_CITUS_INSTALLER`` is unset:
#: ``shared/tools/citus`` beside the checkout's directory, then under /work.
_INSTALLER_CANDIDATES = (
    Path(__file__).resolve().parents[3] / "shared" / "tools" / "citus" / "install.sh",
    Path("/work/shared/tools/citus/install.sh"),
)

#: Server settings of every node (on top of :func:`servers.start_cluster`'s).
NODE_SETTINGS: Mapping[str, str] = {
    "shared_preload_libraries": "citus",
    # A transaction that wrote on several nodes commits with two-phase commit.
    "max_prepared_transactions": "200",
    # Each node opens connections to the others; on one machine a few are plenty.
    "citus.max_shared_pool_size": "60",
    "citus.max_adaptive_executor_pool_size": "4",
}

_names = itertools.count()


class CitusUnavailable(RuntimeError):
    """Citus is not installed and cannot be installed here; the message says why."""


def _pg_config(bindir: Path, flag: str) -> Path:
    out = subprocess.run([str(bindir / "pg_config"), flag], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def installed(bindir: Path = PG15_BIN) -> bool:
    """True when the Citus extension is installed in the server tree of ``bindir``."""
    if not (bindir / "pg_config").exists():
        return False
    lib = _pg_config(bindir, "--pkglibdir") / "citus.so"
    control = _pg_config(bindir, "--sharedir") / "extension" / "citus.control"
    return lib.exists() and control.exists()


def installer() -> Path | None:
    """The Citus installer script: ``COMPOSER_CITUS_INSTALLER``, else a known location."""
    env = os.environ.get(ENV_INSTALLER)
    if env:
        return Path(env)
    return next((c for c in _INSTALLER_CANDIDATES if c.exists()), None)


def ensure_installed(bindir: Path = PG15_BIN) -> None:
    """Install Citus into ``bindir``'s server tree with the installer when it is missing
    (it needs root: it installs build packages and writes into the server tree).
    Raises :class:`CitusUnavailable` saying why when that cannot be done."""
    if installed(bindir):
        return
    if not (bindir / "pg_config").exists():
        raise CitusUnavailable(f"no PostgreSQL 15 server in {bindir} (apt-get install postgresql-15)")
    script = installer()
    if script is None or not script.exists():
        raise CitusUnavailable(f"Citus is not installed in {bindir.parent} and no installer was found "
                               f"(set {ENV_INSTALLER} to the path of install.sh)")
    if os.geteuid() != 0:
        raise CitusUnavailable(f"Citus is not installed in {bindir.parent}; run `sudo {script}` once")
    subprocess.run([str(script), str(bindir / "pg_config")], check=True)
    if not installed(bindir):
        raise CitusUnavailable(f"{script} ran but Citus is still not installed in {bindir.parent}")


@dataclass
class CitusCluster:
    """A coordinator and workers on this machine, started by :meth:`start`."""

    group: ServerGroup
    shard_count: int

    @classmethod
    def start(cls, workers: int = 2, *, bindir: Path = PG15_BIN, shard_count: int = 8,
              settings: Mapping[str, str] | None = None) -> CitusCluster:
        """Start the nodes (each stopped and deleted when this process exits).
        ``shard_count`` is the nodes' ``citus.shard_count``: the shards each
        distributed table (and partition) is split into."""
        ensure_installed(bindir)
        node_settings = {**NODE_SETTINGS, "citus.shard_count": str(shard_count), **(settings or {})}
        group = ServerGroup()
        group.add(ServerGroup.PRIMARY, start_cluster_on_free_port(bindir, settings=node_settings))
        for i in range(workers):
            group.add(f"worker{i + 1}", start_cluster_on_free_port(bindir, settings=node_settings))
        return cls(group=group, shard_count=shard_count)

    @property
    def coordinator(self) -> Server:
        return self.group.primary

    @property
    def workers(self) -> list[Server]:
        return [s for role, s in self.group.servers.items() if role != ServerGroup.PRIMARY]

    @property
    def nodes(self) -> list[Server]:
        return [self.coordinator, *self.workers]

    def url(self, database: str) -> str:
        """The coordinator's URL of ``database``: where every client connects."""
        return self.coordinator.url(database)

    def create_database(self, name: str) -> str:
        """A Citus database ``name`` (a leftover of that name is dropped first): created
        with the extension on every node, the workers added to the coordinator.
        Returns the coordinator's URL of it."""
        for node in self.nodes:
            node.create_database(name)
            with psycopg.connect(node.url(name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION citus")
        with psycopg.connect(self.url(name), autocommit=True) as conn:
            conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', %s)", (self.coordinator.port,))
            for worker in self.workers:
                conn.execute("SELECT citus_add_node('127.0.0.1', %s)", (worker.port,))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name`` on every node. A node killed between a two-phase commit's PREPARE
        and its COMMIT PREPARED comes back holding that transaction prepared until Citus's
        recovery resolves it (``citus.recover_2pc_interval``, a minute by default), and
        DROP DATABASE refuses a database with a prepared transaction; the database is
        being thrown away, so what it holds prepared is rolled back first."""
        for node in self.nodes:
            with psycopg.connect(node.admin_url, autocommit=True) as conn:
                gids = [str(r[0]) for r in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)).fetchall()]
            if gids:
                with psycopg.connect(node.url(name), autocommit=True) as conn:
                    for gid in gids:
                        try:
                            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
                        except psycopg.errors.UndefinedObject:
                            pass   # resolved by Citus's recovery meanwhile
            node.drop_database(name)

    @contextmanager
    def database(self, *, prefix: str = "composer_c") -> Iterator[str]:
        """A Citus database of its own for the block (its coordinator URL), dropped after."""
        name = f"{prefix}{os.getpid()}_{next(_names)}"
        url = self.create_database(name)
        try:
            yield url
        finally:
            self.drop_database(name)

    def stop(self) -> None:
        self.group.stop()


@dataclass(frozen=True)
class Baseline:
    """What :func:`reset` brings a database back to (its partitions), and what no test
    may change for the tests after it (:func:`drift`): each distributed or reference
    table's co-location group, and the node group of each of their shards."""

    partitions: frozenset[str]
    colocation: frozenset[tuple[str, int]] = frozenset()
    placements: frozenset[tuple[int, int]] = frozenset()


#: Every table whose rows a test can leave behind, referencing tables first: :func:`reset`
#: empties them, as a fresh database would be (the single-server legs clone one per test).
ENGINE_TABLES = ("run_history", "workflow_events", "task_instances", "workflow_runs", "workflow_definitions",
                 "task_outbox", "webhook_deliveries", "child_deliveries", "task_waiters", "workers", "operator_audit",
                 "retention_drops",
                 "schedule_events", "schedules", "queue_settings", "flow_slots", "rate_buckets", "claim_fences",
                 "claim_node_fences")


def baseline(url: str) -> Baseline:
    with psycopg.connect(url) as conn:
        return Baseline(partitions=frozenset(_partitions(conn)), colocation=frozenset(_colocation(conn)),
                        placements=frozenset(_placements(conn)))


def _colocation(conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    """(table, co-location group) of every distributed or reference table but partitions."""
    rows = conn.execute("""SELECT p.logicalrelid::regclass::text, p.colocationid FROM pg_dist_partition p
                            WHERE NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = p.logicalrelid)""")
    return [(str(r[0]), int(r[1])) for r in rows.fetchall()]


def _placements(conn: psycopg.Connection[Any]) -> list[tuple[int, int]]:
    """(shard, node group) of every placement of a distributed table but partitions."""
    rows = conn.execute("""SELECT s.shardid, p.groupid FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid)
                            WHERE NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = s.logicalrelid)""")
    return [(int(r[0]), int(r[1])) for r in rows.fetchall()]


def drift(url: str, since: Baseline) -> list[str]:
    """How the database's distribution differs from ``since``: shard placements moved,
    and one line per table whose co-location group changed (a test that changes either
    must undo it, or every later test of the session runs on another layout)."""
    with psycopg.connect(url) as conn:
        now = dict(_colocation(conn))
        placed = set(_placements(conn))
    moved = sorted(placed ^ since.placements)
    then = dict(since.colocation)
    return ([f"shard placements moved (shard, node group; gone or new): {moved}"] if moved else []) + [
        f"{table}: co-location group {then.get(table)} -> {now.get(table)}"
            for table in sorted(set(now) | set(then)) if now.get(table) != then.get(table)]


def _partitions(conn: psycopg.Connection[Any]) -> list[str]:
    rows = conn.execute("""SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                            WHERE i.inhparent = ANY(composer_run_tables()::regclass[])""").fetchall()
    return [r[0] for r in rows]


def reset(url: str, to: Baseline) -> None:
    """Delete every row of the engine's tables and drop partitions added since ``to``
    was taken. DELETE, one autocommit statement per table: on a few rows it is two
    orders of magnitude faster on Citus than TRUNCATE, which takes locks on every shard.
    Partitions of the tables that reference workflow_runs go first; a workflow_runs
    partition is detached before it is dropped (its foreign keys depend on it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        for table in ENGINE_TABLES:
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(table)))
        extra = sorted(set(_partitions(conn)) - to.partitions,
                       key=lambda name: (name.startswith("workflow_runs"), name))
        for name in extra:
            if name.startswith("workflow_runs"):
                conn.execute(sql.SQL("ALTER TABLE workflow_runs DETACH PARTITION {}").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


def run_ids_on_one_shard(url: str, n: int) -> list[str]:
    """``n`` fresh run IDs (UUIDv7, in minting order) that hash to one shard of the run
    tables: runs started with them have their outbox rows on one shard, where priority
    and FIFO order the claim (docs/scaling.md, "Dispatch on Citus")."""
    from composer_ops.engine.ids import uuid7_text

    ids: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        shard = None
        while len(ids) < n:
            run_id = uuid7_text()
            row = conn.execute("SELECT get_shard_id_for_distribution_column('workflow_runs', %s::text)",
                               (run_id,)).fetchone()
            assert row is not None
            if shard is None:
                shard = row[0]
            if row[0] == shard:
                ids.append(run_id)
    return ids


def main(argv: list[str] | None = None) -> int:
    """``python -m composer_ops.testing.citus install``: :func:`ensure_installed`, for
    a Makefile step before the Citus tests (installing takes minutes; a test's timeout
    should not include it)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        sys.stderr.write("usage: python -m composer_ops.testing.citus install\n")
        return 2
    try:
        ensure_installed()
    except CitusUnavailable as exc:
        sys.stderr.write(f"citus: {exc}\n")
        return 1
    print(f"citus: installed in {PG15_BIN.parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

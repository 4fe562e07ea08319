"""The statements of partition archives: a partition's columns, its rows in key order,
a fingerprint of its content, and COPY of archived rows back into it.

Reads run in the caller's transaction; :func:`pin_text_output` fixes the session
settings that decide how values print (TimeZone, DateStyle, IntervalStyle, float
digits) for that transaction, so a fingerprint taken now and one taken later, by
another session in another time zone, agree exactly when the rows do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from composer_ops.repo._base import Conn

#: Rows fetched per round trip when streaming a partition.
FETCH_ROWS = 5000


@dataclass(frozen=True, kw_only=True)
class Column:
    """A column as the catalog describes it: name and ``format_type`` text."""

    name: str
    type: str

    @property
    def as_text(self) -> bool:
        """Whether the column is read as its text form: JSON (kept exactly as PostgreSQL
        prints it) and every type without a native Parquet counterpart here."""
        return self.type not in NATIVE_TYPES


#: PostgreSQL types read as Python values (and stored natively in Parquet).
NATIVE_TYPES = frozenset({"text", "character varying", "smallint", "integer", "bigint", "boolean", "real",
                          "double precision", "timestamp with time zone", "text[]"})


def pin_text_output(conn: Conn) -> None:
    """Fix, for the rest of the transaction, the settings that change a value's text."""
    conn.execute("""SELECT set_config('TimeZone', 'UTC', true), set_config('DateStyle', 'ISO, YMD', true),
                           set_config('IntervalStyle', 'iso_8601', true),
                           set_config('extra_float_digits', '1', true)""")


def columns(conn: Conn, table: str, *, schema: str | None = None) -> list[Column]:
    """The stored columns of ``table`` in their order (generated columns excluded: they
    are computed, never copied)."""
    rel = f"{schema}.{table}" if schema else table
    rows = conn.execute("""
        SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
          FROM pg_attribute a
         WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
         ORDER BY a.attnum""", (sql.Identifier(*rel.split(".")).as_string(conn),)).fetchall()
    return [Column(name=str(n), type=str(t)) for n, t in rows]


def primary_key(conn: Conn, table: str) -> list[str]:
    """The primary key columns of ``table`` (a partition inherits its parent's)."""
    rows = conn.execute("""
        SELECT a.attname::text
          FROM pg_index i
          JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
         WHERE i.indrelid = to_regclass(%s) AND i.indisprimary
         ORDER BY k.ord""", (sql.Identifier(table).as_string(conn),)).fetchall()
    return [str(r[0]) for r in rows]


def _select_list(cols: Sequence[Column]) -> sql.Composable:
    return sql.SQL(", ").join(
        sql.SQL("{}::text").format(sql.Identifier(c.name)) if c.as_text else sql.Identifier(c.name) for c in cols)


def fingerprint(conn: Conn, table: str) -> tuple[int, str]:
    """The row count of ``table`` and an order-independent hash of its rows' text
    (the sum of each row's 64-bit hash): equal fingerprints mean, but for a hash
    collision, the same rows. Call :func:`pin_text_output` first in the transaction."""
    row = conn.execute(sql.SQL(
        "SELECT count(*), COALESCE(sum(hashtextextended(t::text, 0)::numeric), 0)::text FROM {} t"
    ).format(sql.Identifier(table))).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def stream_rows(conn: Conn, table: str, cols: Sequence[Column], order_by: Sequence[str],
                batch: int = FETCH_ROWS) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of ``table`` in key order, ``batch`` at a time, through a server-side
    cursor in the caller's transaction. JSON and other non-native columns arrive as
    their text."""
    query = sql.SQL("SELECT {cols} FROM {table} ORDER BY {order}").format(
        cols=_select_list(cols), table=sql.Identifier(table),
        order=sql.SQL(", ").join(sql.Identifier(c) for c in order_by))
    with conn.cursor(name=f"composer_archive_{table}") as cur:
        cur.itersize = batch
        cur.execute(query)
        while True:
            rows = cur.fetchmany(batch)
            if not rows:
                return
            yield rows


def copy_rows(conn: Conn, table: str, names: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
    """COPY ``rows`` (values in ``names`` order) into ``table``; returns how many.
    Values are sent in COPY's text format: text forms (JSON, other types) are parsed
    by the column's type as on input."""
    n = 0
    stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(table), sql.SQL(", ").join(sql.Identifier(c) for c in names))
    with conn.cursor() as cur, cur.copy(stmt) as copy:
        for row in rows:
            copy.write_row(row)
            n += 1
    return n


def missing_definitions(conn: Conn, named: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of the definition versions ``named``, those workflow_definitions does not hold, in
    order (what the runs' foreign key checked row by row until V019)."""
    if not named:
        return []
    rows = conn.execute("""
        SELECT u.id, u.version FROM unnest(%s::text[], %s::int[]) AS u(id, version)
         WHERE NOT EXISTS (SELECT 1 FROM workflow_definitions d WHERE d.id = u.id AND d.version = u.version)
         ORDER BY 1, 2""", ([n[0] for n in named], [n[1] for n in named])).fetchall()
    return [(r[0], int(r[1])) for r in rows]


def row_count(conn: Conn, table: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    return int(row[0]) if row else 0


def schema_version(conn: Conn) -> int:
    """The newest migration applied to this database."""
    row = conn.execute("SELECT COALESCE(max(version), 0) FROM schema_migrations").fetchone()
    return int(row[0]) if row else 0


def exists(conn: Conn, table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (sql.Identifier(table).as_string(conn),)).fetchone()
    return bool(row and row[0])


#: Where ``partitions detach`` keeps the months it takes out of the run tables.
DETACHED_SCHEMA = "composer_detached"


def remove_month(conn: Conn, month: str, tables: Sequence[str], *, keep_table: bool) -> list[str]:
    """Take ``month``'s partitions out of ``tables`` (the run tables, referenced table
    first): referencing tables first, ``workflow_runs`` last, as the retention drop
    does. Dropped, or with ``keep_table`` detached, stripped of their foreign keys
    (they would point into a month the run tables no longer hold) and moved to
    :data:`DETACHED_SCHEMA` under the same names. The caller holds the month's locks
    and has judged it. Returns the partitions handled."""
    done = []
    for table in [*tables[1:], tables[0]]:
        part = f"{table}_p{month}"
        if not exists(conn, part):
            continue
        ident, parent = sql.Identifier(part), sql.Identifier(table)
        if keep_table:
            conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(parent, ident))
            # The table's own foreign keys (dropping one drops the constraints PostgreSQL
            # made under it for each partition of the referenced table).
            for (name,) in conn.execute("""SELECT conname::text FROM pg_constraint
                                            WHERE conrelid = to_regclass(%s) AND contype = 'f' AND conparentid = 0""",
                                        (ident.as_string(conn),)).fetchall():
                conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(ident, sql.Identifier(name)))
            conn.execute(sql.SQL("ALTER TABLE {} SET SCHEMA {}").format(ident, sql.Identifier(DETACHED_SCHEMA)))
        elif table == tables[0]:
            conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(parent, ident))
            conn.execute(sql.SQL("DROP TABLE {}").format(ident))
        else:
            conn.execute(sql.SQL("DROP TABLE {}").format(ident))
        done.append(part)
    # The month's own functions (the claim's, the completion's) go with its partitions.
    conn.execute("SELECT composer_claim_month(%s), composer_load_month(%s)", (month, month))
    return done


def detached_copies(conn: Conn, month: str, tables: Sequence[str]) -> list[str]:
    """What :data:`DETACHED_SCHEMA` holds under the names ``month``'s partitions and
    their indexes would take there (an earlier ``partitions detach`` of the month,
    restored since; or its tables renamed, whose indexes keep their names): detaching the
    month again would move a second relation to one of those names. Tables first."""
    names = [f"{table}_p{month}" for table in tables]
    return [str(r[0]) for r in conn.execute("""
        WITH wanted AS (
            SELECT p.name FROM unnest(%(names)s::text[]) AS p(name)
            UNION ALL
            SELECT ic.relname::text FROM unnest(%(names)s::text[]) AS p(name)
              JOIN pg_index i ON i.indrelid = to_regclass(quote_ident(p.name))
              JOIN pg_class ic ON ic.oid = i.indexrelid)
        SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = %(schema)s AND c.relname IN (SELECT w.name FROM wanted w)
         ORDER BY c.relkind = 'i', 1""", {"names": names, "schema": DETACHED_SCHEMA}).fetchall()]


def detached(conn: Conn) -> list[str]:
    """The tables ``partitions detach`` kept, by name."""
    return [str(r[0]) for r in conn.execute(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = %s ORDER BY 1", (DETACHED_SCHEMA,)).fetchall()]

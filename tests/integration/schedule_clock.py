"""A frozen database clock for schedule tests: ``now()`` of the engine's sessions reads
a row the test sets.

The engine reads its one clock with ``SELECT now()`` (composer_ops/repo/clock.py). A
function ``frozen_clock.now()``, found before ``pg_catalog.now()`` because the
sessions' search_path names ``frozen_clock`` first and ``pg_catalog`` explicitly after
it, answers instead; column defaults keep the real clock (they were bound to
``pg_catalog.now()`` when the tables were made).
"""

from __future__ import annotations

from datetime import date, datetime
from urllib.parse import quote

import psycopg

from composer_ops.repo import partitions


class FrozenClock:
    def __init__(self, db_url: str, at: datetime) -> None:
        self.db_url = db_url
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA frozen_clock")
            conn.execute("CREATE TABLE frozen_clock.at (at timestamptz NOT NULL)")
            conn.execute("INSERT INTO frozen_clock.at VALUES (%s)", (at,))
            conn.execute("CREATE FUNCTION frozen_clock.now() RETURNS timestamptz LANGUAGE sql STABLE "
                         "AS 'SELECT at FROM frozen_clock.at'")
            schema = conn.execute("SELECT current_schema()").fetchone()
            assert schema is not None
            self.schema = str(schema[0])
        joiner = "&" if "?" in db_url else "?"
        self.url = f"{db_url}{joiner}options={quote(f'-csearch_path=frozen_clock,pg_catalog,{self.schema}')}"

    def set(self, at: datetime) -> None:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            conn.execute("UPDATE frozen_clock.at SET at = %s", (at,))

    def months(self, first: date, count: int) -> None:
        """Partitions for ``count`` months from ``first``'s (the frozen days are not this month)."""
        from composer_ops.db.errors import TranslatingConnection

        with TranslatingConnection.connect(self.db_url) as conn:
            partitions.ensure_from(conn, first, count)
            conn.commit()

"""A snapshot of a database's schema from the catalogs, for comparing two databases.

Everything a migration or a repeatable file can make, in the schemas composer_ops uses
(public, composer_detached), as sorted text rows per kind: relations (kind,
persistence, options, partition key), columns (in order, with type, NOT NULL, default
and collation), constraints, indexes with their predicates, partitions with their
bounds, sequences, functions (the whole definition: arguments, result, language,
volatility, SECURITY DEFINER, SET clauses and body), triggers, and the privileges on
tables, sequences, functions, schemas and the database, and the default privileges.
Names the server generates and two builds cannot share (OIDs, the database's name,
the numbered names of the foreign keys it clones for each partition) are left out;
privileges are compared as sets of (grantee, privilege, grantable).
"""

from __future__ import annotations

from typing import Any

import psycopg

SCHEMAS = ("public", "composer_detached")

_QUERIES: dict[str, str] = {
    "relation": """
        SELECT n.nspname || '.' || c.relname || ' ' || c.relkind::text || ' ' || c.relpersistence::text
               || ' ' || COALESCE(array_to_string(c.reloptions, ','), '')
               || ' ' || COALESCE(pg_get_partkeydef(c.oid), '')
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'u', 'v', 'm', 'f', 'S')""",
    "column": """
        SELECT c.relname || '.' || a.attname
               || ' #' || row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum)
               || ' ' || format_type(a.atttypid, a.atttypmod)
               || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
               || ' default=' || COALESCE(pg_get_expr(d.adbin, d.adrelid), '')
               || ' identity=' || a.attidentity::text || ' generated=' || a.attgenerated::text
               || ' collation=' || COALESCE(co.collname, '')
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
          LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
         WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p', 'u', 'v', 'm', 'f')
           AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraint": """
        SELECT c.conrelid::regclass::text || ' '
               || CASE WHEN c.conparentid = 0 THEN c.conname ELSE 'clone of ' || p.conname END
               || ' ' || pg_get_constraintdef(c.oid)
          FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
          LEFT JOIN pg_constraint p ON p.oid = c.conparentid
         WHERE n.nspname = ANY(%(schemas)s)""",
    "index": """
        SELECT schemaname || '.' || indexname || ' ' || indexdef
          FROM pg_indexes WHERE schemaname = ANY(%(schemas)s)""",
    "partition": """
        SELECT c.relname || ' OF ' || p.relname || ' ' || pg_get_expr(c.relpartbound, c.oid)
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
          JOIN pg_class p ON p.oid = i.inhparent
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY(%(schemas)s) AND c.relkind IN ('r', 'p')""",
    "sequence": """
        SELECT schemaname || '.' || sequencename || ' ' || data_type || ' ' || start_value || ' '
               || min_value || ' ' || max_value || ' ' || increment_by || ' ' || cycle || ' ' || cache_size
          FROM pg_sequences WHERE schemaname = ANY(%(schemas)s)""",
    "function": """
        SELECT pg_get_functiondef(p.oid)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = ANY(%(schemas)s) AND p.prokind IN ('f', 'p')""",
    "trigger": """
        SELECT t.tgrelid::regclass::text || ' ' || pg_get_triggerdef(t.oid)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = ANY(%(schemas)s) AND NOT t.tgisinternal""",
    "grant": """
        SELECT 'relation ' || c.relname || ' ' || x.grantee::regrole::text || ' ' || x.privilege_type
               || ' ' || x.is_grantable
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         CROSS JOIN LATERAL aclexplode(c.relacl) x
         WHERE n.nspname = ANY(%(schemas)s)
        UNION ALL
        SELECT 'function ' || p.oid::regprocedure::text || ' '
               || CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END
               || ' ' || x.privilege_type || ' ' || x.is_grantable
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         CROSS JOIN LATERAL aclexplode(COALESCE(p.proacl, acldefault('f', p.proowner))) x
         WHERE n.nspname = ANY(%(schemas)s)
        UNION ALL
        SELECT 'schema ' || n.nspname || ' '
               || CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END
               || ' ' || x.privilege_type || ' ' || x.is_grantable
          FROM pg_namespace n CROSS JOIN LATERAL aclexplode(n.nspacl) x
         WHERE n.nspname = ANY(%(schemas)s)
        UNION ALL
        SELECT 'database ' || CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END
               || ' ' || x.privilege_type || ' ' || x.is_grantable
          FROM pg_database d CROSS JOIN LATERAL aclexplode(d.datacl) x
         WHERE d.datname = current_database()
        UNION ALL
        SELECT 'default ' || COALESCE(n.nspname, '*') || ' ' || a.defaclobjtype::text || ' '
               || x.grantee::regrole::text || ' ' || x.privilege_type
          FROM pg_default_acl a LEFT JOIN pg_namespace n ON n.oid = a.defaclnamespace
         CROSS JOIN LATERAL aclexplode(a.defaclacl) x""",
}


def snapshot(url: str) -> dict[str, list[str]]:
    """Every kind of :data:`_QUERIES`, its rows sorted; the runner's own table,
    schema_migrations, is left out (it is not made by the files)."""
    with psycopg.connect(url) as conn:
        return {kind: sorted(str(r[0]) for r in conn.execute(query, {"schemas": list(SCHEMAS)})
                             if "schema_migrations" not in str(r[0]))
                for kind, query in _QUERIES.items()}


def differences(a: dict[str, list[str]], b: dict[str, list[str]]) -> dict[str, Any]:
    """What only ``a`` has and what only ``b`` has, per kind (empty when equal)."""
    out: dict[str, Any] = {}
    for kind in a.keys() | b.keys():
        only_a = sorted(set(a.get(kind, [])) - set(b.get(kind, [])))
        only_b = sorted(set(b.get(kind, [])) - set(a.get(kind, [])))
        if only_a or only_b:
            out[kind] = {"only in the first": only_a, "only in the second": only_b}
    return out

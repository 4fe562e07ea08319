"""Database access: where the server is, connections, pools, migrations, errors."""

from composer_ops.db.connect import ENV_LOCK_WAIT, ENV_URL, autocommit, connect, find_url, make_pool, resolve_url

__all__ = ["ENV_LOCK_WAIT", "ENV_URL", "autocommit", "connect", "find_url", "make_pool", "resolve_url"]

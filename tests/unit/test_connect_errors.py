"""Which failed connection attempts a starting worker or coordinator waits out: libpq
gives connect errors no SQLSTATE, so the decision reads its messages (as libpq 15-18
print them)."""

from __future__ import annotations

import psycopg
import pytest

from composer_ops.db.errors import connect_may_succeed_later

SOCKET = 'connection failed: connection to server on socket "/tmp/pg/.s.PGSQL.5432" failed: '


@pytest.mark.parametrize("message", [
    SOCKET + "No such file or directory\n\tIs the server running locally and accepting connections on that socket?",
    SOCKET + "Connection refused\n\tIs the server running locally and accepting connections on that socket?",
    'connection failed: connection to server at "10.0.0.7", port 5432 failed: timeout expired',
    'connection is bad: could not translate host name "db" to address: Temporary failure in name resolution',
    SOCKET + "FATAL:  the database system is starting up",
    SOCKET + "FATAL:  the database system is shutting down",
    SOCKET + "FATAL:  the database system is in recovery mode",
    SOCKET + "FATAL:  the database system is not yet accepting connections\nDETAIL:  Consistent recovery state "
             "has not been yet reached.",
    SOCKET + "FATAL:  sorry, too many clients already",
    SOCKET + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
    # `pg_ctl restart -m fast` reaching a session still in its startup (the chaos run's
    # worker respawned as the server went down exited with it: 2026-12-04)
    SOCKET + "FATAL:  terminating connection due to administrator command",
    SOCKET + "FATAL:  terminating connection because of crash of another server process\nDETAIL:  The "
             "postmaster has commanded this server process to roll back the current transaction and exit",
])
def test_a_server_that_is_down_starting_stopping_or_full_is_worth_waiting_for(message: str) -> None:
    assert connect_may_succeed_later(psycopg.OperationalError(message))


@pytest.mark.parametrize("message", [
    SOCKET + 'FATAL:  password authentication failed for user "composer"',
    SOCKET + 'FATAL:  role "nobody" does not exist',
    SOCKET + 'FATAL:  database "composr" does not exist',
    SOCKET + 'FATAL:  no pg_hba.conf entry for host "[local]", user "x", database "y", no encryption',
    SOCKET + 'FATAL:  permission denied for database "composer"',
])
def test_a_refusal_that_needs_a_person_is_not(message: str) -> None:
    assert not connect_may_succeed_later(psycopg.OperationalError(message))


def test_only_connection_errors_count() -> None:
    assert not connect_may_succeed_later(ValueError("No such file or directory"))
    assert not connect_may_succeed_later(psycopg.ProgrammingError("syntax error"))

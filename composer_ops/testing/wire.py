"""What the fault proxy (faultproxy.py) parses of the PostgreSQL wire protocol (version 3),
and what it keeps per connection and per request."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
#: frontend messages that end a request (each is answered by one ReadyForQuery)
REQUEST_ENDS = {b"S", b"Q"}
COPY_FROM_CLIENT = {b"d", b"c", b"f"}


class Fault(StrEnum):
    DROP_BEFORE = "drop-before"
    LOSE_ACK = "lose-ack"
    RESTART_BEFORE = "restart-before"
    RESTART_AFTER = "restart-after"
    HOLD_COMMIT = "commit-held"

    @property
    def after(self) -> bool:
        """Whether the server completes the request before the fault."""
        return self in (Fault.LOSE_ACK, Fault.RESTART_AFTER)

    @property
    def restarts(self) -> bool:
        return self in (Fault.RESTART_BEFORE, Fault.RESTART_AFTER)


@dataclass
class Request:
    """One request a client sent through the proxy, and what the server answered."""

    index: int                 # 1-based, counted from the last reset()
    conn: int                  # serial number of the client connection
    kinds: str = ""            # frontend message types, e.g. "PBDES" or "Q"
    sql: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)      # CommandComplete tags
    errors: list[str] = field(default_factory=list)    # ErrorResponse SQLSTATEs
    status_before: str = "I"   # transaction status when it was sent: I, T or E
    status_after: str = ""     # from its ReadyForQuery; "" if never answered
    fault: Fault | None = None  # the fault injected at this request

    @property
    def text(self) -> str:
        return "; ".join(" ".join(s.split()) for s in self.sql)

    @property
    def commits(self) -> bool:
        """Whether the server committed work when it completed this request: an
        explicit COMMIT, or a statement run outside a transaction block."""
        if "COMMIT" in self.tags:
            return True
        return (self.status_before == "I" and self.status_after == "I"
                and any(t.split()[0] not in ("BEGIN", "ROLLBACK") for t in self.tags if t))

    def __str__(self) -> str:
        return f"#{self.index} [conn {self.conn}] {self.kinds} {self.text[:120]!r} -> {self.tags}"


class Pipe:
    """One client connection and its server connection."""

    def __init__(self, serial: int, client: socket.socket, server: socket.socket) -> None:
        self.serial = serial
        self.client, self.server = client, server
        self.from_client = bytearray()
        self.from_server = bytearray()
        self.to_client = bytearray()
        self.to_server = bytearray()
        self.client_startup = True      # the next client message has no type byte
        self.server_byte_reply = 0      # single-byte answers to SSL/GSS requests still due
        self.passthrough = False        # encrypted or cancel: no parsing
        self.ready = False              # startup done (first ReadyForQuery seen)
        self.copy_in = False
        self.status = "I"
        self.current: Request | None = None       # being sent by the client
        self.inflight: deque[Request] = deque()   # sent, ReadyForQuery not yet seen
        self.hold_client = False                  # after a LOSE_ACK target was sent
        self.withhold: Request | None = None      # the target whose reply is withheld
        self.closed = False
        self.held = bytearray()                   # HOLD_COMMIT: the request kept from the server
        self.holding = False                      # its messages are still arriving
        self.client_gone = False                  # HOLD_COMMIT cut the client's side
        self.parked = False                       # its commit waits for the held request's answer
        # the last message either way: a request still open (sent, or in a pipeline not
        # yet synced) and silent for a while is waiting on the server (on a lock)
        self.last_heard = 0.0


@dataclass
class Hold:
    """The state of a HOLD_COMMIT once it fired."""

    pipe: Pipe
    request: Request
    cut_at: float
    released_at: float | None = None
    given_up: bool = False              # released, unanswered for a while: park nothing more
    answered: threading.Event = field(default_factory=threading.Event)


def peek_message(buf: bytearray) -> tuple[bytes, bytes] | None:
    """The type and bytes of the whole message at the front of ``buf``, left in place;
    None until it has arrived whole."""
    if len(buf) < 5:
        return None
    (length,) = struct.unpack("!i", buf[1:5])
    if len(buf) < 1 + length:
        return None
    msg = bytes(buf[:1 + length])
    return msg[:1], msg


def take_message(buf: bytearray) -> tuple[bytes, bytes] | None:
    """Remove one whole protocol message (type byte, length, body) from the front of
    ``buf`` and return its type and its bytes; None, leaving ``buf`` as it is, until
    the message has arrived whole."""
    framed = peek_message(buf)
    if framed is not None:
        del buf[:len(framed[1])]
    return framed


def query_text(kind: bytes, msg: bytes) -> str:
    body = msg[5:]
    if kind == b"P":                      # Parse: statement name \0 query \0 ...
        body = body.split(b"\0", 1)[1] if b"\0" in body else b""
    return body.split(b"\0", 1)[0].decode("utf-8", "replace")


def error_code(msg: bytes) -> str:
    for field_ in msg[5:].split(b"\0"):
        if field_[:1] == b"C":
            return field_[1:].decode("ascii", "replace")
    return ""


def socket_address(url: str) -> tuple[socket.AddressFamily, Any]:
    """Where the server of ``url`` listens: its Unix socket file, or host and port."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    host = str(info.get("host") or os.environ.get("PGHOST") or "/var/run/postgresql").split(",")[0]
    port = int(str(info.get("port") or os.environ.get("PGPORT") or 5432).split(",")[0])
    if host.startswith("/"):
        return socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}")
    return socket.AF_INET, (host, port)


def startup_packet(pipe: Pipe, buf: bytearray) -> bool:
    """Forward the next untyped startup packet (length, then code): an SSL or GSS
    request (the server answers one byte), a cancel request (the rest passes through
    unparsed), or the startup message, after which every message is typed. False
    when ``buf`` does not hold the whole packet yet."""
    if len(buf) < 8:
        return False
    length, code = struct.unpack("!ii", buf[:8])
    if len(buf) < length:
        return False
    msg = bytes(buf[:length])
    del buf[:length]
    pipe.to_server += msg
    if code in (SSL_REQUEST, GSSENC_REQUEST):
        pipe.server_byte_reply += 1
    elif code == CANCEL_REQUEST:
        pipe.passthrough = True
    else:
        pipe.client_startup = False
    return True

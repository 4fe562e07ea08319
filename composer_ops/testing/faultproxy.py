"""A PostgreSQL wire-protocol proxy that injects connection faults at exact points.

``FaultProxy(server_url)`` listens on a Unix socket of its own and forwards every
connection to the server. It parses enough of the protocol (version 3) to count
*requests*: everything a client sends up to and including a ``Sync`` or a simple
``Query``, each of which the server answers with exactly one ``ReadyForQuery``. A
transaction as psycopg runs it is a handful of requests (``BEGIN``, each statement
or pipeline, ``COMMIT``); an autocommit statement is one request that commits when
the server processes its ``Sync``.

One fault can be armed at a time, at the Nth request counted from :meth:`reset`, or
at the first request whose SQL matches a predicate:

- ``Fault.DROP_BEFORE``: the request never reaches the server; both ends of the
  connection are closed (a COMMIT that is never sent: the server rolls back);
- ``Fault.LOSE_ACK``: the request is forwarded and the server completes it, but its
  reply is withheld and the connection is closed right when the server reports the
  result: at the ``CommandComplete`` whose tag is ``COMMIT``, else at the request's
  ``ReadyForQuery``. A COMMIT has committed; the client never hears it;
- ``Fault.RESTART_BEFORE`` / ``Fault.RESTART_AFTER``: the same two points, but the
  server is restarted (every session terminated, in-flight transactions rolled back)
  before the client's connection is closed. Needs a ``restart`` callable.

After firing, the proxy forwards everything again, so the client's retry runs on a
healthy path. :attr:`FaultProxy.requests` records each request: its connection, the
frontend message types, the SQL it carried, the server's command tags and the
transaction status after it, so a test can first record an operation and then cut it
at every one of its requests in turn.

Only for tests: no TLS (the proxy's socket is a Unix socket, where libpq never asks
for it; a server answering 'S' to an SSLRequest is passed through unparsed).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["Fault", "FaultProxy", "Request"]

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
#: frontend messages that end a request (each is answered by one ReadyForQuery)
_REQUEST_ENDS = {b"S", b"Q"}
_COPY_FROM_CLIENT = {b"d", b"c", b"f"}


class Fault(StrEnum):
    DROP_BEFORE = "drop-before"
    LOSE_ACK = "lose-ack"
    RESTART_BEFORE = "restart-before"
    RESTART_AFTER = "restart-after"

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


@dataclass
class _Arm:
    fault: Fault
    at: int | None
    match: Callable[[Request], bool] | None
    conn: int | None = None        # set once the target request is known
    target: Request | None = None


class _Pipe:
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


class FaultProxy:
    """See the module docstring. ``restart`` restarts the real server (blocking)."""

    def __init__(self, server_url: str, *, restart: Callable[[], Any] | None = None) -> None:
        self.server_url = server_url
        self._target = _socket_address(server_url)
        self._restart = restart
        self._dir = tempfile.mkdtemp(prefix="composer-proxy-")
        self._path = os.path.join(self._dir, ".s.PGSQL.5432")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._pipes: dict[int, _Pipe] = {}
        self._serial = 0
        self._count = 0
        self._arm: _Arm | None = None
        self.requests: list[Request] = []
        self.fired: Request | None = None
        self.fired_event = threading.Event()
        self.restarts = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: list[Callable[[], None]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fault-proxy", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------

    def url(self, database: str | None = None) -> str:
        """The server URL rewritten to go through the proxy (optionally another database)."""
        parts = urlsplit(self.server_url)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port", "hostaddr")]
        query += [("host", self._dir), ("port", "5432")]
        user = parts.username or ""
        netloc = f"{user}@" if user else ""
        if parts.password:
            netloc = f"{user}:{parts.password}@"
        path = f"/{database}" if database is not None else parts.path
        return urlunsplit((parts.scheme or "postgresql", netloc, path, urlencode(query), ""))

    def reset(self) -> None:
        """Forget recorded requests, restart the count at 1 and disarm."""
        with self._lock:
            self._count = 0
            self.requests = []
            self._arm = None
            self.fired = None
            self.fired_event.clear()

    def arm(self, fault: Fault, *, at: int | None = None,
            match: Callable[[Request], bool] | None = None) -> None:
        """Inject ``fault`` at request number ``at`` (counted from :meth:`reset`), or at
        the first request for which ``match`` is true, judged on the request's first
        message (its SQL when that is a Query or a Parse)."""
        if (at is None) == (match is None):
            raise ValueError("give exactly one of at= and match=")
        if fault.restarts and self._restart is None:
            raise ValueError(f"{fault} needs the proxy to be given a restart callable")
        with self._lock:
            self.fired = None
            self.fired_event.clear()
            self._arm = _Arm(fault=fault, at=at, match=match)

    def disarm(self) -> None:
        with self._lock:
            self._arm = None

    @property
    def count(self) -> int:
        """Requests seen since :meth:`reset`."""
        with self._lock:
            return self._count

    def close_all(self) -> None:
        """Cut every connection now (as a network failure would)."""
        def cut() -> None:
            for pipe in list(self._pipes.values()):
                self._close(pipe)

        self._call_in_loop(cut)

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        for pipe in list(self._pipes.values()):
            self._close(pipe)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def armed(self, fault: Fault, *, at: int | None = None,
              match: Callable[[Request], bool] | None = None) -> Iterator[FaultProxy]:
        self.arm(fault, at=at, match=match)
        try:
            yield self
        finally:
            self.disarm()

    # -- the event loop ----------------------------------------------------------

    def _call_in_loop(self, fn: Callable[[], Any]) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        with self._lock:
            self._calls.append(run)
        self._wake_w.send(b"x")
        done.wait(10)

    def _loop(self) -> None:
        while not self._stop:
            for key, events in self._sel.select(timeout=0.5):
                sock = key.fileobj
                if sock is self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                    with self._lock:
                        calls, self._calls = self._calls, []
                    for call in calls:
                        call()
                    continue
                if sock is self._listener:
                    self._accept()
                    continue
                pipe: _Pipe = key.data
                if pipe.closed:
                    continue
                try:
                    if events & selectors.EVENT_READ:
                        self._read(pipe, sock)  # type: ignore[arg-type]
                    if not pipe.closed and events & selectors.EVENT_WRITE:
                        self._flush(pipe)
                except OSError:
                    self._close(pipe)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        family, address = self._target
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.connect(address)
        except OSError:
            server.close()
            client.close()
            return
        client.setblocking(False)
        server.setblocking(False)
        self._serial += 1
        pipe = _Pipe(self._serial, client, server)
        self._pipes[pipe.serial] = pipe
        self._sel.register(client, selectors.EVENT_READ, pipe)
        self._sel.register(server, selectors.EVENT_READ, pipe)

    def _close(self, pipe: _Pipe) -> None:
        if pipe.closed:
            return
        pipe.closed = True
        for sock in (pipe.client, pipe.server):
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._pipes.pop(pipe.serial, None)

    def _watch(self, pipe: _Pipe) -> None:
        if pipe.closed:
            return
        for sock, buf in ((pipe.client, pipe.to_client), (pipe.server, pipe.to_server)):
            self._sel.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if buf else 0), pipe)

    def _flush(self, pipe: _Pipe) -> None:
        for sock, buf in ((pipe.client, pipe.to_client), (pipe.server, pipe.to_server)):
            if buf:
                sent = sock.send(buf)
                del buf[:sent]
        self._watch(pipe)

    def _read(self, pipe: _Pipe, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        if not data:
            self._close(pipe)
            return
        if sock is pipe.client:
            pipe.from_client += data
            self._drain(pipe, pipe.from_client, pipe.to_server, self._client_message)
        else:
            pipe.from_server += data
            self._drain(pipe, pipe.from_server, pipe.to_client, self._server_message)
        if not pipe.closed:
            self._flush(pipe)

    @staticmethod
    def _drain(pipe: _Pipe, buf: bytearray, out: bytearray, message: Callable[[_Pipe, bytearray], bool]) -> None:
        """Handle ``buf`` a message at a time until ``message`` says to wait or the pipe
        closes; once the pipe passes bytes through (an encrypted stream or a cancel
        request), what is left goes to ``out`` unparsed."""
        while not pipe.closed and buf:
            if pipe.passthrough:
                out.extend(buf)
                buf.clear()
                return
            if not message(pipe, buf):
                return

    # -- frontend -> server --------------------------------------------------------

    def _client_message(self, pipe: _Pipe, buf: bytearray) -> bool:
        """Handle the next message from the client in ``buf``; False when it needs more bytes
        or must wait (the target's reply is pending), True to go on."""
        if pipe.hold_client:
            return False            # the target's reply is pending: the server gets nothing more
        if pipe.client_startup:
            return self._startup_packet(pipe, buf)
        framed = _take_message(buf)
        if framed is None:
            return False
        kind, msg = framed
        if not pipe.ready:
            pipe.to_server += msg        # authentication exchange
            return True
        if kind == b"X":
            pipe.to_server += msg
            return True
        if pipe.current is None and not (pipe.copy_in and kind in _COPY_FROM_CLIENT):
            if not self._begin_request(pipe, kind, msg):
                return False
        req = pipe.current
        if req is None:               # a copy message outside a request
            pipe.to_server += msg
            return True
        req.kinds += kind.decode("latin-1")
        if kind in (b"Q", b"P"):
            req.sql.append(_query_text(kind, msg))
        if kind in _COPY_FROM_CLIENT:
            if kind in (b"c", b"f"):
                pipe.copy_in = False
        pipe.to_server += msg
        if kind in _REQUEST_ENDS:
            pipe.inflight.append(req)
            pipe.current = None
            arm = self._arm
            if arm is not None and arm.target is req:
                pipe.hold_client = True
                pipe.withhold = req
        return True

    @staticmethod
    def _startup_packet(pipe: _Pipe, buf: bytearray) -> bool:
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
        if code in (_SSL_REQUEST, _GSSENC_REQUEST):
            pipe.server_byte_reply += 1
        elif code == _CANCEL_REQUEST:
            pipe.passthrough = True
        else:
            pipe.client_startup = False
        return True

    def _begin_request(self, pipe: _Pipe, kind: bytes, msg: bytes) -> bool:
        """Open a new request with ``msg`` as its first message; False when a
        *before* fault fires on it (the message is not forwarded)."""
        with self._lock:
            self._count += 1
            req = Request(index=self._count, conn=pipe.serial, status_before=pipe.status)
            self.requests.append(req)
            arm = self._arm
        pipe.current = req
        if arm is None or arm.target is not None:
            return True
        first_sql = [_query_text(kind, msg)] if kind in (b"Q", b"P") else []
        probe = Request(index=req.index, conn=req.conn, kinds=kind.decode("latin-1"), sql=first_sql,
                        status_before=req.status_before)
        hit = arm.at == req.index if arm.at is not None else bool(arm.match and arm.match(probe))
        if not hit:
            return True
        arm.target = req
        arm.conn = pipe.serial
        req.fault = arm.fault
        if arm.fault.after:
            return True
        req.kinds += kind.decode("latin-1")
        req.sql += first_sql
        self._fire(pipe, req)
        return False

    # -- server -> frontend --------------------------------------------------------

    def _server_message(self, pipe: _Pipe, buf: bytearray) -> bool:
        """Handle the next message from the server in ``buf``; False when it needs more bytes
        or the withheld reply's fault fired, True to go on."""
        if pipe.server_byte_reply:
            answer = bytes(buf[:1])
            del buf[:1]
            pipe.server_byte_reply -= 1
            pipe.to_client += answer
            if answer in (b"S", b"G"):
                pipe.passthrough = True
            return True
        framed = _take_message(buf)
        if framed is None:
            return False
        kind, msg = framed
        head = pipe.inflight[0] if pipe.inflight else None
        if kind == b"C" and head is not None:
            head.tags.append(msg[5:].split(b"\0", 1)[0].decode("utf-8", "replace"))
        elif kind == b"E" and head is not None:
            head.errors.append(_error_code(msg))
        elif kind == b"G":
            pipe.copy_in = True
        withheld = head is not None and head is pipe.withhold
        if kind == b"Z":
            pipe.status = chr(msg[5])
            if not pipe.ready:
                pipe.ready = True
            elif head is not None:
                pipe.inflight.popleft()
                head.status_after = pipe.status
        if withheld and head is not None and (kind == b"Z" or (kind == b"C" and head.tags[-1:] == ["COMMIT"])):
            if not head.status_after and kind == b"C":
                head.status_after = "I"
            self._fire(pipe, head)
            return False
        if not withheld:
            pipe.to_client += msg
        return True

    # -- faults ----------------------------------------------------------------------

    def _fire(self, pipe: _Pipe, req: Request) -> None:
        with self._lock:
            arm, self._arm = self._arm, None
        assert arm is not None
        if arm.fault.restarts:
            assert self._restart is not None
            # Every connection dies with the server's sessions; new ones wait (in the
            # listen backlog) until the server is back.
            self._sel.unregister(self._listener)
            for other in list(self._pipes.values()):
                self._close(other)
            restart = self._restart

            def restart_then_accept() -> None:
                try:
                    restart()
                finally:
                    self.restarts += 1
                    self._call_in_loop(lambda: self._sel.register(self._listener, selectors.EVENT_READ, None))
                    self._done(req)

            threading.Thread(target=restart_then_accept, name="fault-proxy-restart", daemon=True).start()
        else:
            self._done(req)          # before the client can see the cut
            self._close(pipe)

    def _done(self, req: Request) -> None:
        with self._lock:
            self.fired = req
        self.fired_event.set()

    def wait_fired(self, timeout: float = 30.0) -> Request | None:
        """The request the armed fault fired on (after a restart: once the server is back)."""
        self.fired_event.wait(timeout)
        return self.fired


def _take_message(buf: bytearray) -> tuple[bytes, bytes] | None:
    """Remove one whole protocol message (type byte, length, body) from the front of
    ``buf`` and return its type and its bytes; None, leaving ``buf`` as it is, until
    the message has arrived whole."""
    if len(buf) < 5:
        return None
    (length,) = struct.unpack("!i", buf[1:5])
    if len(buf) < 1 + length:
        return None
    msg = bytes(buf[:1 + length])
    del buf[:1 + length]
    return msg[:1], msg


def _query_text(kind: bytes, msg: bytes) -> str:
    body = msg[5:]
    if kind == b"P":                      # Parse: statement name \0 query \0 ...
        body = body.split(b"\0", 1)[1] if b"\0" in body else b""
    return body.split(b"\0", 1)[0].decode("utf-8", "replace")


def _error_code(msg: bytes) -> str:
    for field_ in msg[5:].split(b"\0"):
        if field_[:1] == b"C":
            return field_[1:].decode("ascii", "replace")
    return ""


def _socket_address(url: str) -> tuple[socket.AddressFamily, Any]:
    """Where the server of ``url`` listens: its Unix socket file, or host and port."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    host = str(info.get("host") or os.environ.get("PGHOST") or "/var/run/postgresql").split(",")[0]
    port = int(str(info.get("port") or os.environ.get("PGPORT") or 5432).split(",")[0])
    if host.startswith("/"):
        return socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}")
    return socket.AF_INET, (host, port)

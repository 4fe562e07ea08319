"""A PostgreSQL wire-protocol proxy that injects connection faults at exact points.

``FaultProxy(server_url)`` forwards every connection from its own Unix socket and counts
*requests* (everything up to a ``Sync`` or a simple ``Query``; a ``Flush`` outside a
request opens none), recording each in
:attr:`FaultProxy.requests`. One fault is armed at a time, at the Nth request or the
first whose SQL matches: ``DROP_BEFORE``; ``LOSE_ACK`` (the server completes it, the
connection is cut as it reports the result; a ``COPY ... FROM STDIN``, which completes
only once the client sent the rows, as the server asks for them); ``RESTART_BEFORE`` /
``RESTART_AFTER`` (the
same, with the server restarted); ``HOLD_COMMIT`` (held back while the client is cut and
the server's transaction keeps its locks; sent once another connection has waited
``hold_blocked_s`` or is about to commit, on :meth:`FaultProxy.release`, or after
``hold_max_s``). Then it forwards again. For tests only: no TLS.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from composer_ops.testing import wire
from composer_ops.testing.wire import Fault, Hold, Pipe, Request

__all__ = ["Fault", "FaultProxy", "Request"]



@dataclass
class _Arm:
    fault: Fault
    at: int | None
    match: Callable[[Request], bool] | None
    conn: int | None = None        # set once the target request is known
    target: Request | None = None


class FaultProxy:
    """See the module docstring. ``restart`` restarts the real server (blocking)."""

    def __init__(self, server_url: str, *, restart: Callable[[], Any] | None = None,
                 hold_blocked_s: float = 0.2, hold_max_s: float = 10.0) -> None:
        self.server_url = server_url
        self.hold_blocked_s, self.hold_max_s = hold_blocked_s, hold_max_s
        self._hold: Hold | None = None
        self._target = wire.socket_address(server_url)
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
        self._pipes: dict[int, Pipe] = {}
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

    def release(self) -> None:
        """Send a HOLD_COMMIT's held request to the server now, if it is still held."""
        self._call_in_loop(self._release)

    def wait_released(self, timeout: float = 30.0) -> bool:
        """Wait until the held request of the last HOLD_COMMIT (if any) was answered by
        the server (or its connection died); False if that took longer than ``timeout``."""
        hold = self._hold
        return hold is None or hold.answered.wait(timeout)

    @property
    def count(self) -> int:
        """Requests seen since :meth:`reset`."""
        with self._lock:
            return self._count

    def describe(self) -> str:
        """One line on the proxy's state: requests counted since :meth:`reset`, and each
        connection's (startup done, passing bytes through unparsed, a request open,
        requests awaiting their answer). For a test's failure message."""
        with self._lock:
            count = self._count
        pipes = "; ".join(
            f"conn {p.serial}: ready={p.ready} passthrough={p.passthrough} copy_in={p.copy_in} "
            f"open={p.current.index if p.current else None} inflight={len(p.inflight)} parked={p.parked}"
            for p in list(self._pipes.values()))
        return f"{count} requests since reset; {pipes or 'no connections'}"

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
            self._tick()
            holding = self._hold is not None and not self._hold.answered.is_set()
            for key, events in self._sel.select(timeout=0.02 if holding else 0.5):
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
                pipe: Pipe = key.data
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
        pipe = Pipe(self._serial, client, server)
        self._pipes[pipe.serial] = pipe
        self._sel.register(client, selectors.EVENT_READ, pipe)
        self._sel.register(server, selectors.EVENT_READ, pipe)

    def _close(self, pipe: Pipe) -> None:
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
        hold = self._hold
        if hold is not None and hold.pipe is pipe and not hold.answered.is_set():
            hold.answered.set()         # the server went away: nothing is held any more
            self._unpark()

    @staticmethod
    def _ends(pipe: Pipe) -> list[tuple[socket.socket, bytearray]]:
        ends = [(pipe.server, pipe.to_server)]
        return ends if pipe.client_gone else [(pipe.client, pipe.to_client), *ends]

    def _watch(self, pipe: Pipe) -> None:
        if pipe.closed:
            return
        for sock, buf in self._ends(pipe):
            self._sel.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if buf else 0), pipe)

    def _flush(self, pipe: Pipe) -> None:
        for sock, buf in self._ends(pipe):
            if buf:
                sent = sock.send(buf)
                del buf[:sent]
        self._watch(pipe)

    def _read(self, pipe: Pipe, sock: socket.socket) -> None:
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
            pipe.last_heard = time.monotonic()
            pipe.from_server += data
            self._drain(pipe, pipe.from_server, pipe.to_client, self._server_message)
        if not pipe.closed:
            self._flush(pipe)

    @staticmethod
    def _drain(pipe: Pipe, buf: bytearray, out: bytearray, message: Callable[[Pipe, bytearray], bool]) -> None:
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

    def _client_message(self, pipe: Pipe, buf: bytearray) -> bool:
        """Handle the next message from the client in ``buf``; False when it needs more bytes
        or must wait (the target's reply is pending), True to go on."""
        if pipe.hold_client or pipe.parked:
            return False            # the target's reply is pending: the server gets nothing more
        if pipe.client_startup:
            return wire.startup_packet(pipe, buf)
        if pipe.ready and pipe.current is None and self._park(pipe, buf):
            return False
        framed = wire.take_message(buf)
        if framed is None:
            return False
        kind, msg = framed
        if not pipe.ready:
            pipe.to_server += msg        # authentication exchange
            return True
        if kind == b"X" or (kind == b"H" and pipe.current is None):
            # A Terminate; or a Flush outside a request, which asks for nothing new: psycopg
            # sends one after a pipeline's Sync, and counted as the start of a request it
            # would swallow the client's next request (numbered as part of this one).
            pipe.to_server += msg
            return True
        if pipe.current is None and not (pipe.copy_in and kind in wire.COPY_FROM_CLIENT):
            if not self._begin_request(pipe, kind, msg):
                return False
        req = pipe.current
        if req is None:               # a copy message outside a request
            pipe.to_server += msg
            return True
        req.kinds += kind.decode("latin-1")
        if kind in (b"Q", b"P"):
            req.sql.append(wire.query_text(kind, msg))
        if kind in wire.COPY_FROM_CLIENT:
            if kind in (b"c", b"f"):
                pipe.copy_in = False
        if pipe.holding:
            pipe.held += msg
            if kind in wire.REQUEST_ENDS:
                pipe.current = None
                self._cut_client(pipe, req)
                return False
            return True
        pipe.to_server += msg
        pipe.last_heard = time.monotonic()
        if kind in wire.REQUEST_ENDS:
            pipe.inflight.append(req)
            pipe.current = None
            arm = self._arm
            if arm is not None and arm.target is req:
                pipe.hold_client = True
                pipe.withhold = req
        return True

    def _begin_request(self, pipe: Pipe, kind: bytes, msg: bytes) -> bool:
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
        first_sql = [wire.query_text(kind, msg)] if kind in (b"Q", b"P") else []
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
        if arm.fault is Fault.HOLD_COMMIT:
            pipe.holding = True       # the request's messages go to pipe.held (_client_message)
            return True
        req.kinds += kind.decode("latin-1")
        req.sql += first_sql
        self._fire(pipe, req)
        return False

    # -- server -> frontend --------------------------------------------------------

    def _server_message(self, pipe: Pipe, buf: bytearray) -> bool:
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
        framed = wire.take_message(buf)
        if framed is None:
            return False
        kind, msg = framed
        head = pipe.inflight[0] if pipe.inflight else None
        if kind == b"C" and head is not None:
            head.tags.append(msg[5:].split(b"\0", 1)[0].decode("utf-8", "replace"))
        elif kind == b"E" and head is not None:
            head.errors.append(wire.error_code(msg))
        elif kind == b"G":
            pipe.copy_in = True
        withheld = head is not None and head is pipe.withhold
        # A COPY FROM STDIN is answered with CopyInResponse ('G'), and the server completes
        # it only once the rows came: for a request cut after it reached the server (its
        # reply withheld, or held with its client gone), that answer is the last the server
        # gives before it waits on the client, so the connection is closed there.
        copy_in = kind == b"G"
        if kind == b"Z":
            pipe.status = chr(msg[5])
            if not pipe.ready:
                pipe.ready = True
            elif head is not None:
                pipe.inflight.popleft()
                head.status_after = pipe.status
        if withheld and head is not None and (kind == b"Z" or copy_in
                                              or (kind == b"C" and head.tags[-1:] == ["COMMIT"])):
            if not head.status_after and kind == b"C":
                head.status_after = "I"
            self._fire(pipe, head)
            return False
        hold = self._hold
        if hold is not None and hold.pipe is pipe:
            if copy_in and head is hold.request:
                self._close(pipe)         # no client to send the rows: answered (see _close)
                return False
            if kind == b"Z" and head is hold.request and hold.released_at is not None:
                hold.answered.set()       # the held request's answer is drained: the attempt is over
                self._close(pipe)
                self._unpark()
                return False
            return True                   # its client is gone: nothing to forward
        if not withheld:
            pipe.to_client += msg
        return True

    # -- faults ----------------------------------------------------------------------

    def _fire(self, pipe: Pipe, req: Request) -> None:
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

    # -- HOLD_COMMIT ---------------------------------------------------------------------

    def _cut_client(self, pipe: Pipe, req: Request) -> None:
        """The held request has arrived whole: cut the client's side only."""
        with self._lock:
            self._arm = None
        pipe.holding = False
        pipe.client_gone = True
        self._hold = Hold(pipe=pipe, request=req, cut_at=time.monotonic())
        self._done(req)              # before the client can see the cut
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(pipe.client)
        with contextlib.suppress(OSError):
            pipe.client.shutdown(socket.SHUT_RDWR)
        pipe.client.close()
        pipe.to_client.clear()

    def _release(self) -> None:
        """Send the held request to the server, once."""
        hold = self._hold
        if hold is None or hold.released_at is not None or hold.pipe.closed:
            return
        pipe = hold.pipe
        hold.released_at = time.monotonic()
        pipe.inflight.append(hold.request)
        pipe.to_server += pipe.held
        pipe.held.clear()
        try:
            self._flush(pipe)
        except OSError:
            self._close(pipe)

    def _commits(self, pipe: Pipe, buf: bytearray) -> bool:
        """Whether the request starting at the front of ``buf`` would commit: a COMMIT,
        or a statement outside a transaction block (not a BEGIN, not the empty query a
        pool checks a connection with). Judged on its first message."""
        framed = wire.peek_message(buf)
        if framed is None or framed[0] not in (b"Q", b"P"):
            return False
        text = wire.query_text(*framed).strip().upper()
        if text.startswith(("COMMIT", "END")):
            return True
        return pipe.status == "I" and bool(text) and not text.startswith(("BEGIN", "START TRANSACTION"))

    def _park(self, pipe: Pipe, buf: bytearray) -> bool:
        """Hold back a request of another connection that would commit while a
        HOLD_COMMIT's request is still held: the held one is released first, and this
        one goes on once it is answered (or has been running ``hold_blocked_s``)."""
        hold = self._hold
        if hold is None or hold.pipe is pipe or hold.answered.is_set() or hold.given_up:
            return False
        if not self._commits(pipe, buf):
            return False
        pipe.parked = True
        self._release()
        return True

    def _unpark(self) -> None:
        for pipe in list(self._pipes.values()):
            if pipe.parked:
                pipe.parked = False
                self._drain(pipe, pipe.from_client, pipe.to_server, self._client_message)
                if not pipe.closed:
                    self._flush(pipe)

    def _tick(self) -> None:
        """Time-driven steps of a HOLD_COMMIT (the event loop wakes often while one is on)."""
        hold = self._hold
        if hold is None or hold.answered.is_set():
            return
        now = time.monotonic()
        if hold.released_at is None:
            blocked = any((p.inflight or p.current is not None) and now - p.last_heard >= self.hold_blocked_s
                          for p in self._pipes.values() if p is not hold.pipe and not p.parked)
            if blocked or now - hold.cut_at >= self.hold_max_s:
                self._release()
        elif now - hold.released_at >= self.hold_blocked_s and not hold.given_up:
            hold.given_up = True    # the held request itself waits (on a lock a parked one holds)
            self._unpark()

    def _done(self, req: Request) -> None:
        with self._lock:
            self.fired = req
        self.fired_event.set()

    def wait_fired(self, timeout: float = 30.0) -> Request | None:
        """The request the armed fault fired on (after a restart: once the server is back)."""
        self.fired_event.wait(timeout)
        return self.fired

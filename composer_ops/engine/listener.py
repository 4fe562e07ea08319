"""LISTEN on its own autocommit connection, with a reconnect loop.

Wake-ups are an optimisation: callers also poll, so a lost connection costs
latency, never correctness. After a server restart the loop reconnects with capped
backoff and starts listening again. A notification sent while no connection listens
(before the first one is up, or between a loss and the reconnect) reaches no one: the
caller's ``on_listening`` is told each time listening (re)starts, on that connection,
and reads there what it may have missed (the worker: the wake-ups handed to it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from composer_ops.db.connect import connect
from composer_ops.db.retry import backoff_delay
from composer_ops.errors import ComposerError
from composer_ops.repo import outbox
from composer_ops.repo._base import Conn

log = logging.getLogger(__name__)


class Listener(threading.Thread):
    """Calls ``on_notify(channel, payload)`` for each notification on ``channel`` (and on
    each of ``also``) until ``stop`` is set; ``on_listening(conn)`` each time the
    connection ``conn`` has started listening on them all, before any notification on it
    (an error it raises counts as the connection's: a reconnect follows)."""

    def __init__(self, url: str, channel: str, on_notify: Callable[[str, str], None], stop: threading.Event,
                 also: Sequence[str] = (), on_listening: Callable[[Conn], None] | None = None) -> None:
        super().__init__(name=f"composer-listen-{channel}", daemon=True)
        self.url, self.channel, self.on_notify, self.stop_event = url, channel, on_notify, stop
        self.channels = [channel, *also]
        self.on_listening = on_listening

    def run(self) -> None:
        attempt = 0
        while not self.stop_event.is_set():
            try:
                with connect(self.url, autocommit=True, application_name="composer-listen") as conn:
                    for channel in self.channels:
                        outbox.listen(conn, channel)
                    if self.on_listening is not None:
                        self.on_listening(conn)
                    attempt = 0
                    while not self.stop_event.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self.on_notify(note.channel, note.payload)
            except ComposerError as exc:
                delay = backoff_delay(attempt, base=0.2, cap=5.0)
                log.info("LISTEN connection lost (%s); reconnecting in %.1fs", exc, delay)
                attempt += 1
                self.stop_event.wait(delay)

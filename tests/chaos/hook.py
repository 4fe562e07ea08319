"""The webhook receiver the chaos run's coordinators post to."""

from __future__ import annotations

import json
import zlib
from http.server import BaseHTTPRequestHandler

from composer_ops.engine.webhooks import SIGNATURE_HEADER, verify
from tests.receiver import Receiver

SECRET = "chaos-webhook-secret"


class Hook(Receiver):
    """Refuses (500) the first POST for about one run in ``fail_share``, so the relay's
    retry is exercised, and checks every signature."""

    def __init__(self, fail_share: int = 10) -> None:
        self.fail_share = fail_share
        self.received: dict[str, list[str]] = {}   # run_id -> statuses posted ("" for a refused one)
        self.bad_signatures = 0
        self.posts = 0
        self.torn = 0                              # requests cut off by a killed coordinator
        super().__init__(self._respond)

    def _respond(self, request: BaseHTTPRequestHandler, body: bytes) -> int | None:
        try:
            payload = json.loads(body)
        except ValueError:                         # the sender was SIGKILLed mid-request
            with self.lock:
                self.torn += 1
            return None
        ok = verify(SECRET, body, request.headers.get(SIGNATURE_HEADER) or "")
        run_id = str(payload.get("run_id"))
        with self.lock:
            self.posts += 1
            seen = self.received.setdefault(run_id, [])
            first = not seen and zlib.crc32(run_id.encode()) % self.fail_share == 0
            if not ok:
                self.bad_signatures += 1
            seen.append("" if first else str(payload.get("status")))
        return 500 if first else 204

    @property
    def base(self) -> str:
        return self.url("/hook")

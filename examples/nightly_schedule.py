"""A schedule of examples/order_fulfilment.json: a run every night at 02:30, Paris time.

Run with:  python -m examples.nightly_schedule   (on COMPOSER_DATABASE_URL, else the embedded server)
then keep `composer-ops coordinator` running: its schedules loop starts each slot's run.
"""

from __future__ import annotations

import json
from pathlib import Path

from composer_ops import Conflict, Engine

SPEC = Path(__file__).with_name("order_fulfilment.json")


def main() -> None:
    with Engine.connect() as engine:
        engine.migrate()
        engine.deploy(json.loads(SPEC.read_text(encoding="utf-8")))
        try:
            # 02:30 does not exist in Paris on the spring-forward day: that night's run starts at
            # 03:00; on the autumn day whose 02:30 happens twice it starts once, at the first.
            engine.schedules.create("orders-nightly", workflow="order-fulfilment", cron="30 2 * * *",
                                    timezone="Europe/Paris", input={"amount": 150},
                                    overlap="skip",      # last night's run still waits: skip tonight
                                    catchup="latest")    # after an outage, run the newest missed slot only
        except Conflict:
            pass                                        # made by an earlier run of this example
        for s in engine.schedules.list():
            print(f"{s.name}: {s.cron!r} in {s.timezone}, next slot {s.next_slot_at:%Y-%m-%d %H:%M %Z}")


if __name__ == "__main__":
    main()

"""The ceiling: pgbench's simple-update transaction (``pgbench -N``) on the same server.

``-N`` updates one account and inserts one history row per transaction: about the
least a durable, indexed write can cost. A 1-task Composer run needs three such
commits (start, claim, complete), so a third of this figure bounds its runs/s.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from composer_ops.testing.servers import Server

_TPS = re.compile(r"tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)")


def _run(binary: Path, args: list[str], timeout: float) -> str:
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{binary.name} {' '.join(args[:-1])} failed: {result.stderr.strip()[-500:]}")
    return result.stdout + result.stderr


def measure(server: Server, *, clients: tuple[int, ...] = (2, 8), duration: int = 5, scale: int = 5
            ) -> dict[str, Any]:
    """TPS of ``pgbench -N`` for each client count, in a scratch database."""
    bin_dir = server.client_bin_dir()
    if bin_dir is None or not (bin_dir / "pgbench").exists():
        return {"skipped": "pgbench not found (install postgresql-client or use the embedded server)"}
    pgbench = bin_dir / "pgbench"
    db = "bench_pgbench"
    url = server.create_database(db)
    try:
        _run(pgbench, ["-i", "-q", "-s", str(scale), url], timeout=600)
        server.checkpoint()
        tps: dict[str, float] = {}
        for c in clients:
            out = _run(pgbench, ["-N", "-n", "-c", str(c), "-j", str(min(c, 2)), "-T", str(duration), url],
                       timeout=duration + 120)
            found = _TPS.search(out)
            if not found:
                raise RuntimeError(f"cannot read tps from pgbench output:\n{out[-800:]}")
            tps[str(c)] = float(found.group(1))
        return {"binary": str(pgbench), "scale": scale, "duration_s": duration, "tps_by_clients": tps,
                "command": f"pgbench -N -n -c C -j min(C,2) -T {duration} (after pgbench -i -s {scale})"}
    finally:
        server.drop_database(db)

"""A Markdown table of the fault sweep's tally (docs/reliability.md, "The fault sweep").

Each write path's sweep appends one line to ``.pytest_cache/composer-faults.jsonl``
(tests/faults/harness.py): the path, how many requests and commits it sends without
a fault, how many cases of each fault ran, which were skipped and how many broke an
invariant. ``python -m tests.faults.table [FILE]`` prints them as a Markdown table,
the last line of each path winning (the file is appended to by every run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.faults.harness import TALLY

#: the tally's fault names, in the table's column order
FAULTS = ("drop-before", "lose-ack", "restart-before", "restart-after", "commit-held")


def rows(lines: list[str]) -> dict[str, dict[str, Any]]:
    last: dict[str, dict[str, Any]] = {}
    for line in lines:
        if line.strip():
            entry = json.loads(line)
            last.pop(entry["path"], None)
            last[entry["path"]] = entry
    return last


def table(entries: dict[str, dict[str, Any]]) -> str:
    out = ["| write path | requests (commits) | " + " | ".join(FAULTS) + " | cases broken |",
           "|---|---|" + "---|" * len(FAULTS) + "---|"]
    for path, e in entries.items():
        cases = e["cases"]
        out.append(f"| {path} | {e['requests']} ({e['commits']}) | "
                   + " | ".join(str(cases.get(f, 0)) for f in FAULTS) + f" | {e['failed']} |")
    servers = sorted({str(e.get("server")) for e in entries.values()})
    total = sum(sum(v for k, v in e["cases"].items() if k != "none") for e in entries.values())
    broken = sum(e["failed"] for e in entries.values())
    out.append("")
    out.append(f"{len(entries)} write paths, {total} fault cases, {broken} broken (server {', '.join(servers)}).")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else TALLY
    if not path.exists():
        print(f"no tally at {path}: run pytest tests/faults first", file=sys.stderr)
        return 2
    print(table(rows(path.read_text(encoding="utf-8").splitlines())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

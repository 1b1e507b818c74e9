"""Two ``make bench`` runs side by side: each scenario's shmreduce rows against torch's
reducers with the same strategy, as ``vs torch`` in each run (above 1: shmreduce is ahead,
whichever the metric's direction). For a run on another torch (docs/compatibility.md,
"torch 2.8 to 2.11": the adopt path) beside the pinned one.

    python benchmarks/compare.py LABEL_A RESULTS_A.json LABEL_B RESULTS_B.json

Prints a markdown table; measures nothing.
"""

from __future__ import annotations

import json
import sys

from report import fmt
from scenarios import SCENARIOS

PAIRS = (("shmreduce-fd", "torch-fd"), ("shmreduce-fs", "torch-fs"))


def table(runs: list[tuple[str, dict]]) -> str:
    head = "| scenario | " + " | ".join(f"{label}: {mine} vs {theirs}" for label, _ in runs for mine, theirs in PAIRS) + " |"
    lines = [head, "| --- |" + " ---: |" * (len(runs) * len(PAIRS))]
    for scenario in SCENARIOS:
        cells = []
        for _label, run in runs:
            rows = run["summary"].get(scenario.key, {})
            for mine, theirs in PAIRS:
                if mine in rows and theirs in rows:
                    ratio, medians = fmt(rows[mine]["ratio"]), f"{fmt(rows[mine]['median'])} / {fmt(rows[theirs]['median'])}"
                    cells.append(f"{ratio}x ({medians} {scenario.unit})")
                else:
                    cells.append("")
        if any(cells):
            lines.append(f"| {scenario.key} {scenario.title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) % 2 or not argv:
        print(__doc__, file=sys.stderr)
        return 2
    runs = []
    for label, path in zip(argv[::2], argv[1::2], strict=True):
        with open(path) as f:
            runs.append((label, json.load(f)))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

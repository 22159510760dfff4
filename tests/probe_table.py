"""Print the fuzz and fault-injection probes as a table: tried and behaved as promised.

Usage: ``POSTERIORZOO_PROBE_LOG=probes.jsonl pytest -m "slow or not slow" tests/test_fuzz*
tests/test_fault_injection.py; python tests/probe_table.py probes.jsonl``.
"""

from __future__ import annotations

import collections
import json
import sys


def main(path: str) -> None:
    tried: collections.Counter = collections.Counter()
    behaved: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()
    with open(path) as lines:
        records = [json.loads(line) for line in lines]
    for record in records:
        key = (record["command"], record["class"])
        tried[key] += 1
        behaved[key] += record["ok"]
        refused[key] += record.get("refused", False)
    commands = sorted({c for c, _ in tried})
    classes = sorted({k for _, k in tried})
    print("| command | " + " | ".join(classes) + " | all |")
    print("|---" * (len(classes) + 2) + "|")
    for command in commands:
        cells = [f"{behaved[command, k]}/{tried[command, k]}" if tried[command, k] else ""
                 for k in classes]
        total = sum(tried[command, k] for k in classes)
        good = sum(behaved[command, k] for k in classes)
        print(f"| {command} | " + " | ".join(cells) + f" | {good}/{total} |")
    print("| all | " + " | ".join(
        f"{sum(behaved[c, k] for c in commands)}/{sum(tried[c, k] for c in commands)}"
        for k in classes) + f" | {sum(behaved.values())}/{sum(tried.values())} |")
    print(f"\nrefused (exit 2): {sum(refused.values())} of {sum(tried.values())} probes")


if __name__ == "__main__":
    main(sys.argv[1])

"""Two builds' kernel timings side by side: medians over the runs of each arm (kernels_gpu.py
JSON files, the arms' runs interleaved by the caller) and the ratio of the first arm to the
second, per op and length.

    python3 benchmarks/kernels_ab.py new=a1.json,a2.json old=b1.json,b2.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(argv: list[str]) -> None:
    arms: dict[str, dict[tuple[str, int], list[float]]] = {}
    for spec in argv:
        name, files = spec.split("=", 1)
        times: dict[tuple[str, int], list[float]] = defaultdict(list)
        for path in files.split(","):
            with open(path) as f:
                for row in json.load(f)["rows"]:
                    times[row["op"], row["tokens"]].append(row["ms"])
        arms[name] = times
    names = list(arms)
    first, second = arms[names[0]], arms[names[-1]]
    print(f"| op | tokens | {' | '.join(f'{n} ms (runs)' for n in names)} | {names[0]} / {names[-1]} |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for key in sorted(set().union(*arms.values()), key=lambda k: (k[1], k[0])):
        cells = []
        for n in names:
            ms = arms[n].get(key, [])
            cells.append(f"{statistics.median(ms):.4f} ({len(ms)}: {min(ms):.4f}-{max(ms):.4f})" if ms else "-")
        both = key in first and key in second
        ratio = f"{statistics.median(first[key]) / statistics.median(second[key]):.3f}" if both else "-"
        print(f"| {key[0]} | {key[1]} | {' | '.join(cells)} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1:])

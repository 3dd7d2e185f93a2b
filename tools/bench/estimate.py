"""The whole JevBench split's concurrency-1 figures, estimated from a run of part of it
(`--per-group`): every split request's floor is known without a GPU run (the tokens of its shared
tree and the run's ceilings), only latencies are sampled.

A group's latencies are scaled by (mean floor of all the group's split requests / mean floor of
the requests measured): a group whose measured requests are shorter than the group would
otherwise pass for it. Groups weigh as many requests as the public split has of them."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from openjev.tools.bench.harness import Sample
from openjev.tools.bench.workload import COUNTS, GROUP_NAMES

# "kind group" -> requests of the public split
WEIGHTS = {f"{kind} {g}": n for kind, counts in COUNTS.items() for g, n in zip(GROUP_NAMES, counts, strict=True)}


@dataclass(frozen=True)
class Split:
    """The workload's single-question requests: group -> names, and each one's floor in seconds
    (None where none can be computed; `why` says why)."""

    groups: dict[str, list[str]]
    floors: dict[str, float] | None
    why: str = ""

    def names(self) -> set[str]:
        return {n for names in self.groups.values() for n in names}

    def weight(self, group: str) -> int:
        # a group the public split lacks (a hand-made workload) weighs its own request count
        return WEIGHTS.get(group, len(self.groups[group]))

    def floor_values(self) -> dict[str, list[float]]:
        floors = self.floors
        return {g: [floors[n] for n in names] for g, names in self.groups.items()} if floors else {}

    def scaled(self, samples: Iterable[Sample], arm: str) -> dict[str, list[float]]:
        """group -> `arm`'s answered timed latencies in it, scaled by the group's floor ratio
        (unscaled without floors). Their mean is the group's ratio of means (latencies / their
        floors) times the mean floor of all its split requests."""
        answered = [s for s in samples if s.arm == arm and s.block >= 0 and s.status == "OK"]
        out = {}
        for group, names in self.groups.items():
            members = set(names)
            got = [s for s in answered if s.case in members]
            if not got:
                continue
            scale = 1.0
            if self.floors:
                scale = statistics.fmean(self.floors[n] for n in names) / statistics.fmean(
                    self.floors[s.case] for s in got
                )
            out[group] = [scale * s.latency_seconds for s in got]
        return out

    def missing(self, values: dict[str, list[float]], groups: Iterable[str]) -> list[str]:
        return [g for g in groups if not values.get(g)]

    def mean(self, values: dict[str, list[float]], groups: Iterable[str]) -> float:
        """The weighted mean over `groups`; nan if one of them has no values."""
        groups = list(groups)
        if not groups or self.missing(values, groups):
            return float("nan")
        total = sum(self.weight(g) for g in groups)
        return sum(self.weight(g) * statistics.fmean(values[g]) for g in groups) / total

    def median(self, values: dict[str, list[float]]) -> float:
        """The weighted median: each group's values share its weight; nan if a group has none."""
        if self.missing(values, self.groups):
            return float("nan")
        return weighted_median([(v, self.weight(g) / len(values[g])) for g in self.groups for v in values[g]])


def weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The smallest value at which the (value, weight) pairs' cumulative weight reaches half."""
    if not pairs:
        return float("nan")
    ordered = sorted(pairs)
    half, total = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return value
    return ordered[-1][0]

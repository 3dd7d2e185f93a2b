"""Tables (markdown) and a plot from benchmark samples."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from openjev.tools.bench.estimate import Split
from openjev.tools.bench.harness import Results, percentile
from openjev.tools.bench.workload import Case

_percentile = percentile


def _stats_ms(values: list[float]) -> str:
    if not values:
        return "| - | - | - |"
    return (
        f"| {1e3 * statistics.fmean(values):.1f} | {1e3 * _percentile(values, 0.5):.1f} "
        f"| {1e3 * _percentile(values, 0.95):.1f} |"
    )


def group_of(case: Case) -> str:
    return f"{case.kind} {case.group}"


JEVBENCH_KINDS = ("choice", "noul", "score")  # the single-question split; multi/capacity cases are extra


def _verdict(value: float, limit: float, below: bool) -> str:
    """'met', or how far the value is from the limit, relative to the limit (below: the value must
    not exceed it; else it must reach it)."""
    if value != value:
        return "not measured"
    if (value <= limit) if below else (value >= limit):
        return "met"
    if limit == 0:
        return "missed"
    off = 100 * (value / limit - 1) if below else 100 * (1 - value / limit)
    # a miss under 1% in tenths: whole percents printed "0% over the limit" beside "missed"
    text = f"{off:.0f}" if off >= 0.95 else f"{off:.1f}" if off >= 0.05 else "<0.1"
    return f"missed: {text}% over the limit" if below else f"missed: {text}% under the target"


MIN_P95_SAMPLES = 20  # below this a p95 is one of the few slowest samples, not a percentile
SUBSET = "subset: the verdict is the split estimate's, below"


def targets(
    results: Results,
    cases: list[Case],
    arm: str,
    floors: dict[str, float] | None,
    more: Sequence[tuple[str, str, str]] = (),
    split: Split | None = None,
) -> list[str]:
    """Issue 13's targets, each with its verdict: those at concurrency 1 for `arm` on the JevBench
    split, then `more` (target, measured, verdict) rows from the run's other parts. split: the
    workload's whole split (None: the run's cases are all of it). Where the run measured part of
    it, its latency rows get no verdict: the estimate for the whole split below gives it. Latencies
    are of answered requests, so where any timed request failed no latency target is met."""
    run_split = {c.name for c in cases if c.kind in JEVBENCH_KINDS}
    subset = split is not None and bool(split.names() - run_split)
    noul = {c.name for c in cases if c.kind == "noul"}
    short_choice = {c.name for c in cases if c.kind == "choice" and c.group == "1-128"}
    timed = [s for s in results.samples if s.block >= 0 and s.status == "OK" and s.case in run_split]
    ours = {(s.case, s.block): s.latency_seconds for s in timed if s.arm == arm}
    sent = [s for s in results.samples if s.block >= 0 and s.arm == arm and s.case in run_split]
    failed = sum(s.status != "OK" for s in sent)
    # the answered requests' latencies may not meet a target on behalf of the failed ones
    unmet = f"missed: {failed} of {len(sent)} requests failed" if failed else None
    no_split = split is not None and not split.groups and any(s.arm == arm and s.block >= 0 for s in results.samples)
    if not sent and not more and not no_split:
        return []

    def judge(value: float, limit: float, below: bool) -> str:
        return unmet or (SUBSET if subset else _verdict(value, limit, below))

    if no_split:
        title = "concurrency 1: the workload has no single-question JevBench-shaped requests, nor a split estimate"
    elif sent and not ours:
        title = f"concurrency 1: none of {arm}'s {len(sent)} timed requests was answered"
    elif not ours:
        title = "no concurrency-1 blocks in this run"
    elif subset and split:
        title = (
            f"concurrency 1: {arm} on {len(run_split)} of the workload's {len(split.names())} single-question "
            "JevBench-shaped requests, each counted once"
        )
    else:
        title = f"concurrency 1: {arm} on this run's {len(run_split)} single-question JevBench-shaped requests"
    lines = [
        "",
        f"## Targets ({title})",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    if sent:  # the latencies below are of answered requests only: a failed one must show
        lines.append(
            f"| every request answered (the targets below count answered ones) | {failed} errors of {len(sent)} "
            f"| {'met' if not failed else 'missed'} |"
        )
    # the warm-up traversal (each case's first request after start-up) is timed apart, but a
    # failure there is a cold start gone wrong, which nothing else in a load-only run would show
    warm = [s for s in results.samples if s.block < 0 and s.arm == arm and s.case in run_split]
    if warm:
        warm_failed = sum(s.status != "OK" for s in warm)
        lines.append(
            f"| every warm-up request answered (each case's first, reported apart) | {warm_failed} errors of "
            f"{len(warm)} | {'met' if not warm_failed else 'missed'} |"
        )
    lat = list(ours.values())
    if floors and lat:
        mean, mean_floor = statistics.fmean(lat), statistics.fmean(floors[c] for c, _ in ours)
        p50, p50_floor = _percentile(lat, 0.5), _percentile([floors[c] for c, _ in ours], 0.5)
        lines += [
            f"| p50 <= 1.3x floor p50 | {1e3 * p50:.1f} ms / {1e3 * p50_floor:.1f} ms = {p50 / p50_floor:.2f}x "
            f"| {judge(p50 / p50_floor, 1.3, True)} |",
        ]
        choice = [(t, floors[c]) for (c, _), t in ours.items() if c in short_choice]
        if choice:
            m, f = statistics.fmean(t for t, _ in choice), statistics.fmean(f for _, f in choice)
            lines.append(
                f"| choice 1-128 mean <= 1.4x its floor | {1e3 * m:.1f} ms / {1e3 * f:.1f} ms = {m / f:.2f}x "
                f"| {judge(m / f, 1.4, True)} |"
            )
    noul_lat = [t for (c, _), t in ours.items() if c in noul]
    if noul_lat:
        noul_mean = statistics.fmean(noul_lat)
        lines.append(f"| noul mean <= 40 ms | {1e3 * noul_mean:.1f} ms | {judge(noul_mean, 0.040, True)} |")
    if floors and lat:
        lines.append(
            f"| mean <= 1.5x roofline floor | {1e3 * mean:.1f} ms / {1e3 * mean_floor:.1f} ms "
            f"= {mean / mean_floor:.2f}x | {judge(mean / mean_floor, 1.5, True)} |"
        )
    hf = {(s.case, s.block): s.latency_seconds for s in timed if s.arm == "transformers"}
    paired = [k for k in hf if k in ours]
    if paired:
        speedup = sum(hf[k] for k in paired) / sum(ours[k] for k in paired)
        lines.append(
            f"| >= 12x faster than transformers (ratio of means, same cases and blocks) | {speedup:.1f}x over "
            f"{len(paired)} paired requests | {judge(speedup, 12.0, False)} |"
        )
    lines += [f"| {t} | {m} | {v} |" for t, m, v in more]
    if ours and subset and split:
        lines += _split_estimate(results, arm, split, unmet)
    return lines


def _split_estimate(results: Results, arm: str, split: Split, unmet: str | None = None) -> list[str]:
    """The whole split's targets from this run's part of it (estimate.py says how); unmet: the
    verdict of every latency target where some of the run's requests failed."""
    everything = list(split.groups)
    ours = split.scaled(results.samples, arm)
    floors = split.floor_values()
    if floors:
        how = (
            "each group's measured latencies are scaled by the mean floor of all its split requests over that of "
            "the requests measured, and the groups weighted by the split's request counts (floors exact over all "
            f"{len(split.names())} split requests, from the tokens of their shared trees)."
        )
    else:
        how = f"this run's group means weighted by the split's request counts, unscaled ({split.why})."
    lines = ["", f"Estimated for the whole split: {how}", "", "| target | estimate | verdict |", "|---|---|---|"]

    def row(target: str, groups: list[str], shown: str, value: float, limit: float) -> None:
        gaps = split.missing(ours, groups)
        shown = f"no answered samples in {', '.join(gaps)}" if gaps else shown
        lines.append(f"| {target} | {shown} | {unmet or _verdict(value, limit, True)} |")

    if floors:
        p50, p50_floor = split.median(ours), split.median(floors)
        shown = f"{1e3 * p50:.1f} ms / {1e3 * p50_floor:.1f} ms = {p50 / p50_floor:.2f}x"
        row("p50 <= 1.3x floor p50", everything, shown, p50 / p50_floor, 1.3)
        for target, groups, limit in (
            ("choice 1-128 mean <= 1.4x its floor", [g for g in everything if g == "choice 1-128"], 1.4),
            ("mean <= 1.5x floor", everything, 1.5),
        ):
            if groups:
                m, f = split.mean(ours, groups), split.mean(floors, groups)
                row(target, groups, f"{1e3 * m:.1f} ms / {1e3 * f:.1f} ms = {m / f:.2f}x", m / f, limit)
    hf = split.scaled(results.samples, "transformers")
    if hf:
        gaps = split.missing(hf, everything)
        theirs, mine = split.mean(hf, everything), split.mean(ours, everything)
        speedup = theirs / mine
        shown = f"{1e3 * theirs:.1f} ms / {1e3 * mine:.1f} ms = {speedup:.1f}x"
        shown = f"no transformers samples in {', '.join(gaps)}" if gaps else shown
        lines.append(f"| >= 12x faster than transformers | {shown} | {unmet or _verdict(speedup, 12.0, False)} |")
    noul_groups = [g for g in everything if g.startswith("noul ")]
    if noul_groups:
        noul = split.mean(ours, noul_groups)
        shown = f"{1e3 * noul:.1f} ms"
        if floors:  # how near the fixed target sits to what the card allows at all
            noul_floor = split.mean(floors, noul_groups)
            shown += f" (its floor {1e3 * noul_floor:.1f} ms: {noul / noul_floor:.2f}x)"
        row("noul mean <= 40 ms", noul_groups, shown, noul, 0.040)
    return lines


def render(
    results: Results,
    cases: list[Case],
    arms: list[str],
    *,
    reference_arm: str,
    floors: dict[str, float] | None,
    tokens: dict[str, tuple[int, int]],
    header: str,
    more_targets: Sequence[tuple[str, str, str]] = (),
    sections: Sequence[str] = (),
    split: Split | None = None,
) -> str:
    """floors: case -> floor seconds (None without a GPU); tokens: case -> (submitted, shared-plan computed);
    more_targets: rows for the targets table from the run's other parts; sections: lines appended at the end;
    split: the workload's whole split, for the estimate where the run measured part of it."""
    timed = [s for s in results.samples if s.block >= 0]
    warm = [s for s in results.samples if s.block < 0]
    lines = [header, ""]
    if not results.samples:  # a run of the load parts alone
        return (
            "\n".join(
                lines + targets(results, cases, reference_arm, floors, list(more_targets), split) + list(sections)
            )
            + "\n"
        )

    lines += [
        "## Overall (timed blocks)",
        "",
        "| arm | requests | errors | mean ms | p50 ms | p95 ms | tokens computed / submitted "
        "| mean / floor | p50 / floor-p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    floor_values = [floors[c.name] for c in cases] if floors else []
    for arm in arms:
        ok = [s for s in timed if s.arm == arm and s.status == "OK"]
        errors = sum(1 for s in timed if s.arm == arm and s.status != "OK")
        submitted = sum(s.input_tokens for s in ok)
        computed = sum(s.input_tokens - s.saved_tokens for s in ok)
        ratio = f"{computed / submitted:.3f}" if submitted else "-"
        lat = [s.latency_seconds for s in ok]
        if floors and lat:
            mean_floor = statistics.fmean(floors[s.case] for s in ok)
            p50_over = _percentile(lat, 0.5) / _percentile([floors[s.case] for s in ok], 0.5)
            over = f"{statistics.fmean(lat) / mean_floor:.2f}x | {p50_over:.2f}x"
        else:
            over = "- | -"
        lines.append(f"| {arm} | {len(ok)} | {errors} {_stats_ms(lat)} {ratio} | {over} |")
    if floors:
        lines += [
            "",
            f"Roofline floor over this run's {len(floor_values)} cases: mean "
            f"{1e3 * statistics.fmean(floor_values):.1f} ms, p50 {1e3 * _percentile(floor_values, 0.5):.1f} ms "
            "(tokens of the shared tree; the split's floor is the estimate's, below).",
        ]

    lines += targets(results, cases, reference_arm, floors, list(more_targets), split)
    lines += [
        "",
        "## Warm-up traversal (first request of each case, reported apart)",
        "",
        "| arm | errors | mean ms | p50 ms | p95 ms |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        mine = [s for s in warm if s.arm == arm]
        answered = [s.latency_seconds for s in mine if s.status == "OK"]
        lines.append(f"| {arm} | {len(mine) - len(answered)} {_stats_ms(answered)}")

    lines += [
        "",
        f"## Paired ratios (arm latency / {reference_arm} latency, same case and block)",
        "",
        "| arm | median of per-request ratios | p10 | p90 | per-block ratio of means (min - max) |",
        "|---|---|---|---|---|",
    ]
    ref = {(s.case, s.block): s.latency_seconds for s in timed if s.arm == reference_arm and s.status == "OK"}
    for arm in arms:
        if arm == reference_arm:
            continue
        pairs = [
            (s.latency_seconds, ref[(s.case, s.block)])
            for s in timed
            if s.arm == arm and s.status == "OK" and (s.case, s.block) in ref
        ]
        ratios = [a / r for a, r in pairs]
        per_block: defaultdict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for s in timed:
            if s.arm == arm and s.status == "OK" and (s.case, s.block) in ref:
                per_block[s.block][0] += s.latency_seconds
                per_block[s.block][1] += ref[(s.case, s.block)]
        block_ratios = [a / r for a, r in per_block.values()]
        if ratios:
            lines.append(
                f"| {arm} | {_percentile(ratios, 0.5):.2f} | {_percentile(ratios, 0.1):.2f} | "
                f"{_percentile(ratios, 0.9):.2f} | {min(block_ratios):.2f} - {max(block_ratios):.2f} |"
            )

    lines += [
        "",
        "## By kind and length group (timed blocks; ms)",
        "",
        f"Outside inference: {reference_arm}'s latency less the worker's inference_seconds (frontend, "
        "both RPCs, the wait for the scheduler), median.",
        "",
        "| group | cases | floor p50 | "
        + " | ".join(f"{a} mean / p50 / p95 (n)" for a in arms)
        + f" | {reference_arm} outside inference |",
        "|---|---|---|" + "---|" * len(arms) + "---|",
    ]
    groups = defaultdict(list)
    for case in cases:
        groups[group_of(case)].append(case.name)
    for group, names in groups.items():
        floor_cell = f"{1e3 * _percentile([floors[n] for n in names], 0.5):.1f}" if floors else "-"
        cells = []
        for arm in arms:
            lat = [s.latency_seconds for s in timed if s.arm == arm and s.status == "OK" and s.case in names]
            p95 = f"{1e3 * _percentile(lat, 0.95):.1f}" if len(lat) >= MIN_P95_SAMPLES else "-"
            cells.append(
                f"{1e3 * statistics.fmean(lat):.1f} / {1e3 * _percentile(lat, 0.5):.1f} / {p95} ({len(lat)})"
                if lat
                else "-"
            )
        outside = [
            s.latency_seconds - s.inference_seconds
            for s in timed
            if s.arm == reference_arm and s.status == "OK" and s.case in names and s.inference_seconds > 0
        ]
        cells.append(f"{1e3 * _percentile(outside, 0.5):.2f}" if outside else "-")
        lines.append(f"| {group} | {len(names)} | {floor_cell} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"n: answered timed requests; p95 is shown from {MIN_P95_SAMPLES} of them up ('-' below: it would be one "
        "of the few slowest).",
    ]

    submitted = sum(t[0] for t in tokens.values())
    lines += [
        "",
        f"Tokens in this run's {len(tokens)} cases: {submitted} submitted; {sum(t[1] for t in tokens.values())} "
        f"in the shared token trees.",
    ]
    lines += sections
    return "\n".join(lines) + "\n"


def plot(results: Results, cases: list[Case], arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [s for s in results.samples if s.block >= 0 and s.status == "OK"]
    groups = list(dict.fromkeys(group_of(c) for c in cases))
    group_cases = {g: {c.name for c in cases if group_of(c) == g} for g in groups}
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.9), 4.5))
    for i, arm in enumerate(arms):
        means = []
        for g in groups:
            lat = [s.latency_seconds for s in timed if s.arm == arm and s.case in group_cases[g]]
            means.append(1e3 * statistics.fmean(lat) if lat else 0.0)
        ax.bar([x + i * width for x in range(len(groups))], means, width, label=arm)
    ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels(groups, rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean latency (ms, log)")
    ax.legend(fontsize=8)
    ax.set_title("Latency by kind x length group and arm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

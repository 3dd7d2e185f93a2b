"""The whole split's estimate from a run of part of it: every split request's floor is known, the
measured latencies are scaled by their group's floors; the subset's own rows carry no verdict."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from openjev.tools.bench import harness, prepare, report, roofline, workload
from openjev.tools.bench.estimate import Split
from openjev.tools.bench.main import render_saved, stratified

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.jsonl"


def _split_cases() -> list[workload.Case]:
    return [c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS]


def _groups(cases) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for c in cases:
        groups.setdefault(report.group_of(c), []).append(c.name)
    return groups


def _samples(cases, arm: str, seconds, blocks=(0, 1)) -> list[harness.Sample]:
    return [harness.Sample(arm, c.name, b, seconds(c), "OK") for c in cases for b in blocks]


def _rising_floors(groups: dict[str, list[str]]) -> dict[str, float]:
    """Within a group the floor rises with the request's place: a group's first request (the one
    --per-group 1 runs) is its shortest, as a run's subset happened to be."""
    return {
        n: 0.010 * (k + 1) * (1 + i / len(names))
        for k, names in enumerate(groups.values())
        for i, n in enumerate(names)
    }


def _p50_of_groups(values: dict[str, float], weights: dict[str, int]) -> float:
    """The median when each group's value counts weights[group] times."""
    ordered = sorted((v, weights[g]) for g, v in values.items())
    half, total = sum(weights.values()) / 2, 0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return value
    raise AssertionError


def test_the_estimate_takes_each_group_at_its_full_floor():
    whole = _split_cases()
    groups = _groups(whole)
    floors = _rising_floors(groups)
    cases = stratified(whole, 1)
    results = harness.Results(
        _samples(cases, "ours-auto", lambda c: 3 * floors[c.name])
        + _samples(cases, "transformers", lambda c: 10 * floors[c.name])
    )
    text = "\n".join(report.targets(results, cases, "ours-auto", floors, split=Split(groups, floors)))
    # the groups' ratio of means is 3 on their shortest requests: the estimate is 3x the floor of
    # all 231 requests (the committed workload has the split's counts: a plain mean)
    floor = statistics.fmean(floors.values())
    assert f"| mean <= 1.5x floor | {3e3 * floor:.1f} ms / {1e3 * floor:.1f} ms = 3.00x | missed: 100% over" in text
    noul = statistics.fmean(f for n, f in floors.items() if n.startswith("noul-"))
    assert f"| noul mean <= 40 ms | {3e3 * noul:.1f} ms (its floor {1e3 * noul:.1f} ms: 3.00x) |" in text
    short = statistics.fmean(floors[n] for n in groups["choice 1-128"])
    assert f"| choice 1-128 mean <= 1.4x its floor | {3e3 * short:.1f} ms / {1e3 * short:.1f} ms = 3.00x" in text
    # p50: each measured sample scaled to its group's mean floor, weighed by the group's count
    group_means = {g: statistics.fmean(floors[n] for n in names) for g, names in groups.items()}
    p50 = _p50_of_groups({g: 3 * m for g, m in group_means.items()}, {g: len(v) for g, v in groups.items()})
    p50_floor = sorted(floors.values())[len(floors) // 2]  # 231 requests: the 116th
    assert f"| p50 <= 1.3x floor p50 | {1e3 * p50:.1f} ms / {1e3 * p50_floor:.1f} ms = {p50 / p50_floor:.2f}x" in text
    assert f"| >= 12x faster than transformers | {1e4 * floor:.1f} ms / {3e3 * floor:.1f} ms = 3.3x " in text
    assert "3.3x | missed: 72% under the target |" in text
    assert "each group's measured latencies are scaled by the mean floor of all its split requests" in text


def test_a_subset_run_leaves_its_latency_verdicts_to_the_estimate():
    """The subset's rows weigh its few long requests as much as the split's many short ones (one
    run's said met where the split estimate said missed): only the estimate gives the verdict."""
    whole = _split_cases()
    groups = _groups(whole)
    floors = _rising_floors(groups)
    cases = stratified(whole, 1)
    results = harness.Results(_samples(cases, "ours-auto", lambda c: 1.2 * floors[c.name]))
    lines = report.targets(results, cases, "ours-auto", floors, split=Split(groups, floors))
    first = lines[: lines.index(next(x for x in lines if x.startswith("Estimated for the whole split")))]
    subset = [x for x in first if "subset: the verdict is the split estimate's, below" in x]
    assert [x.split(" |")[0] for x in subset] == [
        "| p50 <= 1.3x floor p50",
        "| choice 1-128 mean <= 1.4x its floor",
        "| noul mean <= 40 ms",
        "| mean <= 1.5x roofline floor",
    ]
    assert "| every request answered (the targets below count answered ones) | 0 errors of 24 | met |" in first
    assert not any(x.endswith("| met |") for x in subset)
    assert "## Targets (concurrency 1: ours-auto on 12 of the workload's 231 single-question" in lines[1]
    # the whole split run: verdicts stay on the rows
    all_floors = {c.name: 0.010 for c in whole}
    whole_run = harness.Results(_samples(whole, "ours-auto", lambda c: 0.012))
    text = "\n".join(report.targets(whole_run, whole, "ours-auto", all_floors, split=Split(groups, all_floors)))
    assert "| mean <= 1.5x roofline floor | 12.0 ms / 10.0 ms = 1.20x | met |" in text
    assert "subset" not in text and "Estimated for the whole split" not in text


def test_a_group_without_samples_and_a_workload_without_a_split():
    whole = _split_cases()
    groups = _groups(whole)
    floors = {c.name: 0.010 for c in whole}
    cases = [c for c in stratified(whole, 1) if report.group_of(c) != "score 513-2048"]
    results = harness.Results(_samples(cases, "ours-auto", lambda c: 0.020))
    text = "\n".join(report.targets(results, cases, "ours-auto", floors, split=Split(groups, floors)))
    assert "| mean <= 1.5x floor | no answered samples in score 513-2048 | not measured |" in text
    assert "| noul mean <= 40 ms | 20.0 ms (its floor 10.0 ms: 2.00x) | met |" in text  # the noul groups are all there
    multi = [c for c in workload.read_jsonl(WORKLOAD) if c.kind == "multi"]
    results = harness.Results(_samples(multi, "ours-auto", lambda c: 0.020))
    text = "\n".join(report.targets(results, multi, "ours-auto", None, split=Split({}, None, "no split requests")))
    assert (
        "## Targets (concurrency 1: the workload has no single-question JevBench-shaped requests, nor a split" in text
    )


def _saved_run(tmp_path, cases, candidates_of, **extra) -> dict:
    """results.json of a --per-group 1 run: floors at a read floor of 12 ms and 2 x 24e9 FLOP per
    token at 1e15 FLOP/s (read-bound to 250 tokens), latencies twice the floors."""
    ceilings = roofline.Ceilings(4e12, 1e15, "H200")
    size = (48e9, 24 * 10**9)
    tokens = prepare.token_counts(cases, candidates_of)
    floors = {n: roofline.size_floor_seconds(size, t[1], ceilings) for n, t in tokens.items()}
    assert min(floors.values()) == 0.012 < max(floors.values())  # both terms of the floor occur
    saved = {
        "samples": [s.__dict__ for s in _samples(cases, "ours-auto", lambda c: 2 * floors[c.name])],
        "sweep": [],
        "floors": floors,
        "header": "# test",
        "tokens": tokens,
        "ceilings": ceilings.__dict__,
        "matmul_parameters": size[1],
    } | extra
    (tmp_path / "results.json").write_text(json.dumps(saved))
    return saved


def test_report_only_computes_the_whole_split_floors(tmp_path, demo_model):
    """--report-only on a results.json that holds floors of its 33 cases only (and, written before
    weight_read_bytes was saved, no model size): the 231 floors come from the tokenizer."""
    _, candidates_of, _ = prepare.longest_tokens_fn(demo_model)
    everything = workload.read_jsonl(WORKLOAD)
    whole = [c for c in everything if c.kind in report.JEVBENCH_KINDS]
    saved = _saved_run(tmp_path, stratified(whole, 1), candidates_of)
    ceilings = roofline.Ceilings(4e12, 1e15, "")
    floor = statistics.fmean(
        roofline.size_floor_seconds((48e9, 24 * 10**9), t[1], ceilings)
        for t in prepare.token_counts(whole, candidates_of).values()
    )
    expected = (
        f"| mean <= 1.5x floor | {2e3 * floor:.1f} ms / {1e3 * floor:.1f} ms = 2.00x | missed: 33% over the limit |"
    )
    assert expected in render_saved(tmp_path, everything, candidates_of)
    _saved_run(tmp_path, stratified(whole, 1), candidates_of, weight_read_bytes=48e9)
    assert expected in render_saved(tmp_path, everything, candidates_of)
    # another model size or tokenizer than the run's would not give its own floors back: no scaling
    _saved_run(tmp_path, stratified(whole, 1), candidates_of, weight_read_bytes=40e9)
    text = render_saved(tmp_path, everything, candidates_of)
    assert "unscaled (the saved model size does not give the run's floors back)" in text
    first = next(iter(saved["tokens"]))
    saved["tokens"][first] = [1, 1]
    (tmp_path / "results.json").write_text(json.dumps(saved))
    text = render_saved(tmp_path, everything, candidates_of)
    assert "unscaled (its token counts are not the run's: another --workload file" in text

"""The benchmark report's target verdicts and its re-rendering from saved results, on samples with
known latencies over the committed workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openjev.tools.bench import harness, prepare, report, workload
from openjev.tools.bench.main import render_saved, stratified

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.jsonl"


def _samples(cases, arm: str, seconds, blocks=(0, 1)) -> list[harness.Sample]:
    return [harness.Sample(arm, c.name, b, seconds(c, b), "OK") for c in cases for b in blocks]


def test_targets_on_the_whole_split():
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS]
    floors = {c.name: 0.050 for c in cases}
    results = harness.Results(
        _samples(cases, "ours-auto", lambda c, b: 0.055 if c.kind != "noul" else 0.030)
        + _samples(cases, "transformers", lambda c, b: 0.700)
    )
    text = "\n".join(report.targets(results, cases, "ours-auto", floors))
    mean = (0.055 * (len(cases) - 74) + 0.030 * 74) / len(cases)  # 74 noul requests in the split
    assert f"= {mean / 0.050:.2f}x | met |" in text
    assert "| noul mean <= 40 ms | 30.0 ms | met |" in text
    assert "| p50 <= 1.3x floor p50 | 55.0 ms / 50.0 ms = 1.10x | met |" in text
    assert "| choice 1-128 mean <= 1.4x its floor | 55.0 ms / 50.0 ms = 1.10x | met |" in text
    assert f"{0.700 / mean:.1f}x over {2 * len(cases)} paired requests | met |" in text
    assert "Estimated for the whole split" not in text  # nothing to weight: the whole split ran


def test_verdicts_say_how_far_from_the_limit_and_which_way():
    """X is relative to the limit: over it for an "at most" target, under it for an "at least" one."""
    assert report._verdict(1.95, 1.3, True) == "missed: 50% over the limit"
    assert report._verdict(0.50, 0.55, False) == "missed: 9% under the target"
    # a miss under 1% is not printed as 0%
    assert report._verdict(1.304, 1.3, True) == "missed: 0.3% over the limit"
    assert report._verdict(1.3001, 1.3, True) == "missed: <0.1% over the limit"
    assert report._verdict(1.3, 1.3, True) == report._verdict(0.6, 0.6, False) == "met"
    assert report._verdict(float("nan"), 1.3, True) == "not measured"


def test_targets_missed_on_the_whole_split():
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS]
    short = {c.name for c in cases if c.group == "1-128"}
    results = harness.Results(_samples(cases, "ours-auto", lambda c, b: 0.020 if c.name in short else 0.200))
    floors = {c.name: 0.010 for c in cases}
    text = "\n".join(report.targets(results, cases, "ours-auto", floors))
    assert "| choice 1-128 mean <= 1.4x its floor | 20.0 ms / 10.0 ms = 2.00x | missed: 43% over the limit |" in text
    # 120 of the 231 requests are short: the median is a short one's
    assert "| p50 <= 1.3x floor p50 | 20.0 ms / 10.0 ms = 2.00x | missed: 54% over the limit |" in text


def test_failed_requests_show_beside_the_targets():
    """Target latencies are of answered requests: a failed one is its own missed row."""
    cases = stratified([c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS], 1)
    samples = _samples(cases, "ours-auto", lambda c, b: 0.010)
    samples[0] = harness.Sample("ours-auto", samples[0].case, 0, 120.0, "DEADLINE_EXCEEDED")
    text = "\n".join(report.targets(harness.Results(samples), cases, "ours-auto", {c.name: 0.010 for c in cases}))
    assert (
        f"| every request answered (the targets below count answered ones) | 1 errors of {len(samples)} | missed |"
        in text
    )
    # the answered ones are fast, but a run with a failed request meets no latency target
    assert "| met |" not in text
    assert f"= 1.00x | missed: 1 of {len(samples)} requests failed |" in text


def test_a_failed_warm_up_request_shows_in_the_targets_and_its_table():
    """The warm-up traversal is timed apart; its failures were dropped with its latencies, so a
    cold start that timed out read as "0 errors" and a fast warm-up mean."""
    cases = stratified([c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS], 1)
    samples = _samples(cases, "ours-auto", lambda c, b: 0.020, blocks=(-1, 0))
    samples[0] = harness.Sample("ours-auto", samples[0].case, -1, 120.0, "DEADLINE_EXCEEDED")
    floors = {c.name: 0.010 for c in cases}
    results = harness.Results(samples)
    rows = "\n".join(report.targets(results, cases, "ours-auto", floors))
    assert (
        f"| every request answered (the targets below count answered ones) | 0 errors of {len(cases)} | met |" in rows
    )
    assert f"| every warm-up request answered (each case's first, reported apart) | 1 errors of {len(cases)} " in rows
    tokens = {c.name: (1, 1) for c in cases}
    text = report.render(
        results, cases, ["ours-auto"], reference_arm="ours-auto", floors=floors, tokens=tokens, header="# t"
    )
    warm_up = text.split("## Warm-up traversal")[1].split("##")[0]
    assert "| ours-auto | 1 | 20.0 | 20.0 | 20.0 |" in warm_up


def test_no_answered_request_still_shows_the_failures():
    """Every timed request failed: the targets table says so (it was left out, or showed only
    the memory row as if no blocks had run)."""
    cases = stratified([c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS], 1)
    samples = [harness.Sample("ours-auto", c.name, b, 120.0, "DEADLINE_EXCEEDED") for c in cases for b in (0, 1)]
    memory = [("peak device memory", "50 GiB", "met")]
    floors = {c.name: 0.01 for c in cases}
    text = "\n".join(report.targets(harness.Results(samples), cases, "ours-auto", floors, memory))
    assert f"none of ours-auto's {len(samples)} timed requests was answered" in text
    assert f"| {len(samples)} errors of {len(samples)} | missed |" in text


def test_p50_over_floor_uses_the_floors_of_the_cases_the_arm_ran():
    """An arm that ran only the short cases is compared with their floors, not the workload's."""
    cases = stratified([c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS], 1)
    short = [c for c in cases if c.group == "1-128"]
    floors = {c.name: (0.010 if c in short else 0.500) for c in cases}
    results = harness.Results(
        _samples(cases, "ours-auto", lambda c, b: 2 * floors[c.name])
        + _samples(short, "transformers", lambda c, b: 0.020)
    )
    text = report.render(
        results,
        cases,
        ["ours-auto", "transformers"],
        reference_arm="ours-auto",
        floors=floors,
        tokens={c.name: (10, 5) for c in cases},
        header="# test",
    )
    row = next(line for line in text.splitlines() if line.startswith("| transformers |"))
    assert row.endswith("| 2.00x | 2.00x |"), row


def test_render_saved_leaves_out_early_blocks(tmp_path):
    cases = stratified(workload.read_jsonl(WORKLOAD), 1)
    slow_first = _samples(cases, "ours-auto", lambda c, b: 1.0 if b == 0 else 0.010)
    saved = {
        "samples": [s.__dict__ for s in slow_first],
        "sweep": [],
        "floors": None,
        "header": "# test",
        "tokens": {c.name: [10, 5] for c in cases},
        "peak_memory_bytes": [],
        "ceilings": None,
    }
    (tmp_path / "results.json").write_text(json.dumps(saved))
    all_blocks = render_saved(tmp_path, cases, None)  # no floors: the tokenizer is not needed
    later = render_saved(tmp_path, cases, None, from_block=1, name="report-from-block1")
    assert f"| ours-auto | {2 * len(cases)} | 0 | 505.0 |" in all_blocks
    assert f"| ours-auto | {len(cases)} | 0 | 10.0 | 10.0 | 10.0 |" in later
    assert (tmp_path / "report-from-block1.md").exists() and (tmp_path / "latency-from-block1.png").exists()


def test_render_saved_at_other_ceilings(tmp_path, demo_model):
    """--ceilings: the floors follow the given rates (a compute-bound floor halves at twice the
    GEMM rate, a read-bound one keeps the copy rate's), and a shape that does not give back the
    run's own floors is refused."""
    from openjev.tools.bench import roofline
    from openjev.worker.cuda.fused_weights import shape_config

    config = shape_config("27b")
    cases = stratified(workload.read_jsonl(WORKLOAD), 1)[:2]
    tokens = {cases[0].name: [100, 10], cases[1].name: [8000, 4000]}  # read-bound, compute-bound
    own = roofline.Ceilings(4e12, 500e12, "H200")
    floors = {n: roofline.floor_seconds(config, t[1], own) for n, t in tokens.items()}
    read_s = roofline.model_size(config)[0] / 4e12
    assert floors[cases[0].name] == read_s and floors[cases[1].name] > 2 * read_s
    saved = {
        "samples": [s.__dict__ for s in _samples(cases, "ours-auto", lambda c, b: floors[c.name] * 2)],
        "sweep": [],
        "floors": floors,
        "header": "# test",
        "tokens": tokens,
        "ceilings": own.__dict__,
        "matmul_parameters": roofline.token_matmul_parameters(config),
    }
    (tmp_path / "results.json").write_text(json.dumps(saved))
    _, candidates_of, _ = prepare.longest_tokens_fn(demo_model)
    text = render_saved(
        tmp_path, cases, candidates_of, ceilings=roofline.Ceilings(4e12, 1000e12, "given"), config=config
    )
    assert "re-rendered at ceilings copy 4.00 TB/s, bf16 GEMM 1000 TFLOP/s (the run measured 4.00 TB/s, 500" in text
    floor = (floors[cases[0].name] + max(read_s, floors[cases[1].name] / 2)) / 2
    mean = (floors[cases[0].name] + floors[cases[1].name]) / 2 * 2
    assert f"| ours-auto | 4 | 0 | {1e3 * mean:.1f} |" in text
    assert f"| {mean / floor:.2f}x |" in text
    own_text = render_saved(tmp_path, cases, candidates_of)
    assert f"| {mean / ((floors[cases[0].name] + floors[cases[1].name]) / 2):.2f}x |" in own_text
    with pytest.raises(ValueError, match="does not follow from this model shape"):
        render_saved(tmp_path, cases, candidates_of, ceilings=own, config=shape_config("9b"))
    # a run saved before the last layer's MLP was left out of the count re-renders as it measured
    old = {
        n: max(read_s, 2.0 * roofline.matmul_parameters(config) * t[1] / own.matmul_flops_per_second)
        for n, t in tokens.items()
    }
    assert old[cases[1].name] > floors[cases[1].name]
    saved |= {"floors": old, "matmul_parameters": roofline.matmul_parameters(config)}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    at_own = render_saved(tmp_path, cases, candidates_of, ceilings=own, config=config)
    assert f"| {mean / ((old[cases[0].name] + old[cases[1].name]) / 2):.2f}x |" in at_own


def test_group_table_gives_n_and_p95_only_from_20_samples():
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.kind == "choice"]
    many, few = cases[0], next(c for c in cases if c.group != cases[0].group)
    samples = _samples([many], "ours-auto", lambda c, b: 0.001 * (b + 1), blocks=range(20))
    samples += _samples([few], "ours-auto", lambda c, b: 0.010, blocks=(0, 1))
    text = report.render(
        harness.Results(samples),
        [many, few],
        ["ours-auto"],
        reference_arm="ours-auto",
        floors=None,
        tokens={c.name: (10, 5) for c in (many, few)},
        header="# test",
    )
    assert "| group | cases | floor p50 | ours-auto mean / p50 / p95 (n) |" in text
    assert f"| {report.group_of(many)} | 1 | - | 10.5 / 10.5 / 19.1 (20) |" in text
    assert f"| {report.group_of(few)} | 1 | - | 10.0 / 10.0 / - (2) |" in text
    assert "p95 is shown from 20 of them up" in text

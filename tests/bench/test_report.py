"""The benchmark report's target verdicts and its re-rendering from saved results, on samples with
known latencies over the committed workload."""

from __future__ import annotations

import json
from pathlib import Path

from openjev.tools.bench import harness, report, workload
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


def test_targets_missed_and_split_weighted_estimate():
    cases = stratified([c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS], 1)
    short = {c.name for c in cases if c.group == "1-128"}
    results = harness.Results(_samples(cases, "ours-auto", lambda c, b: 0.020 if c.name in short else 0.200))
    floors = {c.name: 0.010 for c in cases}
    text = "\n".join(report.targets(results, cases, "ours-auto", floors))
    assert "missed by" in text and "transformers" not in text
    # weighted by the split's counts (120 of 231 requests are 1-128 tokens) the mean is lower
    weighted = (120 * 0.020 + 111 * 0.200) / 231
    assert f"| mean <= 1.5x floor | {1e3 * weighted:.1f} ms / 10.0 ms" in text
    assert "| choice 1-128 mean <= 1.4x its floor | 20.0 ms / 10.0 ms = 2.00x | missed by 43% |" in text
    # and so is the p50: 120 of 231 requests are short, so the weighted median is a short one's
    # (this run's cases, each counted once, are mostly long: their median is 200 ms)
    assert "| p50 <= 1.3x floor p50 | 20.0 ms / 10.0 ms = 2.00x | missed by 54% |" in text
    assert "| p50 <= 1.3x floor p50 | 200.0 ms / 10.0 ms = 20.00x" in text


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
    all_blocks = render_saved(tmp_path, cases)
    later = render_saved(tmp_path, cases, from_block=1, name="report-from-block1")
    assert f"| ours-auto | {2 * len(cases)} | 0 | 505.0 |" in all_blocks
    assert f"| ours-auto | {len(cases)} | 0 | 10.0 | 10.0 | 10.0 |" in later
    assert (tmp_path / "report-from-block1.md").exists() and (tmp_path / "latency-from-block1.png").exists()

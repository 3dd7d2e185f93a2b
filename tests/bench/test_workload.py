"""The committed JevBench-shaped workload has the public split's shape, and the harness and
report run on it through the real servers."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

from openjev.tools.bench import harness, report, workload
from openjev.tools.bench.main import longest_tokens_fn

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "benchmarks" / "workload.jsonl"


def test_split_counts_and_lengths(demo_model):
    cases = workload.read_jsonl(WORKLOAD)
    single = [c for c in cases if c.kind in workload.COUNTS]
    assert len(single) == 231
    counts = collections.Counter((c.kind, c.group) for c in single)
    for kind, per_group in workload.COUNTS.items():
        assert [counts[(kind, g)] for g in workload.GROUP_NAMES] == list(per_group)
    candidates = sum(
        1 if q["type"] == "noul" else len(q["criteria"]) for c in single for q in c.request["questions"].values()
    )
    assert candidates == workload.TOTAL_CANDIDATES
    _, _, longest = longest_tokens_fn(demo_model)
    bounds = dict(zip(workload.GROUP_NAMES, workload.GROUPS, strict=True))
    for case in single:
        low, high = bounds[case.group]
        assert low <= longest(case.request) <= high, case.name
    assert {c.group for c in cases if c.kind == "multi"} == {"3q", "4q", "8q"}
    assert {c.group for c in cases if c.kind == "capacity"} >= {
        "16k",
        "17-candidates",
        "33-candidates",
        "score-2",
        "score-10",
    }


def test_every_request_has_a_state_and_none_is_repeated():
    """A target length drawn below the question's own once left 65% of the 1-128 requests without
    a state, and 31 of the 243 identical to another (so replays of "different" requests)."""
    cases = workload.read_jsonl(WORKLOAD)
    texts = [json.dumps(c.request, sort_keys=True) for c in cases]
    assert len(set(texts)) == len(cases)
    for case in cases:
        state = case.request["state"]
        assert state if isinstance(state, str) else state["ticket"]["messages"], case.name


def test_a_short_group_still_gets_a_sentence_of_state(monkeypatch):
    """With questions of 60 tokens and 20 a sentence, every 1-128 request has 1-3 sentences."""
    monkeypatch.setattr(workload, "_state_of", lambda rng, n, as_json: ["sentence"] * n)

    def longest(request: dict) -> int:
        return 60 + 20 * len(request["state"])

    rng = random.Random(3)
    lengths = [longest(workload._fit_state(rng, {}, 1, 128, longest)) for _ in range(200)]
    assert set(lengths) == {80, 100, 120}


def test_generation_is_seeded(demo_model):
    _, _, longest = longest_tokens_fn(demo_model)
    first = [c.to_json() for c in workload.multi_question_cases(longest)]
    assert first == [c.to_json() for c in workload.multi_question_cases(longest)]
    committed = {c.name: c.to_json() for c in workload.read_jsonl(WORKLOAD)}
    assert all(
        committed[json_name] == text
        for json_name, text in ((c.name, c.to_json()) for c in workload.multi_question_cases(longest))
    )


def test_harness_and_report_through_real_servers(pair, tmp_path):
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.group == "1-128"][:2]
    arms = [
        harness.Arm("ours-off", pair.frontend.address, "off"),
        harness.Arm("ours-shared", pair.frontend.address, "shared"),
    ]
    results = harness.run_blocks(arms, cases, blocks=2, progress=lambda m: None)
    assert len(results.samples) == 3 * len(cases) * len(arms)
    assert all(s.status == "OK" for s in results.samples)
    text = report.render(
        results,
        cases,
        [a.name for a in arms],
        reference_arm="ours-shared",
        floors=None,
        tokens={c.name: (1, 1) for c in cases},
        header="# test",
    )
    assert "| ours-off | 4 | 0 |" in text
    # the time outside the worker's inference, from real RPCs: positive, under a second
    row = next(line for line in text.splitlines() if line.startswith(f"| {cases[0].kind} 1-128 |"))
    assert "ours-shared outside inference" in text and 0 < float(row.split("|")[-2]) < 1000
    report.plot(results, cases, [a.name for a in arms], tmp_path / "latency.png")
    assert (tmp_path / "latency.png").stat().st_size > 1000

"""The numbers the performance claims rest on, against calculations written out here on small
hand-checkable cases: the roofline floor and its two terms, the tokens a floor counts, the split
estimate's weighting and median, the percentile, the target limits, and the numerical gates'
comparisons (each gate must be able to fail)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from small_config import SMALL

from openjev.tools.bench import gates, gates_report, harness, load, prepare, report, report_load, roofline, workload
from openjev.tools.bench.estimate import Split, weighted_median
from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.model.runner import TorchRunner
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits

# Weights of SMALL by hand (d 8, MLP 16, GDN conv channels 2*4 + 2*4 = 16, value dim 8):
EMBED = 32 * 8
FINAL_NORM = 8
MLP = 3 * 8 * 16  # gate, up, down
NORMS = 2 * 8  # input and post-attention layer norms
GDN = 16 * 8 + 8 * 8 + 2 * 8 + 2 * 8 + 8 * 8  # qkv, z, b, a, out: products
GDN_OTHER = 16 * 4 + 2 + 2 + 4  # conv taps, dt_bias, A_log, norm: element-wise
ATTENTION = 16 * 8 + 4 * 8 + 4 * 8 + 8 * 8  # q with its gate, k, v, o: products
ATTENTION_OTHER = 4 + 4  # q and k norms
ALL_BUT_EMBED = FINAL_NORM + 2 * (NORMS + MLP) + GDN + GDN_OTHER + ATTENTION + ATTENTION_OTHER


def test_model_size_reads_every_weight_but_the_embedding_and_multiplies_all_but_the_last_mlp():
    """The read term is bf16 bytes of every weight a pass reads (the embedding is a row gather);
    the product term is what every computed token multiplies (the last MLP runs on head rows)."""
    weight_bytes, params = roofline.model_size(SMALL)
    assert weight_bytes == 2 * ALL_BUT_EMBED == 2864
    assert params == 2 * MLP + GDN + ATTENTION - MLP == 928
    assert roofline.token_matmul_parameters(SMALL) == params
    assert roofline.weight_bytes_resident(SMALL) == 2 * (ALL_BUT_EMBED + EMBED)


def test_the_floor_is_the_slower_of_one_weight_read_and_the_products():
    ceilings = roofline.Ceilings(copy_bytes_per_second=2e12, matmul_flops_per_second=1e14, device="test")
    size = (4e9, 10**9)  # read: 4e9 / 2e12 = 2 ms; products: 2 * 1e9 * tokens / 1e14 = 0.02 ms a token
    assert roofline.size_floor_seconds(size, 50, ceilings) == pytest.approx(0.002)  # read-bound (1 ms products)
    assert roofline.size_floor_seconds(size, 100, ceilings) == pytest.approx(0.002)  # the two terms meet
    assert roofline.size_floor_seconds(size, 400, ceilings) == pytest.approx(0.008)  # compute-bound
    # floor_seconds of a config is the same from its hand-counted size
    tiny = roofline.Ceilings(2864 / 1e-3, 2 * 928 * 1000.0, "test")  # read 1 ms; 1 ms a token
    assert roofline.floor_seconds(SMALL, 1, tiny) == pytest.approx(1e-3)
    assert roofline.floor_seconds(SMALL, 3, tiny) == pytest.approx(3e-3)


def test_a_floor_counts_each_questions_shared_tree_once():
    """Candidates of one question share their prefix: the floor's tokens are the tree's, each
    shared token once, not once per candidate."""
    ids = [[[1, 2, 3, 4], [1, 2, 3, 5]], [[7, 8], [7, 8, 9]]]  # trees of 4 + 1 and 2 + 1 tokens

    def candidates_of(request: dict) -> list[list[list[int]]]:
        return ids

    case = workload.Case("hand", "choice", "1-128", {})
    assert prepare.token_counts([case], candidates_of) == {"hand": (4 + 4 + 2 + 3, 5 + 3)}


def test_groups_weigh_as_many_requests_as_the_public_split_has():
    """choice 1-128 has 72 requests in the split, noul 1-128 36: a run of one request each still
    weighs them 2:1; a group the split lacks weighs its own request count."""
    split = Split({"choice 1-128": ["a"], "noul 1-128": ["b"], "hand made": ["c", "d", "e"]}, None)
    assert [split.weight(g) for g in split.groups] == [72, 36, 3]
    values = {"choice 1-128": [1.0], "noul 1-128": [4.0, 4.0]}
    assert split.mean(values, ["choice 1-128", "noul 1-128"]) == pytest.approx((72 * 1.0 + 36 * 4.0) / 108)
    assert split.mean({"hand made": [2.0]} | values, split.groups) == pytest.approx((72 + 36 * 4 + 3 * 2) / 111)


def test_the_weighted_median_shares_a_groups_weight_among_its_values():
    """noul 1-128's four values share its weight of 36 (9 each): choice 1-128's one value, at 72
    of 108, is the median. Counted per value, noul would weigh 144 and move it to 2.0."""
    split = Split({"choice 1-128": ["a"], "noul 1-128": ["b"]}, None)
    assert split.median({"choice 1-128": [1.0], "noul 1-128": [2.0, 3.0, 4.0, 5.0]}) == 1.0
    # the smallest value whose cumulative weight reaches half, exactly
    assert weighted_median([(1.0, 1.0), (2.0, 1.0)]) == 1.0
    assert weighted_median([(4.0, 1.0), (3.0, 1.0), (1.0, 1.0), (2.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 1.0), (2.0, 3.0)]) == 2.0


def test_scaled_takes_answered_timed_samples_of_the_arm_to_the_groups_mean_floor():
    """The group's mean floor is 20 ms; the one measured request's is 10 ms: its latency doubles.
    The warm-up, a failed request and another arm's sample are not the arm's timed latencies."""
    split = Split({"choice 1-128": ["a", "b"]}, {"a": 0.010, "b": 0.030})
    samples = [
        harness.Sample("ours", "a", 0, 0.020, "OK"),
        harness.Sample("ours", "a", -1, 9.0, "OK"),
        harness.Sample("ours", "a", 1, 9.0, "DEADLINE_EXCEEDED"),
        harness.Sample("other", "a", 0, 9.0, "OK"),
    ]
    assert split.scaled(samples, "ours") == {"choice 1-128": [pytest.approx(0.040)]}


def test_percentile_interpolates_between_closest_ranks():
    assert harness.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.95) == pytest.approx(4.8)  # rank 3.8 of 0..4
    assert harness.percentile([10.0, 20.0], 0.5) == pytest.approx(15.0)
    assert harness.percentile([10.0, 20.0, 30.0], 1.0) == 30.0
    assert harness.percentile([7.0], 0.95) == 7.0


# --- the numerical gates: Diff on hand-made answers -------------------------------------------


def _answer(heads: list[list[float]], probs: list[list[float]]) -> ExecutionResult:
    return ExecutionResult(heads, probs, "off", "off", False, "none", 0, 2, 2, 1, 0, 0.0, 0.0)


def _problems(kinds, base, other, exact=False, tolerance=1e-3) -> list[str]:
    diff = gates.Diff()
    diff.add(kinds, base, other)
    return diff.problems("p", exact, tolerance)


def test_exact_gate_compares_bits_not_values():
    """-0.0 equals 0.0 but is another bit pattern: --exact fails on it, and on a one-ulp change."""
    base = _answer([[0.0, 1.0]], [[0.5, 0.5]])
    assert gates.same_bits(0.0, 0.0) and not gates.same_bits(0.0, -0.0)
    assert not gates.same_bits(1.0, 1.0 + 2.0**-52)
    signed = _answer([[-0.0, 1.0]], [[0.5, 0.5]])
    [problem] = _problems(["noul"], base, signed, exact=True)
    assert "1 head scores and 0 probabilities differ in some bit" in problem
    assert _problems(["noul"], base, signed, exact=False) == []  # within tolerance, not gated on bits
    prob = _answer([[0.0, 1.0]], [[0.5, 0.5 + 2.0**-53]])
    [problem] = _problems(["noul"], base, prob, exact=True)
    assert "0 head scores and 1 probabilities differ in some bit" in problem


def test_tolerance_gate_fails_just_over_it():
    base = _answer([[0.5, 100.0]], [[0.5, 0.5]])
    assert _problems(["noul"], base, _answer([[0.5, 100.0]], [[0.5 - 2.0**-10, 0.5 + 2.0**-10]])) == []
    [problem] = _problems(["noul"], base, _answer([[0.5, 100.0]], [[0.498, 0.502]]))
    assert problem.startswith("p: max_dp 2.00e-03 > 0.001")
    # a head score is relative to max(1, |s|): 2e-3 on 0.5 fails, 5e-2 on 100 (5e-4 of it) passes
    [problem] = _problems(["noul"], base, _answer([[0.502, 100.0]], [[0.5, 0.5]]))
    assert problem.startswith("p: max_rel_dhead 2.00e-03 > 0.001")
    assert _problems(["noul"], base, _answer([[0.5, 100.05]], [[0.5, 0.5]])) == []


def test_changes_the_tolerance_would_pass_are_gated_on_their_own():
    """A noul answer crossing 0.5 and a choice changing its top option fail though every
    probability moved by less than the tolerance; a score's expected value moves ten times more
    than its probabilities."""
    noul = _problems(["noul"], _answer([[0.0]], [[0.5001, 0.4999]]), _answer([[0.0]], [[0.4999, 0.5001]]))
    assert noul == ["p: 1 noul flips"]
    choice = _problems(["choice"], _answer([[0.0]], [[0.5001, 0.4999]]), _answer([[0.0]], [[0.4999, 0.5001]]))
    assert choice == ["p: 1 choice changes"]
    p = [0.5] + [0.0] * 9 + [0.5]
    q = [0.5 - 8e-4] + [0.0] * 9 + [0.5 + 8e-4]  # dp 8e-4; expected score 10 x 8e-4 higher
    [problem] = _problems(["score"], _answer([[0.0]], [p]), _answer([[0.0]], [q]))
    assert problem.startswith("p: max_dscore 8.00e-03 > 0.001")


@pytest.mark.parametrize("which", ["head", "prob"])
def test_a_value_non_finite_in_one_answer_only_fails(which):
    """max() skips a NaN, so a NaN where the reference had a number would pass the tolerance."""
    nan = float("nan")
    base = _answer([[0.5]], [[0.5, 0.5]])
    other = _answer([[nan]], [[0.5, 0.5]]) if which == "head" else _answer([[0.5]], [[nan, 0.5]])
    assert _problems(["noul"], base, other) == ["p: 1 head scores or probabilities are not finite"]
    assert _problems(["noul"], other, base) == ["p: 1 head scores or probabilities are not finite"]


def test_a_failed_request_fails_its_policy():
    diff = gates.Diff(failures=1)
    diff.add(["noul"], _answer([[0.5]], [[0.5, 0.5]]), _answer([[0.5]], [[0.5, 0.5]]))
    assert diff.problems("p", True, 1e-3) == ["p: 1 failures"]


def test_a_mixed_run_that_shared_no_pass_fails():
    base = {"requests": 3, "shared": 0, "long": 0, "split_shared": 0, "mismatches": 0, "failures": 0}
    assert gates.mixed_problems(base) == [
        "mixed run: no request shared a pass with another (batch invariance not tested)"
    ]
    assert gates.mixed_problems(base | {"shared": 1}) == []
    assert gates.mixed_problems(base | {"shared": 1, "failures": 2}) == ["mixed run: 2 requests failed"]


def test_exact_is_the_default_on_cuda_only():
    assert gates.parse_args(["--model", "m", "--workload", "w", "--backend", "cuda"]).exact is True
    assert gates.parse_args(["--model", "m", "--workload", "w"]).exact is False
    assert gates.parse_args(["--model", "m", "--workload", "w", "--backend", "cuda", "--no-exact"]).exact is False
    assert gates.parse_args(["--model", "m", "--workload", "w"]).tolerance == 1e-3


# --- the targets' limits, each just missed ------------------------------------------------------

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.jsonl"


def _split_cases() -> list[workload.Case]:
    return [c for c in workload.read_jsonl(WORKLOAD) if c.kind in report.JEVBENCH_KINDS]


def _timed(cases, arm: str, seconds: float) -> list[harness.Sample]:
    return [harness.Sample(arm, c.name, b, seconds, "OK") for c in cases for b in (0, 1)]


def _row(lines: list[str], target: str) -> str:
    return next(line for line in lines if line.startswith(f"| {target} |"))


# every latency 1.55x its floor of 27 ms: 41.85 ms, over the noul target's 40 ms by 4.6%
FLOOR, LATENCY = 0.027, 1.55 * 0.027


def test_each_target_is_missed_just_over_its_limit():
    cases = _split_cases()
    floors = {c.name: FLOOR for c in cases}
    samples = _timed(cases, "ours-auto", LATENCY) + _timed(cases, "transformers", 11.5 * LATENCY)
    lines = report.targets(harness.Results(samples), cases, "ours-auto", floors)
    assert _row(lines, "p50 <= 1.3x floor p50").endswith("= 1.55x | missed: 19% over the limit |")
    assert _row(lines, "choice 1-128 mean <= 1.4x its floor").endswith("= 1.55x | missed: 11% over the limit |")
    assert _row(lines, "noul mean <= 40 ms") == "| noul mean <= 40 ms | 41.9 ms | missed: 5% over the limit |"
    assert _row(lines, "mean <= 1.5x roofline floor").endswith("= 1.55x | missed: 3% over the limit |")
    speed = "| >= 12x faster than transformers (ratio of means, same cases and blocks) |"
    assert f"{speed} 11.5x over {2 * len(cases)} paired requests | missed: 4% under the target |" in lines


def test_the_split_estimate_misses_each_target_just_over_its_limit():
    """The same latencies from one request per group: the estimate's own rows give the verdicts."""
    whole = _split_cases()
    groups: dict[str, list[str]] = {}
    for c in whole:
        groups.setdefault(report.group_of(c), []).append(c.name)
    floors = {c.name: FLOOR for c in whole}
    cases = prepare.stratified(whole, 1)
    lines = report.targets(
        harness.Results(_timed(cases, "ours-auto", LATENCY)), cases, "ours-auto", floors, split=Split(groups, floors)
    )
    estimate = lines[lines.index(next(x for x in lines if x.startswith("Estimated for the whole split"))) :]
    assert _row(estimate, "p50 <= 1.3x floor p50").endswith("= 1.55x | missed: 19% over the limit |")
    assert _row(estimate, "choice 1-128 mean <= 1.4x its floor").endswith("= 1.55x | missed: 11% over the limit |")
    assert _row(estimate, "mean <= 1.5x floor").endswith("= 1.55x | missed: 3% over the limit |")
    noul = "| noul mean <= 40 ms | 41.9 ms (its floor 27.0 ms: 1.55x) | missed: 5% over the limit |"
    assert _row(estimate, "noul mean <= 40 ms") == noul


def test_the_speedup_is_a_ratio_of_means_not_a_mean_of_ratios():
    """transformers 1 s and 0.1 s against 0.1 s and 1 ms: 1.1 / 0.101 = 10.9x (the mean of the
    per-request ratios, 55x, would let one tiny request carry the target)."""
    a, b = [c for c in _split_cases() if c.kind == "choice"][:2]
    samples = [
        harness.Sample("transformers", a.name, 0, 1.0, "OK"),
        harness.Sample("transformers", b.name, 0, 0.1, "OK"),
        harness.Sample("ours-auto", a.name, 0, 0.1, "OK"),
        harness.Sample("ours-auto", b.name, 0, 0.001, "OK"),
    ]
    lines = report.targets(harness.Results(samples), [a, b], "ours-auto", None)
    assert any(x.endswith("| 10.9x over 2 paired requests | missed: 9% under the target |") for x in lines), lines


def test_the_fp32_comparison_is_relative_to_the_fp32_score():
    # ours 20 against fp32 10: 10 off, relative to max(1, 10), not to ours' 20
    assert gates.max_rel_head([[20.0, 0.5]], [[10.0, 0.25]]) == pytest.approx(1.0)
    assert gates.max_rel_head([[0.5]], [[0.25]]) == pytest.approx(0.25)  # below 1: absolute
    assert gates.max_rel_head([], []) == 0.0


# --- the mixed run's split gate, through the real engine with a fault injected ------------------

SHORT = "16k,513-2048,2049-4096,4q,8q,17-candidates,33-candidates,mixed,score-10"


def _run_gates(tmp_path: Path, demo_model: Path, *extra: str) -> tuple[int, str]:
    out = tmp_path / "gates.md"
    argv = ["--model", str(demo_model), "--workload", str(WORKLOAD), "--backend", "torch", "--skip", SHORT]
    argv += ["--chunk-tokens", "128", "--max-launch-tokens", "512", "--out", str(out), *extra]
    return gates.run_gates(argv), out.read_text()


def test_long_requests_that_never_ran_split_while_sharing_fail_the_gate(tmp_path, demo_model, monkeypatch):
    """Every answer made to say it ran in one pass: requests shared passes and some computed more
    than a chunk, but none ran spread over passes it shared, so the split case went untested."""
    execute = Engine.execute

    def whole(self, *args, **kwargs):
        return dataclasses.replace(execute(self, *args, **kwargs), num_launches=1)

    monkeypatch.setattr(Engine, "execute", whole)
    rc, text = _run_gates(tmp_path, demo_model, "--limit", "6", "--oracle-cases", "0", "--policies", "fixed")
    assert rc == 1, text
    assert "none ran over more than one pass while sharing one" in text
    assert "no request shared a pass" not in text  # the sharing itself was there


# --- the report's tables and the sections beyond concurrency 1 ----------------------------------


def test_overall_row_gives_mean_p50_p95_and_the_share_of_tokens_computed():
    """Latencies 1..5 ms: mean 3.0, p50 3.0, p95 4.8 (rank 3.8); 25 of each 100 tokens saved."""
    case = _split_cases()[0]
    samples = [harness.Sample("ours-auto", case.name, b, 0.001 * (b + 1), "OK", 100, 25) for b in range(5)]
    text = report.render(
        harness.Results(samples),
        [case],
        ["ours-auto"],
        reference_arm="ours-auto",
        floors=None,
        tokens={case.name: (100, 75)},
        header="# t",
    )
    assert "| ours-auto | 5 | 0 | 3.0 | 3.0 | 4.8 | 0.750 | - | - |" in text


def test_targets_count_the_arms_answered_timed_requests_against_their_own_floors():
    """The arm answered only the 10 ms-floor case (none of the 100 ms one): its p50 is over that
    floor, not over the median of every case's; its warm-up's 9 s is reported apart."""
    a, b = [c for c in _split_cases() if c.kind == "choice" and c.group == "1-128"][:2]
    samples = [harness.Sample("ours-auto", a.name, block, 0.012, "OK") for block in (0, 1)]
    samples.append(harness.Sample("ours-auto", a.name, -1, 9.0, "OK"))
    lines = report.targets(harness.Results(samples), [a, b], "ours-auto", {a.name: 0.010, b.name: 0.100})
    assert _row(lines, "p50 <= 1.3x floor p50") == "| p50 <= 1.3x floor p50 | 12.0 ms / 10.0 ms = 1.20x | met |"
    assert _row(lines, "mean <= 1.5x roofline floor").endswith("| 12.0 ms / 10.0 ms = 1.20x | met |")


def test_the_matmul_rate_target_is_read_at_16_clients_only():
    rows = []
    for clients, tokens in ((16, 3_000_000), (32, 1_000_000)):  # 60% at 16, 20% at 32
        row = {"arm": "ours-auto", "set": "split", "clients": clients}
        rows.append(row | load.summary([0.010, 0.020, 0.030], 10.0, 0) | {"tree_tokens": tokens})
    _, targets = report_load.sweep(rows, 10**9, 1e15)
    assert [t[1:] for t in targets] == [("60.0% (600.0 TFLOP/s, 0.30 req/s)", "met")]


def test_first_seen_is_a_ratio_of_means():
    """First sight 30 ms; its replays 10 and 30 ms, mean 20: 1.50x."""
    samples = [harness.Sample("ours-auto", "a", b, s, "OK") for b, s in ((-1, 0.030), (0, 0.010), (1, 0.030))]
    _, [target] = report_load.first_seen(samples, seed=0)
    assert target[1:] == ("30.0 ms / 20.0 ms = 1.50x", "missed: 30% over the limit")


def test_batch_invariance_compares_every_head_score_of_a_request(demo_model):
    """The reference answer of the first request made one ulp off in its last question's last
    candidate only: the mixed run must count that request as differing, and no other."""
    meta, candidates_of, _ = prepare.longest_tokens_fn(demo_model)
    cases = [c for c in _split_cases() if c.kind == "choice" and c.group == "1-128"][:2]
    limits = PackLimits(max_tokens=512, chunk_tokens=128)
    engine = Engine(TorchRunner(demo_model), pack_limits=limits, cost_model=default_cost_model("torch"))
    works = []
    for case in cases:
        questions = zip(case.request["questions"].values(), candidates_of(case.request), strict=True)
        works.append([QuestionWork(q["type"], tuple(tuple(t) for t in ids)) for q, ids in questions])
    alone = {(i, "off"): engine.execute(w, temperature=meta.temperature, policy="off") for i, w in enumerate(works)}
    first = alone[0, "off"]
    heads = [list(row) for row in first.head_scores]
    assert len(heads[-1]) > 1  # the changed score is not the request's first
    heads[-1][-1] = float(np.nextafter(np.float32(heads[-1][-1]), np.float32(np.inf)))
    alone[0, "off"] = dataclasses.replace(first, head_scores=heads)
    out = gates.batch_invariance(
        engine, cases, works, alone, meta.temperature, clients=1, seed=0, policies=("off",), chunk_tokens=128
    )
    assert out["requests"] == 2 and out["mismatches"] == 1 and out["max_dhead"] > 0
    assert sorted(line.endswith("| no |") for line in out["log"]) == [False, True]
    assert any(line.startswith(f"| {cases[0].name} |") and line.endswith("| no |") for line in out["log"])


def test_the_transformers_comparison_sees_a_difference_in_the_oracles_scores(tmp_path, demo_model, monkeypatch):
    """transformers' head scores all one higher (a fault injected there): the reported relative
    difference of `off` from it is that difference, not zero (as `off` against itself would be)."""
    from openjev.tools.bench.transformers_arm import TransformersRunner
    from openjev.worker.runner_api import SegmentResult

    run_launch = TransformersRunner.run_launch

    def shifted(self, runs):
        return [
            SegmentResult(r.state, None if r.head_score is None else r.head_score + 1.0) for r in run_launch(self, runs)
        ]

    monkeypatch.setattr(TransformersRunner, "run_launch", shifted)
    rc, text = _run_gates(tmp_path, demo_model, "--limit", "2", "--oracle-cases", "2", "--policies", "fixed")
    assert rc == 0, text  # reported, not gated
    marker = "max head-score difference (relative to max(1, |s|)) "
    relative = float(text.split(marker)[1].split(",")[0])
    assert 0.1 < relative <= 1.0, text


def test_gates_report_puts_each_measure_in_its_column():
    """Head bits and probability bits differ here (2 and 0), as do the oracle's absolute and
    relative head differences (5.0 and 0.5): each must land under its own heading."""
    args = SimpleNamespace(
        backend="torch",
        exact=True,
        tolerance=1e-3,
        synthetic=None,
        model="m",
        seed=0,
        max_launch_tokens=512,
        chunk_tokens=128,
        shared_launch_tokens=None,
        skip="",
        kinds="",
        oracle_cases=1,
        mixed_clients=1,
    )
    covered = Counter(requests=1, head=4, prob=2, noul=1)
    rows = {"fixed": gates.Diff(head_bits=2, max_dhead=0.5, covered=covered)}
    oracle = gates.Diff(max_dhead=5.0, max_rel_dhead=0.5, covered=Counter(covered))
    mixed = {
        "jobs": [],
        "dropped": [],
        "log": [],
        **dict.fromkeys(("requests", "shared", "long", "split_shared", "more_passes", "fewer_passes"), 0),
        **dict.fromkeys(("mismatches", "failures", "max_dhead"), 0),
    }
    text = gates_report.render(args, [], object(), [], [], None, 0, rows, oracle, {}, False, mixed, [])
    header = next(line for line in text.splitlines() if line.startswith("| policy vs off |"))
    assert header.split(" | ")[1:4] == [
        "head scores differing (any bit)",
        "max abs d head",
        "probabilities differing (any bit)",
    ]
    assert "| fixed | 2 | 5.00e-01 | 0 | 0.00e+00 | n/a | n/a | 0 | 0 | 0 |" in text
    assert "max head-score difference (relative to max(1, |s|)) 5.00e-01," in text


def test_a_choice_change_is_decisive_beyond_twice_the_dp_gate():
    """Top two 0.01 apart in `off` (over 2e-3): a real disagreement; 2e-4 apart: a tie decided by rounding."""
    diff = gates.Diff()
    diff.add(["choice"], _answer([[0.0]], [[0.505, 0.495]]), _answer([[0.0]], [[0.495, 0.505]]))
    diff.add(["choice"], _answer([[0.0]], [[0.5001, 0.4999]]), _answer([[0.0]], [[0.4999, 0.5001]]))
    assert diff.cell("choice_changes") == "2 (1)"

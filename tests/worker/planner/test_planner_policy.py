"""Policies: the executed tree and exactly what it saved, on request shapes that matter."""

import collections
import dataclasses
import itertools
import random

import pytest

from openjev.worker.planner import (
    CPU_COST_MODEL,
    GPU_COST_MODEL,
    CostModel,
    PackLimits,
    Reader,
    default_cost_model,
    plan_request,
)
from openjev.worker.planner.cost import off_seconds_at_least

_fresh = itertools.count(1000)


def fresh(n):
    """n token ids no other call returns (so unrelated parts never share by accident)."""
    return [next(_fresh) for _ in range(n)]


def contract_like():
    """Shaped like the contract example's real token ids: a 35-token shared context, then
    choice (3 candidates, 47-token common prefix), noul (1, 66 tokens), score (3, 49)."""
    context = fresh(35)
    choice_stem, score_stem = context + fresh(12), context + fresh(14)
    return [
        [choice_stem + fresh(n) for n in (33, 29, 30)],
        [context + fresh(31)],
        [score_stem + fresh(n) for n in (33, 31, 29)],
    ]


def check_invariants(plan, candidates):
    assert plan.num_submitted_tokens == sum(len(t) for q in candidates for t in q)
    assert plan.num_computed_tokens == sum(s.num_tokens for s in plan.segments)
    assert plan.num_saved_tokens == plan.num_submitted_tokens - plan.num_computed_tokens
    assert plan.enabled == (plan.num_saved_tokens > 0)
    # Every candidate's prompt is exactly the tokens on its reader's path.
    for s in plan.segments:
        for r in s.readers:
            path, node = [], s
            while node is not None:
                path = list(node.token_ids) + path
                node = None if node.parent is None else plan.segments[node.parent]
            assert path == list(candidates[r.question][r.candidate])
    assert sorted(r for s in plan.segments for r in s.readers) == sorted(
        Reader(q, c) for q, question in enumerate(candidates) for c in range(len(question))
    )


@pytest.mark.parametrize(
    "policy, saved, scope",
    [
        ("off", 0, "none"),
        ("default", 2 * 47 + 2 * 49, "within_question"),
        ("shared", 6 * 35 + 2 * 12 + 2 * 14, "across_questions"),
        ("fixed", 0, "none"),  # every boundary (35, 47, 49) cuts down to 0
    ],
)
def test_contract_example(policy, saved, scope):
    candidates = contract_like()
    plan = plan_request(candidates, policy)
    check_invariants(plan, candidates)
    assert (plan.num_saved_tokens, plan.scope, plan.executed_policy) == (saved, scope, policy)
    assert plan.num_submitted_tokens == 80 + 76 + 77 + 66 + 82 + 80 + 78


def test_three_candidates_sharing_3072_tokens_save_6144():
    state = fresh(3072)
    candidates = [[state + fresh(20), state + fresh(25), state + fresh(30)]]
    for policy in ("default", "shared", "fixed"):  # 3072 = 48 * 64: fixed keeps it all
        plan = plan_request(candidates, policy)
        check_invariants(plan, candidates)
        assert plan.num_saved_tokens == 6144, policy
        assert plan.scope == "within_question"
    assert plan_request(candidates, "off").num_saved_tokens == 0


def test_only_two_of_three_can_share_saves_3072():
    state = fresh(3072)
    candidates = [[state + fresh(20), state + fresh(25), fresh(3100)]]
    for policy in ("shared", "fixed"):
        assert plan_request(candidates, policy).num_saved_tokens == 3072
    # default shares the common prefix of all three, which is empty.
    assert plan_request(candidates, "default").num_saved_tokens == 0


def test_shared_context_across_questions():
    state = fresh(500)
    candidates = [[state + fresh(10), state + fresh(12)], [state + fresh(9)], [state + fresh(11)]]
    shared = plan_request(candidates, "shared")
    check_invariants(shared, candidates)
    assert shared.num_saved_tokens == 3 * 500
    assert shared.scope == "across_questions"
    default = plan_request(candidates, "default")
    assert (default.num_saved_tokens, default.scope) == (500, "within_question")
    fixed = plan_request(candidates, "fixed")
    check_invariants(fixed, candidates)
    assert (fixed.num_saved_tokens, fixed.scope) == (3 * 448, "across_questions")


def test_identical_candidates():
    prompt = fresh(100)
    candidates = [[prompt, list(prompt), list(prompt)]]
    off = plan_request(candidates, "off")
    assert (off.num_computed_tokens, off.num_saved_tokens) == (300, 0)  # run three times
    for policy in ("default", "shared", "fixed"):
        plan = plan_request(candidates, policy)
        check_invariants(plan, candidates)
        assert (len(plan.segments), plan.num_saved_tokens) == (1, 200), policy
        assert len(plan.segments[0].readers) == 3


def test_candidate_that_is_a_prefix_of_another():
    long = fresh(200)
    candidates = [[long[:130], long]]
    shared = plan_request(candidates, "shared")
    check_invariants(shared, candidates)
    assert [(s.parent, s.start_position, s.num_tokens, s.readers) for s in shared.segments] == [
        (None, 0, 130, (Reader(0, 0),)),
        (0, 130, 70, (Reader(0, 1),)),
    ]
    assert shared.num_saved_tokens == 130
    fixed = plan_request(candidates, "fixed")
    check_invariants(fixed, candidates)
    assert fixed.num_saved_tokens == 128  # the reader at 130 cannot split a 64-token chunk


def test_empty_tails_read_the_parent():
    stem = fresh(40)
    candidates = [[stem, stem + fresh(5)], [stem]]
    plan = plan_request(candidates, "shared")
    check_invariants(plan, candidates)
    root = plan.segments[0]
    assert root.readers == (Reader(0, 0), Reader(1, 0)) and root.keep_state
    assert all(s.num_tokens > 0 for s in plan.segments)
    assert plan.num_saved_tokens == 2 * 40


def test_33_candidates():
    state = fresh(300)
    candidates = [[state + fresh(8 + c % 5) for c in range(33)]]
    plan = plan_request(candidates, "shared")
    check_invariants(plan, candidates)
    assert plan.num_saved_tokens == 32 * 300
    assert len(plan.launches) == 1  # the root and its 33 tails: 34 segments fit one pass
    off = plan_request(candidates, "off")
    assert (off.num_saved_tokens, len(off.launches)) == (0, 3)  # 13 prompts of ~310 tokens a pass


def test_16384_token_candidates_run_in_2048_token_chunks():
    state = fresh(16_000)
    candidates = [[state + fresh(384), state + fresh(384)]]
    off = plan_request(candidates, "off")
    check_invariants(off, candidates)
    assert [s.num_tokens for s in off.segments] == [2048] * 16
    # A pass holds 4,096 tokens: two chunks of a chain, the second continuing the first in-pass.
    assert len(off.launches) == 8 and off.num_saved_tokens == 0
    shared = plan_request(candidates, "shared")
    check_invariants(shared, candidates)
    # The shared 16,000 tokens become a chain of 7 x 2048 + 1664; each piece saves once.
    assert [s.num_tokens for s in shared.segments] == [2048] * 7 + [1664, 384, 384]
    assert [s.parent for s in shared.segments] == [None, 0, 1, 2, 3, 4, 5, 6, 7, 7]
    assert shared.num_saved_tokens == 16_000
    # two chunks a pass; the last chunk and one tail fill the fourth exactly, the other tail waits
    assert shared.launches == ((0, 1), (2, 3), (4, 5), (6, 7, 8), (9,))
    assert shared.num_submitted_tokens == 2 * 16_384


def test_fixed_boundaries_are_64_aligned():
    state = fresh(3000)
    candidates = [[state + fresh(40 + c) for c in range(5)], [state[:2000] + fresh(77)]]
    plan = plan_request(candidates, "fixed")
    check_invariants(plan, candidates)
    for s in plan.segments:
        if s.keep_state:
            assert s.end_position % 64 == 0
        assert s.start_position % 64 == 0
    # 3000 -> 2944 for the five, 2000 -> 1984 for the sixth.
    assert plan.num_saved_tokens == 5 * 1984 + 4 * (2944 - 1984)


def test_auto_picks_shared_when_cheaper_than_off_else_default():
    state = fresh(2000)
    long_shared = [[state + fresh(20) for _ in range(3)]]
    plan = plan_request(long_shared, "auto", cost_model=CPU_COST_MODEL)
    assert (plan.policy, plan.executed_policy, plan.num_saved_tokens) == ("auto", "shared", 4000)
    # Launches so expensive that one extra pass never pays: default, not shared.
    costly_launch = CostModel(seconds_per_launch=1.0, seconds_per_token=0.0, seconds_per_attention_pair=0.0)
    plan = plan_request(contract_like(), "auto", cost_model=costly_launch)
    assert (plan.policy, plan.executed_policy, plan.scope) == ("auto", "default", "within_question")
    # Tokens only: sharing across questions wins.
    tokens_only = CostModel(seconds_per_launch=0.0, seconds_per_token=1.0, seconds_per_attention_pair=0.0)
    plan = plan_request(contract_like(), "auto", cost_model=tokens_only)
    assert (plan.executed_policy, plan.scope) == ("shared", "across_questions")
    # The 27B GPU model: 3 launches x 12 ms vs 262 fewer tokens x 0.14 ms -> shared.
    assert plan_request(contract_like(), "auto", cost_model=GPU_COST_MODEL).executed_policy == "shared"
    with pytest.raises(ValueError):
        plan_request(long_shared, "auto")


@pytest.mark.parametrize("num_tokens", [1, 70, 2048, 5000])
@pytest.mark.parametrize("cost_model", [CPU_COST_MODEL, GPU_COST_MODEL], ids=["cpu", "gpu"])
def test_auto_with_one_prompt_is_what_comparing_the_trees_gives(num_tokens, cost_model):
    """auto plans one prompt without building the shared and off trees: they tie, so the
    comparison would pick default, and the plan must be that one exactly."""
    candidates = [[fresh(num_tokens)]]
    limits = PackLimits(chunk_tokens=2048)
    shared, off = (plan_request(candidates, p, limits) for p in ("shared", "off"))
    assert cost_model.estimated_seconds(shared) == cost_model.estimated_seconds(off)
    expected = dataclasses.replace(plan_request(candidates, "default", limits), policy="auto")
    assert plan_request(candidates, "auto", limits, cost_model) == expected


def test_auto_skips_planning_off_only_where_its_cost_bound_already_loses():
    """auto plans `off` only when a bound of its cost (off_seconds_at_least) does not lose to
    shared: the bound never exceeds off's estimate, and auto's plan is exactly what comparing
    the two planned trees gives, over random requests, pass budgets, pass depths and cost models."""
    rng = random.Random(7)
    models = [
        CPU_COST_MODEL,
        GPU_COST_MODEL,
        CostModel(seconds_per_launch=1.0, seconds_per_token=1e-4, seconds_per_attention_pair=0.0),
        CostModel(seconds_per_launch=1e-3, seconds_per_token=1e-3, seconds_per_attention_pair=1e-7),
    ]
    seen = collections.Counter()
    for _ in range(300):
        state = fresh(rng.choice([0, 5, 60, 700]))
        candidates = [
            [state + fresh(rng.randint(0, 40)) + fresh(rng.randint(1, 90)) for _ in range(rng.randint(1, 12))]
            for _ in range(rng.randint(1, 3))
        ]
        chunk = rng.choice([16, 64, 2048])
        limits = PackLimits(
            max_sequences=rng.choice([2, 8, 64]), max_tokens=rng.choice([chunk, 4096]), chunk_tokens=chunk
        )
        model, depth = rng.choice(models), rng.choice([1, 2, 8, 1 << 16])
        shared, off = (
            model.estimated_seconds(plan_request(candidates, p, limits, None, depth)) for p in ("shared", "off")
        )
        bound = off_seconds_at_least(model, [len(t) for q in candidates for t in q], limits)
        assert bound <= off
        expected = "shared" if shared < off else "default"
        plan = plan_request(candidates, "auto", limits, model, depth)
        assert plan == dataclasses.replace(plan_request(candidates, expected, limits, None, depth), policy="auto")
        if sum(map(len, candidates)) > 1:
            seen[expected, "bound decides" if shared < bound else "off planned"] += 1
    # every way through: shared by the bound alone, shared or default after planning off
    assert {("shared", "bound decides"), ("shared", "off planned"), ("default", "off planned")} <= set(seen), seen


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_cost_models_with_a_negative_or_non_finite_term_are_refused(bad):
    """auto's shortcut past planning off assumes no term lowers a cost."""
    with pytest.raises(ValueError, match="seconds_per_token must be a finite number >= 0"):
        CostModel(seconds_per_launch=1e-3, seconds_per_token=bad, seconds_per_attention_pair=0.0)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        plan_request([[[1, 2]]], "sometimes")
    with pytest.raises(ValueError):
        plan_request([[[1, 2], []]], "off")
    with pytest.raises(ValueError):
        plan_request([], "off")
    with pytest.raises(ValueError):
        PackLimits(max_sequences=0)


def test_default_shares_a_common_prefix_of_one_token():
    """Any nonempty common prefix is shared, one token included."""
    plan = plan_request([[[7, 1, 2], [7, 3, 4]]], "default")
    assert [(s.parent, list(s.token_ids)) for s in plan.segments] == [(None, [7]), (0, [1, 2]), (0, [3, 4])]
    assert (plan.num_saved_tokens, plan.scope) == (1, "within_question")


def test_scope_is_across_questions_wherever_in_the_tree_questions_share():
    """Question 0 shares nothing and its prompt sorts first in the trie; questions 1 and 2 share
    [5, 6, 7] further on: the request's scope is still across_questions."""
    plan = plan_request([[[1, 2]], [[5, 6, 7, 1]], [[5, 6, 7, 2]]], "shared")
    assert list(plan.segments[0].token_ids) == [1, 2]  # the shared node is not segment 0
    assert (plan.num_saved_tokens, plan.scope) == (3, "across_questions")


def test_a_question_without_candidates_is_refused():
    with pytest.raises(ValueError, match="at least one question with one candidate"):
        plan_request([[[1, 2]], []], "shared")


def test_the_default_cost_model_of_cuda_is_the_gpu_one():
    assert default_cost_model("cuda") is GPU_COST_MODEL and GPU_COST_MODEL != CPU_COST_MODEL
    assert default_cost_model("torch") is CPU_COST_MODEL
    with pytest.raises(ValueError, match="no default cost model"):
        default_cost_model("tpu")

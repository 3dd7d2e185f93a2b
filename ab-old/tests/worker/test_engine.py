"""The engine: plan -> launches on a runner -> scores and probabilities.

Bookkeeping (state lifetime, cancellation, failures) is checked on a recording runner that wraps
the real TorchRunner on the demo export; correctness of the policies on real model math too.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest

from openjev.contract.answers import question_probabilities
from openjev.contract.literals import PREFIX_POLICIES
from openjev.worker.engine import Cancelled, Engine, ExecutionResult, InferenceError, QuestionWork
from openjev.worker.planner import CPU_COST_MODEL, PackLimits, plan_request
from openjev.worker.runner_api import SegmentResult

TEMPERATURE = 2.5


@pytest.fixture(scope="module")
def torch_runner(tmp_path_factory):
    """The demo export's weights without the tokenizer: the engine never tokenizes."""
    from openjev.tools.demo_model import build_demo_model
    from openjev.worker.model.runner import TorchRunner

    export = build_demo_model(tmp_path_factory.mktemp("engine") / "demo", seed=0, with_tokenizer=False)
    (export / "tokenizer.json").write_text("{}\n")  # the export check wants the file to exist
    return TorchRunner(export, num_threads=2)


class Box:
    """A weakref-able stand-in for the runner's state, so the test can see when it is freed."""

    def __init__(self, inner):
        self.inner = inner


class RecordingRunner:
    """Delegates to a real runner; records launches and which returned states are still alive."""

    backend = "torch"

    def __init__(
        self, inner, *, fail_on_launch: int | None = None, corrupt_score: float | None = None, max_pass_depth: int = 1
    ):
        self.inner = inner
        self.max_pass_depth = max_pass_depth
        self.launches: list[list] = []
        self.alive = weakref.WeakSet()
        self.alive_before_launch: list[int] = []
        self.fail_on_launch = fail_on_launch
        self.corrupt_score = corrupt_score

    def run_launch(self, runs):
        gc.collect()
        self.alive_before_launch.append(len(self.alive))
        if self.fail_on_launch == len(self.launches):
            raise RuntimeError("device fell over")
        self.launches.append([len(run.token_ids) for run in runs])  # not the runs: they hold states
        unboxed = [
            type(run)(
                run.token_ids,
                run.start_position,
                None if run.parent_state is None else run.parent_state.inner,
                run.keep_state,
                run.read_head,
                run.parent_in_pass,
            )
            for run in runs
        ]
        results = []
        for result in self.inner.run_launch(unboxed):
            state = None if result.state is None else Box(result.state)
            if state is not None:
                self.alive.add(state)
            score = result.head_score
            if score is not None and self.corrupt_score is not None:
                score = self.corrupt_score
            results.append(SegmentResult(state=state, head_score=score))
        return results


def shared_context_request(n_questions=3):
    """A 300-token state every question shares, questions with 3 / 1 / 3 candidates."""
    state = list(range(1000, 1300))
    kinds = ["choice", "noul", "score"] * n_questions
    questions = []
    for q, kind in enumerate(kinds[:n_questions]):
        stem = state + [2000 + q] * (5 + q)
        n = 1 if kind == "noul" else 3
        questions.append(QuestionWork(kind, tuple(tuple(stem + [3000 + 10 * q + c] * (3 + c)) for c in range(n))))
    return questions


@pytest.fixture(scope="module")
def off_result(torch_runner) -> ExecutionResult:
    """The reference every policy is compared with, run once for the module."""
    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    return engine.execute(shared_context_request(), temperature=TEMPERATURE, policy="off")


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
def test_every_policy_matches_off(torch_runner, off_result, policy):
    questions = shared_context_request()
    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    off = off_result
    got = engine.execute(questions, temperature=TEMPERATURE, policy=policy)
    plan = plan_request([q.candidates for q in questions], policy, PackLimits(), CPU_COST_MODEL)
    assert isinstance(got, ExecutionResult)
    assert (got.policy, got.executed_policy, got.scope, got.enabled) == (
        policy,
        plan.executed_policy,
        plan.scope,
        plan.enabled,
    )
    assert (got.num_saved_tokens, got.num_computed_tokens, got.num_submitted_tokens, got.num_launches) == (
        plan.num_saved_tokens,
        plan.num_computed_tokens,
        plan.num_submitted_tokens,
        plan.num_launches,
    )
    assert got.num_submitted_tokens == off.num_submitted_tokens == sum(len(c) for q in questions for c in q.candidates)
    assert [len(s) for s in got.head_scores] == [3, 1, 3]
    assert [len(p) for p in got.probabilities] == [3, 2, 3]  # noul: [p_no, p_yes]
    for a, b in zip(got.head_scores, off.head_scores, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    for scores, probabilities, question in zip(got.head_scores, got.probabilities, questions, strict=True):
        assert probabilities == question_probabilities(question.kind, scores, TEMPERATURE)
        assert math.isclose(sum(probabilities), 1.0, rel_tol=1e-12)
    assert got.inference_seconds > 0


def test_default_policy_of_the_engine_is_used(torch_runner):
    questions = shared_context_request()
    result = Engine(torch_runner, default_policy="shared").execute(questions, temperature=TEMPERATURE)
    assert (result.policy, result.scope, result.num_saved_tokens) == (
        "shared",
        "across_questions",
        2 * 300 + 2 * 305 + 2 * 307,
    )
    with pytest.raises(ValueError):
        Engine(torch_runner, default_policy="sometimes")


def test_parent_states_are_freed_once_their_children_ran(torch_runner):
    questions = shared_context_request()
    runner = RecordingRunner(torch_runner)
    # One sequence per launch: the deepest tree walk, so lifetimes are visible launch by launch.
    engine = Engine(runner, pack_limits=PackLimits(max_sequences=1, max_tokens=4096), cost_model=CPU_COST_MODEL)
    result = engine.execute(questions, temperature=TEMPERATURE, policy="shared")
    plan = plan_request([q.candidates for q in questions], "shared", PackLimits(max_sequences=1))
    assert len(runner.launches) == plan.num_launches == len(plan.segments)
    # Before each launch, the live states are exactly those with children still to run.
    for n, alive in enumerate(runner.alive_before_launch):
        ran = {i for launch in plan.launches[:n] for i in launch}
        waiting = {s.parent for s in plan.segments if s.index not in ran and s.parent in ran}
        assert alive == len(waiting), f"before launch {n}"
    assert max(runner.alive_before_launch) >= 2  # the walk did hold several states at once
    del result
    gc.collect()
    assert len(runner.alive) == 0


def test_cancel_is_checked_before_each_launch(torch_runner):
    questions = shared_context_request()
    runner = RecordingRunner(torch_runner)  # one tree level a pass: three passes

    def stop_after_two():
        return len(runner.launches) >= 2

    engine = Engine(runner, cost_model=CPU_COST_MODEL)
    with pytest.raises(Cancelled):
        engine.execute(questions, temperature=TEMPERATURE, policy="shared", should_stop=stop_after_two)
    assert len(runner.launches) == 2
    with pytest.raises(Cancelled):
        engine.execute(questions, temperature=TEMPERATURE, policy="off", should_stop=lambda: True)
    assert len(runner.launches) == 2


def test_runner_failure_is_an_inference_error(torch_runner):
    engine = Engine(RecordingRunner(torch_runner, fail_on_launch=1), cost_model=CPU_COST_MODEL)
    with pytest.raises(InferenceError, match="device fell over"):
        engine.execute(shared_context_request(), temperature=TEMPERATURE, policy="shared")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_score_is_an_inference_error(torch_runner, bad):
    engine = Engine(RecordingRunner(torch_runner, corrupt_score=bad), cost_model=CPU_COST_MODEL)
    with pytest.raises(InferenceError, match="non-finite"):
        engine.execute(shared_context_request(), temperature=TEMPERATURE, policy="default")


def test_long_prompt_runs_in_chunks_that_carry_state(torch_runner):
    # 256-token launches: each prompt is a chain of three pieces that must equal one whole pass.
    prompt = tuple((7919 * i) % 248000 for i in range(700))
    questions = [QuestionWork("choice", (prompt, prompt[:650] + (5, 6, 7)))]
    chunked = Engine(torch_runner, pack_limits=PackLimits(max_sequences=16, max_tokens=256, chunk_tokens=256))
    whole = Engine(torch_runner, pack_limits=PackLimits(max_sequences=16, max_tokens=4096))
    a = chunked.execute(questions, temperature=TEMPERATURE, policy="off")
    b = whole.execute(questions, temperature=TEMPERATURE, policy="off")
    assert a.num_launches == 6 and b.num_launches == 1
    assert max(abs(x - y) for x, y in zip(a.head_scores[0], b.head_scores[0], strict=True)) <= 1e-4

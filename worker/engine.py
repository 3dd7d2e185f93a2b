"""The execution engine: plan a request, walk the plan's launches with a runner, turn head
scores into probabilities.

The engine holds ints, token ids and opaque state handles; only the runner touches device
memory. A parent's state is dropped as soon as its last child has run, so a wide tree holds at
most one launch's worth of live states beyond what later launches still need.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from openjev.contract.answers import question_probabilities
from openjev.contract.literals import PREFIX_POLICIES, ExecutedPolicy, PrefixPolicy, PrefixScope, QuestionKind
from openjev.worker.planner.cost import CostModel, default_cost_model
from openjev.worker.planner.plan import PackLimits, Plan
from openjev.worker.planner.policy import plan_request
from openjev.worker.runner_api import ModelRunner, SegmentResult, SegmentRun


class Cancelled(Exception):
    """The caller asked to stop (client gone, deadline passed) before the request finished."""


class InferenceError(Exception):
    """The model could not produce a trustworthy score; never answered with a made-up value."""


@dataclass(frozen=True)
class QuestionWork:
    """One question: its kind ("choice" | "score" | "noul") and each candidate's token ids."""

    kind: QuestionKind
    candidates: Sequence[Sequence[int]]


@dataclass(frozen=True)
class ExecutionResult:
    """Per question, in request order: the head score of each candidate and the probabilities
    (noul: [p_no, p_yes]); plus what the plan executed and saved."""

    head_scores: list[list[float]]
    probabilities: list[list[float]]
    policy: PrefixPolicy
    executed_policy: ExecutedPolicy
    enabled: bool
    scope: PrefixScope
    num_saved_tokens: int
    num_computed_tokens: int
    num_submitted_tokens: int
    num_launches: int
    inference_seconds: float


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        pack_limits: PackLimits = PackLimits(),
        cost_model: CostModel | None = None,
        default_policy: PrefixPolicy = "auto",
    ) -> None:
        if default_policy not in PREFIX_POLICIES:
            raise ValueError(f"unknown prefix policy {default_policy!r}; expected one of {PREFIX_POLICIES}")
        self.runner = runner
        self.pack_limits = pack_limits
        self.cost_model = cost_model if cost_model is not None else default_cost_model(runner.backend)
        self.default_policy = default_policy

    def plan(self, questions: Sequence[QuestionWork], policy: PrefixPolicy | None = None) -> Plan:
        return plan_request(
            [q.candidates for q in questions],
            policy or self.default_policy,
            self.pack_limits,
            self.cost_model,
        )

    def execute(
        self,
        questions: Sequence[QuestionWork],
        *,
        temperature: float,
        policy: PrefixPolicy | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> ExecutionResult:
        """Run every candidate of every question; raises Cancelled or InferenceError."""
        started = time.perf_counter()
        plan = self.plan(questions, policy)
        head_scores = self._run(plan, should_stop)
        probabilities = []
        for q, (question, scores) in enumerate(zip(questions, head_scores, strict=True)):
            try:
                probabilities.append(question_probabilities(question.kind, scores, temperature))
            except ValueError as error:
                raise InferenceError(f"question {q}: {error}") from error
        return ExecutionResult(
            head_scores=head_scores,
            probabilities=probabilities,
            policy=plan.policy,
            executed_policy=plan.executed_policy,
            enabled=plan.enabled,
            scope=plan.scope,
            num_saved_tokens=plan.num_saved_tokens,
            num_computed_tokens=plan.num_computed_tokens,
            num_submitted_tokens=plan.num_submitted_tokens,
            num_launches=plan.num_launches,
            inference_seconds=time.perf_counter() - started,
        )

    def _run(self, plan: Plan, should_stop: Callable[[], bool]) -> list[list[float]]:
        try:
            return self._walk(plan, should_stop)
        except BaseException as error:
            # A cancelled or failed request frees its states now: the exception's traceback
            # (kept by whoever handles it) would otherwise keep the walk's locals alive.
            seen: set[int] = set()
            link: BaseException | None = error
            while link is not None and id(link) not in seen:
                seen.add(id(link))
                traceback.clear_frames(link.__traceback__)
                link = link.__cause__ or link.__context__
            raise

    def _walk(self, plan: Plan, should_stop: Callable[[], bool]) -> list[list[float]]:
        segments = plan.segments
        scores: list[list[float | None]] = [[None] * n for n in plan.num_candidates_per_question]
        children_left = [0] * len(segments)
        for s in segments:
            if s.parent is not None:
                children_left[s.parent] += 1
        states: dict[int, Any] = {}

        for launch in plan.launches:
            if should_stop():
                raise Cancelled("request cancelled before it finished")
            runs = [
                SegmentRun(
                    token_ids=segments[i].token_ids,
                    start_position=segments[i].start_position,
                    parent_state=None if (parent := segments[i].parent) is None else states[parent],
                    keep_state=segments[i].keep_state,
                    read_head=bool(segments[i].readers),
                )
                for i in launch
            ]
            try:
                results = self.runner.run_launch(runs)
            except Exception as error:  # any backend failure is an inference failure
                raise InferenceError(f"runner failed: {error!r}") from error
            if len(results) != len(runs):
                raise InferenceError(f"runner returned {len(results)} results for {len(runs)} runs")

            for i, result in zip(launch, results, strict=True):
                segment = segments[i]
                if segment.keep_state:
                    if result.state is None:
                        raise InferenceError(f"runner returned no state for segment {i}")
                    states[i] = result.state
                if segment.readers:
                    score = _checked_score(result, i)
                    for reader in segment.readers:
                        scores[reader.question][reader.candidate] = score
            for i in launch:
                parent = segments[i].parent
                if parent is not None:
                    children_left[parent] -= 1
                    if children_left[parent] == 0:
                        del states[parent]
        missing = [(q, c) for q, row in enumerate(scores) for c, s in enumerate(row) if s is None]
        if missing:  # a planner bug, but never answer with a made-up score
            raise InferenceError(f"no head score for (question, candidate) {missing[:5]}")
        return scores  # type: ignore[return-value]


def _checked_score(result: SegmentResult, index: int) -> float:
    score = result.head_score
    if score is None:
        raise InferenceError(f"runner returned no head score for segment {index}")
    score = float(score)
    if not math.isfinite(score):
        raise InferenceError(f"non-finite head score {score} for segment {index}")
    return score

"""The execution engine: plan a request, run it through the scheduler's forest passes (mixed with
whatever else is admitted), turn head scores into probabilities.

The engine holds ints and token ids; only the runner (driven by the scheduler's one thread)
touches device memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from openjev.contract.answers import question_probabilities
from openjev.contract.literals import PREFIX_POLICIES, ExecutedPolicy, PrefixPolicy, PrefixScope, QuestionKind
from openjev.worker.cache.store import StateCache
from openjev.worker.planner.cost import CostModel, default_cost_model
from openjev.worker.planner.plan import PackLimits, Plan
from openjev.worker.planner.policy import plan_request
from openjev.worker.runner_api import ModelRunner
from openjev.worker.scheduler import Cancelled, InferenceError, PassObserver, QueueFull, Scheduler

__all__ = ["Cancelled", "Engine", "ExecutionResult", "InferenceError", "QueueFull", "QuestionWork"]


@dataclass(frozen=True)
class QuestionWork:
    """One question: its kind ("choice" | "score" | "noul") and each candidate's token ids."""

    kind: QuestionKind
    candidates: Sequence[Sequence[int]]


@dataclass(frozen=True)
class ExecutionResult:
    """Per question, in request order: the head score of each candidate and the probabilities
    (noul: [p_no, p_yes]); plus what the plan executed and saved, and how it was scheduled
    (num_launches: the passes it ran in; queue_seconds: before its first pass; inference_seconds:
    the rest of the call, its planning included; cache_hit_tokens: tokens whose states came from
    the worker's state cache, not part of the plan's accounting)."""

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
    num_shared_passes: int
    queue_seconds: float
    inference_seconds: float
    cache_hit_tokens: int = 0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        pack_limits: PackLimits = PackLimits(),
        cost_model: CostModel | None = None,
        default_policy: PrefixPolicy = "auto",
        queue_capacity: int = 64,
        on_pass: PassObserver | None = None,
        state_cache: StateCache | None = None,
        on_device_lost: Callable[[str], None] | None = None,
    ) -> None:
        if default_policy not in PREFIX_POLICIES:
            raise ValueError(f"unknown prefix policy {default_policy!r}; expected one of {PREFIX_POLICIES}")
        self.runner = runner
        self.pack_limits = pack_limits
        self.cost_model = cost_model if cost_model is not None else default_cost_model(runner.backend)
        self.default_policy = default_policy
        self.state_cache = state_cache
        self.scheduler = Scheduler(
            runner, pack_limits, queue_capacity, on_pass=on_pass, cache=state_cache, on_device_lost=on_device_lost
        )

    def plan(self, questions: Sequence[QuestionWork], policy: PrefixPolicy | None = None) -> Plan:
        return plan_request(
            [q.candidates for q in questions],
            policy or self.default_policy,
            self.pack_limits,
            self.cost_model,
            self.scheduler.max_depth,
        )

    def execute(
        self,
        questions: Sequence[QuestionWork],
        *,
        temperature: float,
        policy: PrefixPolicy | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        on_start: Callable[[], None] = lambda: None,
    ) -> ExecutionResult:
        """Run every candidate of every question; raises QueueFull, Cancelled or InferenceError.
        Safe to call from many threads at once: their requests share passes. on_start: called
        when the request's first pass begins (a notice: one that raises is logged, fails nothing)."""
        started = time.perf_counter()
        # refused before planning, not after it (seconds for thousands of candidates, holding the
        # GIL the passes of admitted requests need)
        self.scheduler.check_room()
        if should_stop():
            raise Cancelled("client went away before its request was planned")
        plan = self.plan(questions, policy)
        head_scores, stats = self.scheduler.run(plan, is_active=lambda: not should_stop(), on_start=on_start)
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
            num_launches=stats.num_passes,
            num_shared_passes=stats.num_shared_passes,
            queue_seconds=stats.queue_seconds,
            inference_seconds=time.perf_counter() - started - stats.queue_seconds,
            cache_hit_tokens=stats.cache_hit_tokens,
        )

    def close(self) -> None:
        self.scheduler.close()

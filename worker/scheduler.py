"""The worker's continuous-batching scheduler: every pass mixes the token trees of all admitted
requests, at any depth, up to the pass budget.

One thread owns the runner (one device, one stream) and loops schedule -> execute -> update:
`fill_pass` picks segments in arrival order, the runner executes them as one forward pass, and
the results land in their requests (head scores, states kept for later passes). A parent's
state is dropped as soon as its last child has run. Admission is bounded: a request that would
make more than `capacity` requests wait for their first pass (0: none may wait while the worker
is busy), or more than `max_admitted` be held in all, is refused at once (QueueFull).
Cancellation and deadlines act between passes and free the request's states then.

A request's answer does not depend on what shares its passes: its segments are fixed by its
plan, and the runners compute each segment from its own rows and its parent's state only.

With a state cache (openjev.worker.cache), a request's segments are cut where states are
deposited or found (cuts the runner computes exactly), the pieces a hit covers start done, and
deposited states go into the cache as their passes finish; requests under policy `off` run
without it.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from openjev import logs
from openjev.worker.cache.prepare import PassFit, Prepared, prepare
from openjev.worker.cache.store import StateCache
from openjev.worker.planner.passes import PendingTree, Picked, StateRoom, fill_pass, kept_after_pass
from openjev.worker.planner.plan import PackLimits, Plan, Segment
from openjev.worker.runner_api import ModelRunner, SegmentResult, SegmentRun

log = logs.get("openjev.worker")


class QueueFull(Exception):
    """Admitting the request would exceed the queue capacity."""


class Cancelled(Exception):
    """The caller asked to stop (client gone, deadline passed) before the request finished."""


class InferenceError(Exception):
    """The model could not produce a trustworthy score; never answered with a made-up value."""


@dataclass
class PassStats:
    """What one request's execution took: seconds before its first pass, passes it ran in,
    how many of those also carried other requests, and the tokens cached states spared it."""

    queue_seconds: float
    num_passes: int
    num_shared_passes: int
    cache_hit_tokens: int = 0


@dataclass(eq=False)
class _Job:
    plan: Plan
    is_active: Callable[[], bool]
    on_start: Callable[[], None]
    prepared: Prepared | None = None
    segments: tuple[Segment, ...] = field(init=False)
    tree: PendingTree = field(init=False)
    scores: list[list[float | None]] = field(init=False)
    children_left: list[int] = field(init=False)
    states: dict[int, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    cancel_requested: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    num_passes: int = 0
    num_shared_passes: int = 0

    def __post_init__(self) -> None:
        prepared = self.prepared
        self.segments = self.plan.segments if prepared is None else prepared.segments
        self.tree = PendingTree(self.segments)
        self.scores = [[None] * n for n in self.plan.num_candidates_per_question]
        if prepared is not None:
            for i in prepared.done:
                self.tree.mark_done(i)
            self.states.update(prepared.states)
            for reader, score in prepared.scores:
                self.scores[reader.question][reader.candidate] = score
        self.children_left = [0] * len(self.segments)
        for s in self.segments:
            if s.parent is not None and not self.tree.done[s.index]:
                self.children_left[s.parent] += 1

    @property
    def deposits(self) -> dict:
        return {} if self.prepared is None else self.prepared.deposits

    def finish(self, error: BaseException | None = None) -> None:
        if self.done.is_set():  # the first outcome stands: its thread may be reading it
            return
        self.error = error
        self.states.clear()  # freed now, not when the waiting thread wakes
        if self.prepared is not None:
            self.prepared.states.clear()  # the cached states it hung from (copied into states above)
        self.done.set()


def _cancel_reason(job: _Job) -> str:
    # The loop may see a client's deadline before the request's own thread does: a request that
    # never entered a pass left the queue either way. Who cancelled (the client, its deadline, a
    # shutdown) is the log line's status and outcome, so the reason does not guess.
    return "cancelled while queued" if job.started_at is None else "cancelled before it finished"


class _Pass(NamedTuple):
    jobs: list[_Job]  # the admitted requests it was chosen from (Picked.owner indexes them)
    picked: list[Picked]
    segments: dict[int, set[int]]  # owner -> its segments in the pass
    starting: list[_Job]  # requests whose first pass this is
    started: float  # perf_counter when it was chosen


PassObserver = Callable[[int, int, float], None]  # (requests, tokens, seconds) of each pass


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        limits: PackLimits,
        capacity: int = 64,
        on_pass: PassObserver | None = None,
        poll_seconds: float = 0.02,
        cache: StateCache | None = None,
        on_device_lost: Callable[[str], None] | None = None,
    ):
        if capacity < 0:
            raise ValueError("queue capacity must be >= 0")
        self.runner, self.limits, self.capacity = runner, limits, capacity
        self.max_depth = max(1, int(getattr(runner, "max_pass_depth", 1)))
        # a runner that holds a pass's states in fixed slots says how many (CudaRunner's graphs):
        # beyond them a pass would run eagerly, host-bound and with memory nothing bounds
        states, context = getattr(runner, "max_pass_states", None), getattr(runner, "max_pass_context", 1 << 62)
        self.room = None if states is None else StateRoom(int(states), int(context))
        # requests held at once: those waiting, and at most a pass's worth of segments' owners
        # already running (the worker sizes its Execute threads from this)
        self.max_admitted = capacity + limits.max_sequences
        self._on_pass = on_pass
        self._on_device_lost = on_device_lost
        self.cache = cache
        self._poll_seconds = poll_seconds
        self._jobs: list[_Job] = []  # admitted, in arrival order
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """Requests admitted and not finished (waiting or in passes)."""
        with self._cond:
            return len(self._jobs)

    def run(
        self,
        plan: Plan,
        is_active: Callable[[], bool] = lambda: True,
        on_start: Callable[[], None] = lambda: None,
    ) -> tuple[list[list[float]], PassStats]:
        """Execute one request's plan; returns its head scores per question and candidate.
        on_start: called (on the scheduler's thread) when its first pass begins; a notice only:
        one that raises is logged, and no request fails for it.
        Raises QueueFull, Cancelled or InferenceError."""
        # `off` is the reference path, every candidate's whole prompt computed (the policy table of
        # docs/prefix-reuse.md): it neither hangs from cached states nor deposits any
        cache = self.cache if self.cache is not None and self.cache.enabled and plan.policy != "off" else None
        fit = PassFit(self.limits.max_sequences, self.max_depth)
        prepared = prepare(plan.segments, cache, fit) if cache is not None else None
        job = self._admit(_Job(plan, _no_raise(is_active), _logged(on_start), prepared))
        while not job.done.wait(self._poll_seconds):
            if not job.is_active():
                self._cancel(job)
        if job.error is not None:
            error = job.error
            del job  # the error's traceback holds this frame: no cycle back to the job through it
            try:
                raise error
            finally:
                del error  # nor back to the error itself: freed without the cycle collector
        assert job.started_at is not None
        hit_tokens = 0 if prepared is None else prepared.hit_tokens
        if hit_tokens and cache is not None and job.is_active():
            # counted for an answer its caller is still there for, as its trailer and log line
            cache.record_hit(hit_tokens)
        stats = PassStats(job.started_at - job.submitted_at, job.num_passes, job.num_shared_passes, hit_tokens)
        return job.scores, stats  # type: ignore[return-value]  # every score is set once done

    def close(self) -> None:
        """Stop taking requests; the loop ends once the admitted ones are done."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- admission ----------------------------------------------------------------------------
    def check_room(self) -> None:
        """Raise QueueFull if a request arriving now would be refused: called before planning,
        which can take seconds for thousands of candidates (admission checks again after it; a
        request the cache would answer whole is refused too, as that is known only once planned)."""
        with self._cond:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:
        if self._closed:
            raise QueueFull("worker is shutting down")
        waiting = sum(j.started_at is None for j in self._jobs)
        # an idle worker always admits: its next pass takes the request at once
        if self._jobs and waiting >= self.capacity:
            raise QueueFull(f"worker queue is full ({self.capacity} waiting)")
        if self._jobs and len(self._jobs) >= self.max_admitted:  # few wait, but as many run as a pass holds
            raise QueueFull(f"worker queue is full ({len(self._jobs)} admitted, the most it holds)")

    def _admit(self, job: _Job) -> _Job:
        with self._cond:
            if self._closed:
                raise QueueFull("worker is shutting down")
            if job.tree.finished:  # every score came from the cache: nothing to run, nothing held
                job.started_at = time.perf_counter()
                job.on_start()
                job.finish()
                return job
            self._refuse_if_full()
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
                thread.start()  # first: a thread that cannot start (a pids limit) leaves nothing admitted
                self._thread = thread
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            if job.done.is_set():
                return
            if job.started_at is None:  # not in any pass yet: leave at once
                self._jobs.remove(job)
                job.finish(Cancelled(_cancel_reason(job)))
            else:
                job.cancel_requested = True  # the loop drops it at the next pass boundary

    # ---- the loop (its thread serves every request: nothing a caller passed may end it) ---------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                self._drop_cancelled()
                jobs = list(self._jobs)
                # Chosen and marked started under the lock: a queued request whose client leaves
                # meanwhile is either out of the pass or in it (then dropped at the next boundary),
                # never removed, with the cached states it hangs on, from a pass half built.
                try:
                    chosen = self._choose(jobs) if jobs else None
                except Exception as error:  # a bug choosing a pass must not leave waiters hanging
                    self._finish_all(jobs, InferenceError(f"scheduler failed: {error!r}"))
                    chosen = None
            if chosen is not None:
                self._step(chosen)
            del jobs, chosen  # an idle loop must not keep the last requests (and the cached states they hung on)

    def _drop_cancelled(self) -> None:
        for job in list(self._jobs):
            if job.cancel_requested or not job.is_active():
                self._jobs.remove(job)
                job.finish(Cancelled(_cancel_reason(job)))

    def _choose(self, jobs: list[_Job]) -> _Pass:
        """The next pass over the admitted requests (under the lock): its segments, and its
        requests marked started."""
        per_request = None if len(jobs) == 1 else self.limits.chunk_tokens
        picked = fill_pass([j.tree for j in jobs], self.limits, self.max_depth, per_request, self.room)
        if not picked:  # a filler bug: fail the waiting requests rather than spin on empty passes
            raise RuntimeError(f"no segment of {len(jobs)} waiting requests fits a pass")
        chosen: dict[int, set[int]] = {}
        for p in picked:
            chosen.setdefault(p.owner, set()).add(p.segment)
        now = time.perf_counter()
        starting = [jobs[owner] for owner in chosen if jobs[owner].started_at is None]
        for job in starting:
            job.started_at = now
        for owner in chosen:
            jobs[owner].num_passes += 1
            jobs[owner].num_shared_passes += len(chosen) > 1
        return _Pass(jobs, picked, chosen, starting, now)

    def _step(self, chosen: _Pass) -> None:
        """Run a chosen pass (execute -> update)."""
        jobs = chosen.jobs
        try:
            for job in chosen.starting:
                job.on_start()
            self._run_pass(chosen)
        except Exception as error:  # a bug past the choice fails this pass's requests, not the queue
            failed = [jobs[owner] for owner in chosen.segments]
            self._finish_all(failed, InferenceError(f"scheduler failed: {error!r}"))

    def _run_pass(self, chosen_pass: _Pass) -> None:
        jobs, picked, chosen, now = chosen_pass.jobs, chosen_pass.picked, chosen_pass.segments, chosen_pass.started
        kept = {owner: kept_after_pass(jobs[owner].tree, segs) for owner, segs in chosen.items()}
        # deposits for the cache too, where the pass has room left, first come first (best effort)
        keep = {owner: set(segs) for owner, segs in kept.items()}
        room = None if self.room is None else self.room.states - sum(map(len, kept.values()))
        for p in picked:
            if p.segment in jobs[p.owner].deposits and p.segment not in keep[p.owner] and (room is None or room > 0):
                keep[p.owner].add(p.segment)
                room = None if room is None else room - 1
        runs: list[SegmentRun] = []
        for p in picked:
            job, segment = jobs[p.owner], jobs[p.owner].segments[p.segment]
            # a parent run in an earlier pass hands over its kept state; one in this pass is read in place
            parent = segment.parent if p.parent_in_pass is None else None
            runs.append(
                SegmentRun(
                    token_ids=segment.token_ids,
                    start_position=segment.start_position,
                    parent_state=job.states[parent] if parent is not None else None,
                    keep_state=p.segment in keep[p.owner],
                    read_head=bool(segment.readers),
                    parent_in_pass=p.parent_in_pass,
                )
            )
        try:
            results = self.runner.run_launch(runs)
        except Exception as error:  # any backend failure fails every request of the pass
            traceback.clear_frames(error.__traceback__)
            # a new error, not the raised one: that one's traceback holds this running frame (its
            # runs and their parent states), which a job keeping it would pin in a reference cycle
            self._finish_all([jobs[owner] for owner in chosen], InferenceError(f"runner failed: {error!r}"))
            self._check_device()
            return
        if len(results) != len(runs):
            failure = InferenceError(f"runner returned {len(results)} results for {len(runs)} runs")
            self._finish_all([jobs[owner] for owner in chosen], failure)
            return
        if self._on_pass is not None:
            self._on_pass(len(chosen), sum(len(r.token_ids) for r in runs), time.perf_counter() - now)
        for p, result in zip(picked, results, strict=True):
            self._update(jobs[p.owner], p.segment, p.segment in kept[p.owner], result)
        with self._cond:
            for owner in chosen:
                job = jobs[owner]
                if job.done.is_set():
                    continue
                if job.tree.finished:
                    self._jobs.remove(job)
                    missing = [(q, c) for q, row in enumerate(job.scores) for c, s in enumerate(row) if s is None]
                    # a planner bug, but never answer with a made-up score
                    job.finish(
                        InferenceError(f"no head score for (question, candidate) {missing[:5]}") if missing else None
                    )

    def _update(self, job: _Job, index: int, keep: bool, result: SegmentResult) -> None:
        if job.done.is_set():
            return
        segment = job.segments[index]
        job.tree.mark_done(index)
        if keep:
            if result.state is None:
                self._finish_all([job], InferenceError(f"runner returned no state for segment {index}"))
                return
            job.states[index] = result.state
        if segment.readers:
            score = result.head_score
            if score is None:
                self._finish_all([job], InferenceError(f"runner returned no head score for segment {index}"))
                return
            if not math.isfinite(score):
                self._finish_all([job], InferenceError(f"non-finite head score {score} for segment {index}"))
                return
            for reader in segment.readers:
                job.scores[reader.question][reader.candidate] = float(score)
        key = job.deposits.get(index)
        if key is not None and result.state is not None and self.cache is not None:
            assert job.prepared is not None
            try:  # best effort: a state not kept costs a later request time, never an answer now
                tokens = job.prepared.prefix_tokens(index)
                self.cache.insert(key, result.state, result.head_score, tokens, job.prepared.requires[index])
            except Exception as error:
                log.warning("state_cache_insert_failed", error=repr(error))
        parent = segment.parent
        if parent is not None:
            job.children_left[parent] -= 1
            if job.children_left[parent] == 0:
                job.states.pop(parent, None)

    def _check_device(self) -> None:
        """After a failed pass: a device that can run nothing more (a sticky CUDA error fails
        every later pass while health said SERVING) is reported, once, to on_device_lost."""
        probe = getattr(self.runner, "device_lost", None)
        if probe is None or self._on_device_lost is None:
            return
        try:
            reason = probe()
        except Exception as error:  # the probe's own failure says as much
            reason = repr(error)
        if reason is not None:
            log.error("device_lost", reason=reason)
            callback, self._on_device_lost = self._on_device_lost, None
            callback(reason)

    def _finish_all(self, jobs: list[_Job], error: BaseException) -> None:
        with self._cond:  # finished under the lock: `_cancel` sees them done, not half removed
            for job in jobs:
                if job in self._jobs:
                    self._jobs.remove(job)
                # one exception a request: each thread's raise extends its traceback, so a shared
                # one would carry every other request's frames (and their tokens) along
                job.finish(copy.copy(error))


def _logged(on_start: Callable[[], None]) -> Callable[[], None]:
    """A caller's start notice that cannot raise: it ran inside the pass's own try, so one that
    raised failed every request starting in the same pass."""

    def notified() -> None:
        try:
            on_start()
        except Exception as error:
            log.error("on_start_failed", error=repr(error))

    return notified


def _no_raise(is_active: Callable[[], bool]) -> Callable[[], bool]:
    """A caller's liveness check that cannot raise: one that does counts as the caller gone (it
    killed the scheduler's thread, and with it every other request, when it ran there)."""

    def checked() -> bool:
        try:
            return bool(is_active())
        except Exception:
            return False

    return checked

"""The worker's gRPC servicer: thin, wire -> engine -> wire."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from openjev import abi, interceptors, logs, tracing
from openjev.contract.literals import PrefixPolicy
from openjev.worker.engine import Cancelled, Engine, ExecutionResult, InferenceError, QuestionWork, QueueFull
from openjev.worker.held import HeldTokens, Hold
from openjev.worker.stream import BadStream, Collected, CommitTimer, StreamLimits, collect, collect_unary
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

log = logs.get("openjev.worker")


@dataclass(frozen=True)
class WorkerIdentity:
    """What Describe reports; fixed once the model is loaded."""

    model_id: str
    alias: str | None
    checkpoint_revision: str
    temperature: float
    max_length: int
    vocab_size: int
    tokenizer_fingerprint: str
    weights_fingerprint: str  # abi.weights_fingerprint
    backend: str
    default_policy: PrefixPolicy
    max_questions: int
    max_candidates: int
    max_batch_candidates: int
    max_launch_sequences: int
    max_launch_tokens: int
    queue_capacity: int
    num_token_ids: int = 0  # the tokenizer's ids, specials included (0: vocab_size)
    max_request_tokens: int | None = None

    def stream_limits(self) -> StreamLimits:
        return StreamLimits(
            max_questions=self.max_questions,
            max_candidates=self.max_candidates,
            max_length=self.max_length,
            num_token_ids=self.num_token_ids or self.vocab_size,
            max_tokens=self.max_request_tokens,
            max_batch_candidates=self.max_batch_candidates,
        )


CACHE_HIT_TOKENS_KEY = "openjev-state-cache-hit-tokens"
# How long a stream that ended without a commit waits to learn whether its caller went away
GONE_WAIT_SECONDS = 0.05
# A full queue or a caller gone is no failure of the execution: no ERROR on the `execute` span
_EXECUTE_REFUSALS: dict[type[BaseException], str] = {QueueFull: "RESOURCE_EXHAUSTED", Cancelled: "CANCELLED"}


def _question_results(result: ExecutionResult):
    for index, (probabilities, scores) in enumerate(zip(result.probabilities, result.head_scores, strict=True)):
        yield wire.QuestionResult(question_index=index, probabilities=probabilities, head_scores=scores)


def _summary(result: ExecutionResult) -> wire.ExecutionSummary:
    return wire.ExecutionSummary(
        policy=abi.policy_to_enum(result.policy),
        executed_policy=abi.policy_to_enum(result.executed_policy),
        prefix_enabled=result.enabled,
        scope=abi.scope_to_enum(result.scope),
        saved_tokens=result.num_saved_tokens,
        computed_tokens=result.num_computed_tokens,
        submitted_tokens=result.num_submitted_tokens,
        num_launches=result.num_launches,
        inference_seconds=result.inference_seconds,
        queue_seconds=result.queue_seconds,
    )


def _refuse_full(context, error: QueueFull, fields: dict) -> None:
    """A full queue or held-token budget: load, not a fault of the request (the frontend may try
    another worker); before anything ran, so nothing is spent."""
    log.warning("execute", status="RESOURCE_EXHAUSTED", reason=str(error), **fields)
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))


def _noting_header(fields: dict):
    """collect's on_header: the call's log fields and metric kinds from its checked header, so
    that a refusal after it (the held-token budget, no commit, the commit timeout) is logged and
    counted under the request's kinds, not `unknown` (reserved for calls refused before)."""

    def noted(header: wire.ExecuteHeader, kinds) -> None:
        fields.update(
            questions=len(kinds),
            candidates=sum(q.num_candidates for q in header.questions),
            kinds=sorted(set(kinds)),
        )
        interceptors.note_kinds(fields["kinds"])

    return noted


def _log_gone(context, reason: str, fields: dict) -> None:
    """A request that ended because its caller went: the status and outcome its metrics give it
    (the caller's deadline is DEADLINE_EXCEEDED, a shutdown's cut SERVER_SHUTDOWN), as the
    frontend's `decide` line does; a plain cancel stays CANCELLED."""
    log.info("execute", **interceptors.log_status("CANCELLED", context), reason=reason, **fields)


@contextmanager
def _refused_unrun(context, fields: dict, what: str):
    """Reading a request: a malformed one is INVALID_ARGUMENT ("malformed execute {what}: ..."),
    one past the held-token budget RESOURCE_EXHAUSTED."""
    try:
        yield
    except BadStream as error:
        log.warning("execute", status="INVALID_ARGUMENT", reason=str(error), **fields)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed execute {what}: {error}")
    except QueueFull as error:
        _refuse_full(context, error, fields)


def _responses(result: ExecutionResult):
    for question in _question_results(result):
        yield wire.ExecuteResponse(question=question)
    yield wire.ExecuteResponse(summary=_summary(result))


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        engine: Engine,
        identity: WorkerIdentity,
        *,
        forced_policy: PrefixPolicy | None = None,
        commit_timeout_seconds: float | None = None,
        max_held_tokens: int | None = None,
        ready: bool = True,
    ):
        # Work calls wait for this: the server starts (NOT_SERVING) before the warm-up, whose
        # graph captures a pass run beside them would break (main sets it as health says SERVING)
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.engine = engine
        self.commit_timeout_seconds = commit_timeout_seconds
        self.held = HeldTokens(max_held_tokens)
        self._stream_limits = identity.stream_limits()
        self.identity = identity
        self.forced_policy = forced_policy  # the transformers arm runs every request with `off`
        self._expected = abi.expected_worker(
            identity.tokenizer_fingerprint, identity.max_length, identity.model_id, identity.temperature
        )
        policy = abi.policy_to_enum(identity.default_policy)
        # a frontend from before the weights fingerprint expects the digest without it
        self._expected_fleet = {
            abi.expected_fleet(identity.checkpoint_revision, policy, identity.weights_fingerprint),
            abi.expected_fleet(identity.checkpoint_revision, policy),
        }

    def _call_fields(self, context) -> dict:
        """A call's log fields (its request id), once it is one for this worker: a frontend that
        expects another (it described this address before a restart with another tokenizer or
        model), or that calls before the warm-up is over, gets UNAVAILABLE, unaccepted, so it may
        try another worker."""
        metadata = dict(context.invocation_metadata())
        if not self.ready.is_set():
            log.info(
                "execute",
                status="UNAVAILABLE",
                reason="starting",
                request_id=metadata.get(interceptors.REQUEST_ID_KEY, ""),
            )
            context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is starting (warm-up) and not serving yet")
        for key, mine, differs in (
            (
                abi.EXPECT_METADATA_KEY,
                {self._expected},
                "another ABI version, tokenizer, max_length, model or temperature",
            ),
            (
                abi.EXPECT_FLEET_METADATA_KEY,
                self._expected_fleet,
                "another checkpoint revision, default prefix policy, config or head",
            ),
        ):
            if (expected := metadata.get(key)) is not None and expected not in mine:
                log.warning("execute", status="UNAVAILABLE", reason="the frontend expects another worker", header=key)
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"this worker is not the one the frontend described ({differs})"
                )
        return {"request_id": metadata.get(interceptors.REQUEST_ID_KEY, "")}

    def Describe(self, request, context):
        i = self.identity
        return wire.DescribeResponse(
            abi_version=abi.ABI_VERSION,
            model_id=i.model_id,
            alias=i.alias or "",
            checkpoint_revision=i.checkpoint_revision,
            weights_fingerprint=i.weights_fingerprint,
            temperature=i.temperature,
            max_length=i.max_length,
            limits=wire.Limits(
                max_questions=i.max_questions,
                max_candidates=i.max_candidates,
                max_batch_candidates=i.max_batch_candidates,
                max_launch_sequences=i.max_launch_sequences,
                max_launch_tokens=i.max_launch_tokens,
                queue_capacity=i.queue_capacity,
                max_request_tokens=i.max_request_tokens or 0,
            ),
            tokenizer_fingerprint=i.tokenizer_fingerprint,
            backend=i.backend,
            default_prefix_policy=abi.policy_to_enum(i.default_policy),
            execute_unary=True,
        )

    def Execute(self, request_iterator, context):
        started = time.perf_counter()
        fields = self._call_fields(context)
        with self.held.hold() as hold:  # given back before the answer is sent: its ids are spent
            collected = self._collect(request_iterator, context, fields, hold)
            if collected is None:
                return
            result = self._run(collected, context, started, fields)
            del collected
        yield from _responses(result)

    def _collect(self, request_iterator, context, fields: dict, hold: Hold) -> Collected | None:
        """The committed stream, or None when it ended without a commit; aborts the call when it
        is malformed, was not committed in time, or would pass the held-token budget."""
        timer = CommitTimer(self.commit_timeout_seconds, context.cancel)
        try:
            with _refused_unrun(context, fields, "stream"):  # its abort is no RpcError: not caught below
                collected = collect(request_iterator, self._stream_limits, hold, _noting_header(fields))
        except grpc.RpcError:  # the stream was cancelled while being read
            collected = None
        finally:
            timer.stop()
        if timer.expired:
            outcome = interceptors.COMMIT_TIMEOUT
            log.info("execute", status="CANCELLED", outcome=outcome, reason="no commit in time", **fields)
            interceptors.note_outcome(outcome, server_ended=True)
            context.abort(
                grpc.StatusCode.CANCELLED, f"execute stream not committed within {self.commit_timeout_seconds} s"
            )
        if collected is None:
            # the caller half-closed without a commit, or went away (its deadline or cancel: the
            # interceptor's outcome says which; this project's frontend cancels a stream it refuses
            # part-way); a cancel can end the stream before gRPC marks the call inactive, so wait a
            # moment for that
            gone_by = time.monotonic() + GONE_WAIT_SECONDS
            while context.is_active() and time.monotonic() < gone_by:
                time.sleep(0.005)
            reason = "stream ended without commit" if context.is_active() else "client went away before commit"
            interceptors.note_outcome("DISCARDED")
            outcome = interceptors.refused_outcome("DISCARDED", context)  # a caller gone: its deadline or cancel
            log.info("execute", status="DISCARDED", outcome=outcome, reason=reason, **fields)
            if context.is_active():  # a caller still there must not read an empty OK as an answer
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed execute stream: ended without a commit")
        return collected

    def ExecuteUnary(self, request, context):
        """Execute's committed stream in one message, its answer in one reply."""
        started = time.perf_counter()
        fields = self._call_fields(context)
        with self.held.hold() as hold:
            with _refused_unrun(context, fields, "request"):
                collected = collect_unary(request, self._stream_limits, hold, _noting_header(fields))
            result = self._run(collected, context, started, fields)
        return wire.ExecuteUnaryResponse(questions=list(_question_results(result)), summary=_summary(result))

    def _run(self, collected: Collected, context, started: float, fields: dict) -> ExecutionResult:
        """Accept a checked request, execute it, log it; aborts with the failure's status."""
        header = collected.header
        work = [QuestionWork(kind, ids) for kind, ids in zip(collected.kinds, collected.candidates, strict=True)]
        policy = self.forced_policy or abi.policy_from_enum(header.prefix_policy)
        # Response headers now mark the request as accepted: the frontend tries an UNAVAILABLE
        # Execute again on another worker only without them, so one this worker was about to run
        # (queued or executing) fails UNAVAILABLE if it dies, never runs twice silently.
        log.debug("execute_accepted", **fields)
        try:
            context.send_initial_metadata(((abi.ACCEPTED_METADATA_KEY, "1"),))
        except grpc.RpcError:  # the caller left while the request was read and checked
            _log_gone(context, "client went away before acceptance", fields)
            context.abort(grpc.StatusCode.CANCELLED, "client went away before acceptance")

        # Spans: the wait for the first pass (ended by the scheduler's thread) beside the execution.
        # (the depth takes the scheduler's lock: only asked for while tracing is on)
        depth = self.engine.scheduler.depth if tracing.enabled() else 0
        waiting = tracing.start("queue_wait", queue_depth=depth)

        def first_pass() -> None:  # on the scheduler's thread, as the request's first pass begins
            waiting.end()
            log.debug("execute_started", **fields)

        try:
            with tracing.span("execute", refusals=_EXECUTE_REFUSALS, policy=policy or "default"):
                result = self.engine.execute(
                    work,
                    temperature=self.identity.temperature,
                    policy=policy,
                    should_stop=lambda: not context.is_active(),
                    on_start=first_pass,
                )
        except QueueFull as error:
            _refuse_full(context, error, fields)
        except Cancelled as error:  # the caller's cancel, its deadline, or a shutdown: say which
            _log_gone(context, str(error), fields)
            context.abort(grpc.StatusCode.CANCELLED, str(error))
        except InferenceError as error:
            log.error("execute", status="INTERNAL", reason=str(error), **fields)
            context.abort(grpc.StatusCode.INTERNAL, f"inference failed: {error}")
        except Exception as error:  # never a made-up answer: any failure is INTERNAL
            log.exception("execute", status="INTERNAL", reason=repr(error), **fields)
            context.abort(grpc.StatusCode.INTERNAL, f"inference failed: {error!r}")
        finally:
            waiting.end()  # refused or abandoned before its turn
        if not context.is_active():  # answered after the caller left or its deadline passed: the metrics' label
            fields["outcome"] = interceptors.refused_outcome("OK", context)
        log.info(
            "execute",
            status="OK",
            policy=result.executed_policy,
            tokens_submitted=result.num_submitted_tokens,
            tokens_computed=result.num_computed_tokens,
            saved_tokens=result.num_saved_tokens,
            passes=result.num_launches,
            shared_passes=result.num_shared_passes,
            cache_hit_tokens=result.cache_hit_tokens,
            queue_ms=round(result.queue_seconds * 1e3, 3),
            latency_ms=round((time.perf_counter() - started) * 1e3, 3),
            **fields,
        )
        # cache hits are not part of the public contract (metadata.prefix_cache counts reuse
        # inside the request): they travel as trailing metadata, beside logs and metrics
        context.set_trailing_metadata(((CACHE_HIT_TOKENS_KEY, str(result.cache_hit_tokens)),))
        return result

"""The worker's gRPC servicer: thin, wire -> engine -> wire."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from openjev import abi, interceptors, logs, tracing
from openjev.worker.admission import Abandoned, AdmissionQueue, QueueFull
from openjev.worker.engine import Cancelled, Engine, ExecutionResult, InferenceError, QuestionWork
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
    backend: str
    default_policy: str
    max_questions: int
    max_candidates: int
    max_batch_candidates: int
    max_launch_sequences: int
    max_launch_tokens: int
    queue_capacity: int


class BadStream(Exception):
    """The frontend broke the Execute protocol; nothing is executed."""


def _collect(request_iterator, identity: WorkerIdentity) -> tuple[wire.ExecuteHeader, list[QuestionWork]] | None:
    """Read header, batches, commit. None when the stream ended without a commit (the frontend
    found the request invalid part-way through tokenizing, or the client went away)."""
    header = None
    slots: list[list[list[int] | None]] = []
    for message in request_iterator:
        item = message.WhichOneof("item")
        if item == "header":
            if header is not None:
                raise BadStream("second header")
            header = message.header
            if not 1 <= len(header.questions) <= identity.max_questions:
                raise BadStream("question count outside the worker's limits")
            total = sum(q.num_candidates for q in header.questions)
            if total > identity.max_candidates or any(q.num_candidates < 1 for q in header.questions):
                raise BadStream("candidate count outside the worker's limits")
            slots = [[None] * q.num_candidates for q in header.questions]
        elif item == "batch":
            if header is None:
                raise BadStream("batch before header")
            for candidate in message.batch.candidates:
                q, c = candidate.question_index, candidate.candidate_index
                if q >= len(slots) or c >= len(slots[q]) or slots[q][c] is not None:
                    raise BadStream(f"candidate ({q}, {c}) out of range or repeated")
                ids = list(candidate.token_ids)
                if not 1 <= len(ids) <= identity.max_length:
                    raise BadStream(f"candidate ({q}, {c}) has {len(ids)} tokens")
                if max(ids) >= identity.vocab_size:
                    raise BadStream(f"candidate ({q}, {c}) has a token id outside the vocabulary")
                slots[q][c] = ids
        elif item == "commit":
            if header is None:
                raise BadStream("commit before header")
            missing = sum(ids is None for question in slots for ids in question)
            if missing:
                raise BadStream(f"{missing} candidates missing at commit")
            kinds = [abi.kind_from_enum(q.kind) for q in header.questions]
            return header, [QuestionWork(kind, tuple(ids)) for kind, ids in zip(kinds, slots)]
        else:
            raise BadStream("empty message")
    return None


def _responses(result: ExecutionResult, queue_seconds: float):
    for index, (probabilities, scores) in enumerate(zip(result.probabilities, result.head_scores)):
        yield wire.ExecuteResponse(
            question=wire.QuestionResult(question_index=index, probabilities=probabilities, head_scores=scores)
        )
    yield wire.ExecuteResponse(
        summary=wire.ExecutionSummary(
            policy=abi.policy_to_enum(result.policy),
            executed_policy=abi.policy_to_enum(result.executed_policy),
            prefix_enabled=result.enabled,
            scope=abi.scope_to_enum(result.scope),
            saved_tokens=result.num_saved_tokens,
            computed_tokens=result.num_computed_tokens,
            submitted_tokens=result.num_submitted_tokens,
            num_launches=result.num_launches,
            inference_seconds=result.inference_seconds,
            queue_seconds=queue_seconds,
        )
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self, engine: Engine, identity: WorkerIdentity, queue: AdmissionQueue, *, forced_policy: str | None = None
    ):
        self.engine = engine
        self.identity = identity
        self.queue = queue
        self.forced_policy = forced_policy  # the transformers arm runs every request with `off`

    def Describe(self, request, context):
        i = self.identity
        return wire.DescribeResponse(
            abi_version=abi.ABI_VERSION,
            model_id=i.model_id,
            alias=i.alias or "",
            checkpoint_revision=i.checkpoint_revision,
            temperature=i.temperature,
            max_length=i.max_length,
            limits=wire.Limits(
                max_questions=i.max_questions,
                max_candidates=i.max_candidates,
                max_batch_candidates=i.max_batch_candidates,
                max_launch_sequences=i.max_launch_sequences,
                max_launch_tokens=i.max_launch_tokens,
                queue_capacity=i.queue_capacity,
            ),
            tokenizer_fingerprint=i.tokenizer_fingerprint,
            backend=i.backend,
            default_prefix_policy=abi.policy_to_enum(i.default_policy),
        )

    def Execute(self, request_iterator, context):
        started = time.perf_counter()
        request_id = dict(context.invocation_metadata()).get(interceptors.REQUEST_ID_KEY, "")
        fields = {"request_id": request_id}
        try:
            collected = _collect(request_iterator, self.identity)
        except (BadStream, KeyError) as error:
            log.warning("execute", status="INVALID_ARGUMENT", reason=str(error), **fields)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed execute stream: {error}")
        if collected is None:
            log.info("execute", status="DISCARDED", reason="stream ended without commit", **fields)
            return
        header, work = collected
        policy = self.forced_policy or abi.policy_from_enum(header.prefix_policy)
        fields.update(
            questions=len(work),
            candidates=sum(len(q.candidates) for q in work),
            kinds=sorted({q.kind for q in work}),
        )
        interceptors.note_kinds(fields["kinds"])
        # Response headers now mark the request as accepted: the frontend's channel retries an
        # UNAVAILABLE Execute on another worker only before them, so one this worker was about
        # to run (queued or executing) fails UNAVAILABLE if it dies, never runs twice silently.
        log.debug("execute_accepted", **fields)
        context.send_initial_metadata(())

        # The engine runs on the executor thread: its spans join this call's trace through `parent`.
        parent = tracing.capture()
        waiting = tracing.start("queue_wait", queue_depth=self.queue.depth)

        def execute() -> ExecutionResult:
            waiting.end()
            with tracing.attached(parent), tracing.span("execute", policy=policy or "default"):
                return self.engine.execute(
                    work,
                    temperature=self.identity.temperature,
                    policy=policy,
                    should_stop=lambda: not context.is_active(),
                )

        try:
            result, queue_seconds = self.queue.run(execute, is_active=context.is_active)
        except QueueFull as error:
            log.warning("execute", status="RESOURCE_EXHAUSTED", **fields)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except (Abandoned, Cancelled) as error:
            log.info("execute", status="CANCELLED", reason=str(error), **fields)
            context.abort(grpc.StatusCode.CANCELLED, str(error))
        except InferenceError as error:
            log.error("execute", status="INTERNAL", reason=str(error), **fields)
            context.abort(grpc.StatusCode.INTERNAL, f"inference failed: {error}")
        except Exception as error:  # never a made-up answer: any failure is INTERNAL
            log.exception("execute", status="INTERNAL", reason=repr(error), **fields)
            context.abort(grpc.StatusCode.INTERNAL, f"inference failed: {error!r}")
        finally:
            waiting.end()  # refused or abandoned before its turn
        log.info(
            "execute",
            status="OK",
            policy=result.executed_policy,
            tokens_submitted=result.num_submitted_tokens,
            tokens_computed=result.num_computed_tokens,
            saved_tokens=result.num_saved_tokens,
            launches=result.num_launches,
            queue_ms=round(queue_seconds * 1e3, 3),
            latency_ms=round((time.perf_counter() - started) * 1e3, 3),
            **fields,
        )
        yield from _responses(result, queue_seconds)

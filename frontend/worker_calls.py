"""A frontend's calls to a worker: one Execute stream or ExecuteUnary call, and what its failure
means for the request (Refused with the client's status, or NotAccepted: it ran nowhere and may
be tried again). The servicer (`service.py`) routes, retries and assembles around them."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from openjev import abi
from openjev.contract.request import DecisionRequest
from openjev.worker.v1 import worker_pb2 as wire

# Worker failures the client sees as they are; anything else from a worker is INTERNAL.
_PASSED_THROUGH = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


INFERENCE_FAILED = "model inference failed"


class Refused(Exception):
    """The request ends with this gRPC status and message (the client's own answer)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, unrun: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        # The worker failed the call before sending any result; with RESOURCE_EXHAUSTED (a full
        # queue) the request never ran there and may go to another worker.
        self.unrun = unrun

    def public_message(self, request_id: str) -> str:
        """What the caller reads. A failure of inference (INTERNAL) says only that, as the
        reference service does, plus the request id under which the frontend logged the reason:
        the reason is an exception's text from inside the worker or a check of its reply, of use
        to the operator, not the caller. Every other refusal is the caller's to act on."""
        if self.code == grpc.StatusCode.INTERNAL:
            return f"{INFERENCE_FAILED} (request id {request_id})"
        return self.message


class NotAccepted(Exception):
    """A worker call failed UNAVAILABLE before the worker accepted it: it ran nowhere."""

    def __init__(self, refused: Refused):
        super().__init__(refused.message)
        self.refused = refused


def accepted(call) -> bool:
    """Whether the worker accepted the call (its response headers say so). Asked once the call
    has ended, when its headers, if any came, are in."""
    return any(key == abi.ACCEPTED_METADATA_KEY for key, _value in call.initial_metadata() or ())


class NoUnary(Exception):
    """The worker answered ExecuteUnary UNIMPLEMENTED (a worker from before it): nothing ran."""


def failure(call, code: grpc.StatusCode, details: str | None, *, unrun: bool, client_active: bool) -> Exception:
    """A failed worker call as the servicer reports it: Refused, or NotAccepted when it failed
    UNAVAILABLE, INVALID_ARGUMENT or UNIMPLEMENTED before the worker accepted it. A call cancelled while the
    client is still there was cancelled by the worker (its commit timeout ran out while this
    frontend was still sending the request): UNAVAILABLE, not a CANCELLED the client would take
    for its own."""
    message = f"worker: {details}"
    if code == grpc.StatusCode.CANCELLED and client_active:
        code = grpc.StatusCode.UNAVAILABLE
        message = "worker cancelled the call (the request was not sent within its commit timeout?)"
    disagrees = code == grpc.StatusCode.INVALID_ARGUMENT  # a request this frontend checked and sent
    if code == grpc.StatusCode.UNIMPLEMENTED and not accepted(call):
        # something else answers at that address (a reused one, another server's port): no worker
        # ran it, so another may; the retry's Describe round names the address
        code, message = grpc.StatusCode.UNAVAILABLE, f"{message} (that address does not serve Execute)"
    code = code if code in _PASSED_THROUGH else grpc.StatusCode.INTERNAL
    refused = Refused(code, message, unrun=unrun)
    # Not accepted, so never run: another worker may take it. A worker that finds malformed what
    # this frontend checked has other limits than it described (restarted with smaller ones): the
    # retry also has the workers described again at once (else every request it drew failed
    # INTERNAL until the next refresh).
    if (code == grpc.StatusCode.UNAVAILABLE or disagrees) and not accepted(call):
        return NotAccepted(refused)
    return refused


# a client gone this close to its deadline is taken for one that reached it
_DEADLINE_SLACK_SECONDS = 0.001


def cancel_with_client(context, cancel: Callable[[], object]) -> None:
    """The client going away cancels the worker's work. A client gone already (while the request
    was validated or tokenized) has run its callbacks: gRPC refuses new ones, so cancel now. A
    client whose deadline passed is not cancelled for: the worker call carries the same deadline
    and ends DEADLINE_EXCEEDED there too (a cancel reached a busy worker that had received the
    call late before its copy of the deadline, and was counted a client's cancel)."""

    remaining = context.time_remaining()
    # the deadline as a number: a callback holding the context would make a cycle through it
    deadline = None if remaining is None else time.monotonic() + remaining - _DEADLINE_SLACK_SECONDS

    def on_done() -> None:
        if deadline is None or time.monotonic() < deadline:
            cancel()

    if not context.add_callback(on_done):
        on_done()


def place(results: list, question: wire.QuestionResult) -> None:
    index = question.question_index
    if index >= len(results) or results[index] is not None:
        raise Refused(grpc.StatusCode.INTERNAL, f"worker returned question {index} twice or out of range")
    results[index] = question


def add_candidates(into, batch) -> int:
    """Append a tokenized batch to a repeated Candidate field (a stream message's batch or the
    one-message request); returns the tokens it held."""
    tokens = 0
    for candidate in batch:
        tokens += len(candidate.token_ids)
        into.add(
            question_index=candidate.question_index,
            candidate_index=candidate.candidate_index,
            token_ids=candidate.token_ids,
        )
    return tokens


def as_stream(request: wire.ExecuteUnaryRequest):
    """An ExecuteUnary request as the Execute stream of the same request."""
    yield wire.ExecuteRequest(header=request.header)
    yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=request.candidates))
    yield wire.ExecuteRequest(commit=wire.Commit())


def call_stream(stub, requests, metadata, timeout: float, context, num_questions: int):
    """One Execute call: (results by question index, summary); Refused, or NotAccepted when
    it failed before the worker accepted it (`failure`)."""
    made = threading.Event()
    cancel: list[Callable[[], object]] = []

    def sent() -> Iterator[wire.ExecuteRequest]:
        """The requests; ended without a commit (a contract error part-way), the call is
        cancelled: waiting for the worker to end it cost every such refusal ~50 ms."""
        committed = False
        for message in requests:
            committed = message.WhichOneof("item") == "commit"
            yield message
        if not committed and made.wait(5):
            cancel[0]()

    call = stub.Execute(sent(), timeout=max(timeout, 0.001), metadata=metadata)
    cancel.append(call.cancel)
    made.set()
    cancel_with_client(context, call.cancel)
    results: list[wire.QuestionResult | None] = [None] * num_questions
    summary = None
    received = False
    try:
        for message in call:
            received = True
            item = message.WhichOneof("item")
            if item is None or summary is not None:  # nothing, or anything after the summary
                call.cancel()
                raise Refused(grpc.StatusCode.INTERNAL, "worker sent a malformed reply (empty, or after its summary)")
            if item == "question":
                place(results, message.question)
            else:
                summary = message.summary
    except grpc.RpcError as error:
        error.__traceback__ = None  # grpc raises the call itself: a cycle through every frame of this request
        raise failure(
            call, error.code(), error.details(), unrun=not received, client_active=context.is_active()
        ) from error
    return results, summary


def call_unary(stub, request, metadata, timeout: float, context, num_questions: int):
    """One ExecuteUnary call: as `_call`, or NoUnary when the worker does not serve it. A
    future, not a blocking call: only a future can be cancelled when the client goes away."""
    future = stub.ExecuteUnary.future(request, timeout=max(timeout, 0.001), metadata=metadata)
    cancel_with_client(context, future.cancel)
    try:
        response = future.result()
    except (grpc.RpcError, grpc.FutureCancelledError) as error:
        error.__traceback__ = None  # grpc raises the call itself: a cycle through every frame of this request
        code = future.code()
        if code == grpc.StatusCode.UNIMPLEMENTED and not accepted(future):
            raise NoUnary() from None
        # whatever failed, no result came: a reply is all or nothing
        raise failure(future, code, future.details(), unrun=True, client_active=context.is_active()) from None
    results: list[wire.QuestionResult | None] = [None] * num_questions
    for question in response.questions:
        place(results, question)
    return results, (response.summary if response.HasField("summary") else None)


def check_results(decision: DecisionRequest, results, summary, num_tokens: int) -> None:
    """Never pass on an answer the worker did not fully give: a malformed result is INTERNAL.
    num_tokens: the candidate tokens sent, which the summary must say it was given."""
    if summary is None or any(r is None for r in results):
        raise Refused(grpc.StatusCode.INTERNAL, "worker ended the stream without a complete result")
    if (problem := summary_problem(summary, num_tokens)) is not None:
        raise Refused(grpc.StatusCode.INTERNAL, f"worker returned an invalid summary: {problem}")
    for question, result in zip(decision.questions, results, strict=True):
        expected = 2 if question.kind == "noul" else len(question.prompts)
        p = list(result.probabilities)
        if len(p) != expected or not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in p) or abs(sum(p) - 1.0) > 1e-6:
            raise Refused(grpc.StatusCode.INTERNAL, f"worker returned invalid probabilities for question {question.id}")


def summary_problem(summary: wire.ExecutionSummary, num_tokens: int) -> str | None:
    """Why a worker's summary must not reach a client (its policy and scope become the response's
    metadata), or None. Its token counts obey the planner's identity (submitted = computed + saved,
    reuse enabled exactly when tokens were saved)."""
    try:
        known = None not in (abi.policy_from_enum(summary.policy), abi.policy_from_enum(summary.executed_policy))
        abi.scope_from_enum(summary.scope)
    except KeyError:
        known = False
    if not known:
        return "an unknown prefix policy or scope"
    if summary.submitted_tokens != num_tokens:
        return f"{summary.submitted_tokens} tokens submitted where {num_tokens} were sent"
    if summary.computed_tokens + summary.saved_tokens != summary.submitted_tokens:
        return "computed and saved tokens do not add up to those submitted"
    if summary.prefix_enabled != (summary.saved_tokens > 0):
        return "prefix reuse said enabled without saved tokens, or the reverse"
    if not (math.isfinite(summary.inference_seconds) and summary.inference_seconds >= 0):
        return "a negative or non-finite inference time"
    return None

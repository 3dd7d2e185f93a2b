"""The public gRPC servicer: validate, tokenize while streaming to the worker, assemble answers."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from openjev import abi, interceptors, logs, serving, tracing
from openjev.contract.answers import answer_from_probabilities
from openjev.contract.errors import PREFIX_POLICY, ContractError
from openjev.contract.literals import PrefixPolicy
from openjev.contract.render import dumps_exact
from openjev.contract.request import MAX_RENDERED_BYTES, DecisionRequest, parse_request_json
from openjev.export import ExportMeta
from openjev.frontend import routing, worker_calls
from openjev.frontend.batches import EncodeLanes, iter_candidate_batches
from openjev.frontend.parsing import BodyParsers, ParseFailed
from openjev.frontend.turns import Abandoned
from openjev.frontend.worker_calls import Refused
from openjev.frontend.worker_link import WorkerLink
from openjev.interceptors import REQUEST_ID_KEY
from openjev.tokenizer import PromptTokenizer
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc
from openjev.worker.v1 import worker_pb2 as wire

log = logs.get("openjev.frontend")

METHOD = "open-jev-scalar-head"
# Submitted tokens per request, all candidates together (as the worker's default): the largest
# request the contract allows (65,536 short candidates, ~2.3 M tokens) fits.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 22
# A worker call that failed UNAVAILABLE before the worker accepted it ran nowhere: it is tried
# again (on another worker where there is one) up to this many times in all, within the same
# deadline, after RETRY_BACKOFF_SECONDS, doubling. gRPC's own retries are off (worker_link.py).
MAX_ATTEMPTS = 3
RETRY_BACKOFF_SECONDS = 0.05
# Bodies longer than this are parsed (and their state rendered) in child processes, at most
# `large_body_parses` at a time (parsing.py): JSON builds up to ~30 times its size in Python
# objects (57 MiB of nested empty arrays: 1.6 GB and 6 s, holding the GIL). The price: a large
# body waits for the parses ahead of it (seconds each at tens of MiB), and pays a round trip to
# its child (tens of milliseconds at tens of MiB; a child's start, the first time, ~1 s).
LARGE_BODY_CHARS = 1 << 20
# A request the contract refuses is the caller's fault: no ERROR on the `validate` span
_VALIDATE_REFUSALS: dict[type[BaseException], str] = {ContractError: "INVALID_ARGUMENT", Abandoned: "CANCELLED"}
# A worker call that ended so: no more time is spent on the request (checking its other candidates)
OUT_OF_TIME = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass
class _Routing:
    """One request's routing over its attempts. fallback: once set, every later attempt goes
    round-robin, counted under this route. chosen: the route of the last call, recorded once
    when the request ends. checked: every candidate passed the contract's length check (once a
    request: a worker that fails each attempt part-way does not cost a check each)."""

    fallback: tuple[str, str] | None = None
    chosen: tuple[str, str] | None = None
    checked: bool = False


def answer_to_proto(question_id: str, answer: dict) -> api.Answer:
    message = api.Answer(question_id=question_id)
    kind = answer["type"]
    if kind == "noul":
        message.noul.noul = answer["noul"]
        return message
    message.keys.extend(answer["probabilities"].keys())
    message.probabilities.extend(answer["probabilities"].values())
    if kind == "choice":
        message.choice.choice = answer["choice"]
        message.choice.confidence = answer["confidence"]
    else:
        message.score.score = answer["score"]
        message.score.confidence = answer["confidence"]
        message.score.legend_json.extend(dumps_exact(level, sort_keys=False) for level in answer["legend"].values())
    return message


def _status_name(error: Exception) -> str:
    """The gRPC status a failed worker attempt ends its caller's call with."""
    refused = error.refused if isinstance(error, worker_calls.NotAccepted) else error
    return refused.code.name if isinstance(refused, Refused) else grpc.StatusCode.INTERNAL.name


class DecisionServicer(decision_pb2_grpc.DecisionServiceServicer):
    def __init__(
        self,
        meta: ExportMeta,
        tokenizer: PromptTokenizer,
        link: WorkerLink,
        *,
        max_questions: int = 4096,
        max_candidates: int = 65536,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
        max_rendered_bytes: int = MAX_RENDERED_BYTES,
        tokenizer_threads: int = 2,
        worker_deadline_seconds: float = 120.0,
        max_answer_bytes: int = serving.MAX_MESSAGE_BYTES,
        large_body_parses: int = 1,
        affinity_prefix_bytes: int = routing.DEFAULT_PREFIX_BYTES,
    ):
        self.meta = meta
        self.tokenizer = tokenizer
        self.expected_worker = abi.expected_worker(
            tokenizer.fingerprint, meta.max_length, meta.model_id, meta.temperature
        )
        self.link = link
        self.max_questions = max_questions
        self.max_candidates = max_candidates
        self.max_answer_bytes = max_answer_bytes
        self.max_request_tokens = max_request_tokens
        self.max_rendered_bytes = max_rendered_bytes
        self.worker_deadline_seconds = worker_deadline_seconds
        self.affinity_prefix_bytes = affinity_prefix_bytes
        self._replay_budget = routing.ReplayBudget(routing.REPLAY_TOTAL_BYTES)
        self._chat_template_bytes = len((tokenizer.chat_prefix + tokenizer.chat_suffix).encode("utf-8"))
        # Tokenizing is the frontend's CPU work: batch by batch in arrival order, never more
        # than `tokenizer_threads` batches at once in each of two lanes, small batches and large
        # (on gRPC's sending threads, see EncodeLanes).
        self._encode = EncodeLanes(self.tokenizer.encode, tokenizer_threads)
        # picklable: large bodies are parsed with it in child processes
        self._parse = functools.partial(
            parse_request_json,
            accepted_models=self.meta.accepted_model_names,
            max_questions=self.max_questions,
            max_candidates=self.max_candidates,
            max_rendered_bytes=self.max_rendered_bytes,
            chat_template_bytes=self._chat_template_bytes,
        )
        self.parsers = BodyParsers(self._parse, large_body_parses)

    def close(self) -> None:
        """Stops the processes that parse large bodies (tokenizing holds no threads of its own)."""
        self.parsers.close()

    def worker_timeout(self, context) -> float:
        """The worker call's deadline: the client's, capped at worker_deadline_seconds (also when
        the client set none), so a silent worker never holds a request longer than that."""
        remaining = context.time_remaining()
        return self.worker_deadline_seconds if remaining is None else min(remaining, self.worker_deadline_seconds)

    def DescribeModel(self, request, context):
        describe = self.link.state.describe
        return api.DescribeModelResponse(
            model_id=self.meta.model_id,
            accepted_names=sorted(self.meta.accepted_model_names),
            checkpoint_revision=describe.checkpoint_revision if describe else self.meta.checkpoint_revision,
            temperature=self.meta.temperature,
            max_length=self.meta.max_length,
            max_questions=self.max_questions,
            max_candidates=self.max_candidates,
            default_prefix_policy=describe.default_prefix_policy if describe else api.PREFIX_POLICY_UNSPECIFIED,
            backend=describe.backend if describe else "",
        )

    def Decide(self, request, context):
        started = time.perf_counter()
        request_id = dict(context.invocation_metadata()).get(REQUEST_ID_KEY) or uuid.uuid4().hex
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))  # the id the logs carry, to the caller
        fields: dict = {"request_id": request_id}
        try:
            response = self._decide(request, context, request_id, fields)
            self._check_answer_size(response)
        except Refused as refused:
            level = log.error if refused.code == grpc.StatusCode.INTERNAL else log.info
            level(
                "decide",
                **interceptors.log_status(refused.code.name, context),  # the metrics' label
                reason=refused.message,  # the whole reason, which the caller may not see
                latency_ms=round((time.perf_counter() - started) * 1e3, 3),
                **fields,
            )
            context.abort(refused.code, refused.public_message(request_id))
        if not context.is_active():  # answered after the caller left or its deadline passed: the metrics' label
            fields["outcome"] = interceptors.refused_outcome("OK", context)
        log.info("decide", status="OK", latency_ms=round((time.perf_counter() - started) * 1e3, 3), **fields)
        return response

    def _check_answer_size(self, response: api.DecideResponse) -> None:
        """An answer over the public port's message limit is refused here, not by gRPC's send,
        which failed it after the log and the metrics had counted the request OK. (Question ids
        and candidate keys come back in the answer, and a choice's key twice: it can outgrow its
        request.) INVALID_ARGUMENT, as for the other size limits: the same request is refused
        every time. The HTTP route has no message limit and answers it."""
        size = response.ByteSize()
        if size > self.max_answer_bytes:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"answer message larger than max ({size} vs. {self.max_answer_bytes} bytes)",
            )

    def answer(self, request: api.DecideRequest, context, request_id: str, fields: dict) -> api.DecideResponse:
        """The Decide path without its gRPC status: raises Refused. The HTTP route calls it with
        a context of its own (openjev.frontend.http.app.HttpCallContext)."""
        return self._decide(request, context, request_id, fields)

    def _decide(self, request, context, request_id: str, fields: dict) -> api.DecideResponse:
        body = request.request_json
        try:
            with tracing.span("validate", refusals=_VALIDATE_REFUSALS):
                if len(body) > LARGE_BODY_CHARS:
                    decision = self.parsers(body, context.is_active)
                else:
                    decision = self._parse(body)
        except ContractError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, error.message) from error
        except Abandoned as gone:
            raise Refused(grpc.StatusCode.CANCELLED, str(gone)) from None
        except ParseFailed as failed:  # a server stopping is UNAVAILABLE (retried elsewhere), not out of capacity
            code = grpc.StatusCode.UNAVAILABLE if failed.stopping else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise Refused(code, str(failed)) from None
        fields.update(kinds=sorted({q.kind for q in decision.questions}), candidates=decision.num_candidates)
        interceptors.note_kinds(fields["kinds"])
        try:
            policy = abi.policy_from_enum(request.prefix_policy) or decision.prefix_policy
        except KeyError:  # an enum value this build does not know (proto3 enums are open)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, PREFIX_POLICY) from None
        link_state = self.link.state
        if link_state.problem is not None:
            self._check_lengths(decision, context.is_active)  # a request's own fault is INVALID_ARGUMENT, worker or not
            raise Refused(link_state.status, link_state.problem)
        results, summary, num_input_tokens = self._execute(decision, policy, context, request_id, fields)
        fields.update(input_tokens=num_input_tokens)
        response = api.DecideResponse(model=self.meta.model_id)
        for question, result in zip(decision.questions, results, strict=True):
            answer = answer_from_probabilities(question, list(result.probabilities))
            response.answers.append(answer_to_proto(question.id, answer))
        response.usage.input_tokens = num_input_tokens
        metadata = response.metadata
        metadata.method = METHOD
        metadata.temperature = self.meta.temperature
        metadata.candidate_sequences = decision.num_candidates
        metadata.inference_seconds = summary.inference_seconds
        metadata.max_length = self.meta.max_length
        metadata.prefix_cache.policy = summary.policy
        metadata.prefix_cache.enabled = summary.prefix_enabled
        metadata.prefix_cache.scope = summary.scope
        metadata.prefix_cache.saved_tokens = summary.saved_tokens
        return response

    def _execute(self, decision: DecisionRequest, policy: PrefixPolicy | None, context, request_id: str, fields: dict):
        """Run the request on a worker within the worker deadline; a call no worker accepted
        (one died or refused the connection first) is tried again, tokenized afresh."""
        timeout = self.worker_timeout(context)
        deadline = time.monotonic() + timeout
        route = _Routing()
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                try:
                    remaining = deadline - time.monotonic()
                    return self._attempt(decision, policy, context, request_id, remaining, fields, route)
                except worker_calls.NotAccepted as failure:
                    self.link.refresh_soon()
                    if self.link.affinity and route.fallback is None:
                        # ring_hash would pick the same worker again (one that refuses the call
                        # stays on the ring while its health says SERVING): retry round-robin
                        route.fallback = routing.FALLBACK_NOT_ACCEPTED
                    backoff = RETRY_BACKOFF_SECONDS * 2 ** (attempt - 1)
                    if attempt == MAX_ATTEMPTS or deadline - time.monotonic() <= backoff or not context.is_active():
                        raise failure.refused from None
                    log.info("worker_retry", request_id=request_id, attempt=attempt, reason=failure.refused.message)
                    time.sleep(backoff)
            raise AssertionError("unreachable")
        except Refused as refused:
            remaining = context.time_remaining()
            if refused.code == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > 0):
                # this frontend's cap, not the client's deadline, ran out: the metrics must say so
                interceptors.note_outcome(interceptors.WORKER_DEADLINE)
            raise
        finally:
            if route.chosen is not None:
                routing.record(route.chosen)

    def _attempt(
        self,
        decision: DecisionRequest,
        policy: PrefixPolicy | None,
        context,
        request_id: str,
        timeout: float,
        fields,
        route: _Routing,
    ):
        """One attempt on the worker the routing picks (`_route`): one ExecuteUnary call for a
        request that fits one batch when the workers serve it, else the Execute stream. A worker
        without ExecuteUnary (UNIMPLEMENTED: it ran nothing) gets the same candidates as a
        stream, and the link chooses streams until its workers say otherwise."""
        deadline = time.monotonic() + timeout
        # Tokenizing runs on gRPC's sending thread (stream) or on this one (unary), in this span.
        worker_span = tracing.start("worker_stream", candidates=decision.num_candidates)
        metadata = [
            (REQUEST_ID_KEY, request_id),
            (abi.EXPECT_METADATA_KEY, self.expected_worker),
            *tracing.inject(worker_span),
        ]
        if (fleet := self.link.state.expected_fleet) is not None:  # what the workers agreed on
            metadata.append((abi.EXPECT_FLEET_METADATA_KEY, fleet))
        num_questions = len(decision.questions)

        def routed(call, replayable, ended_early=lambda: False):
            return self._route(call, replayable, ended_early, decision, context, deadline, fields, route)

        def send_unary(request: wire.ExecuteUnaryRequest):
            fields["worker_method"] = "ExecuteUnary"  # the request's log line says which call ran it

            def call(stub, extra_metadata, seconds):
                return worker_calls.call_unary(
                    stub, request, [*metadata, *extra_metadata], seconds, context, num_questions
                )

            return routed(call, lambda: True)  # the request is its own replay

        def watched(messages: Iterator[wire.ExecuteRequest]) -> Iterator[wire.ExecuteRequest]:
            for message in messages:
                if message.WhichOneof("item") == "commit":  # every candidate passed the checks
                    route.checked = True
                yield message

        def send_stream(source: Iterator[wire.ExecuteRequest], refusal: list[str]):
            fields["worker_method"] = "Execute"
            messages = watched(source)
            # With affinity the messages are kept (routing.Replay) for one round-robin resend.
            kept = None
            if self.link.affinity and route.fallback is None:
                kept = routing.Replay(messages, routing.REPLAY_REQUEST_BYTES, self._replay_budget)
            calls = [0]

            def call(stub, extra_metadata, seconds):
                payload = messages if kept is None else iter(kept) if not calls[0] else kept.again()
                calls[0] += 1
                return worker_calls.call_stream(
                    stub, payload, [*metadata, *extra_metadata], seconds, context, num_questions
                )

            try:
                return routed(call, lambda: kept is not None and kept.replayable, lambda: bool(refusal))
            except (Refused, worker_calls.NotAccepted) as failed:
                # the code, not the error: its traceback holds this frame (a cycle, test_no_cycles.py)
                code = (failed.refused if isinstance(failed, worker_calls.NotAccepted) else failed).code
                if not refusal and not route.checked and code not in OUT_OF_TIME:
                    # The worker failed the call while the candidates were still being tokenized:
                    # one not reached yet may fail the contract, and that is the answer, worker or
                    # not. The request's log line keeps the worker's status.
                    fields["worker_status"] = code.name
                    self._check_lengths(decision, context.is_active)
                    route.checked = True
                if refusal:  # the stream ended early on a contract error: that is the answer
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, refusal[0]) from None
                raise
            finally:
                if kept is not None:
                    kept.close()

        try:
            if self.link.state.execute_unary and decision.num_candidates <= abi.BATCH_CANDIDATES:
                request, num_tokens = self._unary_request(decision, policy, request_id, worker_span, context.is_active)
                try:
                    results, summary = send_unary(request)
                except worker_calls.NoUnary:
                    self.link.note_no_execute_unary()
                    log.info("worker_no_execute_unary", request_id=request_id)
                    route.checked = True  # tokenized whole before the unary call
                    results, summary = send_stream(worker_calls.as_stream(request), [])
            else:
                refusal: list[str] = []
                token_count = [0]
                tokenize_span = tracing.start("tokenize", parent=worker_span)
                try:
                    stream = self._stream(
                        decision, policy, request_id, refusal, token_count, tokenize_span, context.is_active
                    )
                    results, summary = send_stream(stream, refusal)
                finally:
                    tokenize_span.end()  # a stream that never started or was cut off
                if refusal:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, refusal[0])
                num_tokens = token_count[0]
            worker_calls.check_results(decision, results, summary, num_tokens)  # a worker's failure too
        except Exception as error:
            # ERROR where the worker (or this frontend) failed, not for what the caller ended
            code = _status_name(error)  # no local of this frame holds the error its traceback holds
            caller_deadline = interceptors.caller_deadline_passed(context.time_remaining(), context.is_active())
            tracing.note_outcome(worker_span, code, caller_deadline=caller_deadline)
            raise
        finally:
            worker_span.end()
        return results, summary, num_tokens

    def _header(self, decision: DecisionRequest, policy: PrefixPolicy | None, request_id: str) -> wire.ExecuteHeader:
        header = wire.ExecuteHeader(request_id=request_id, prefix_policy=abi.policy_to_enum(policy))
        for question in decision.questions:
            header.questions.add(kind=abi.kind_to_enum(question.kind), num_candidates=len(question.prompts))
        return header

    def _batches(self, decision: DecisionRequest, wanted: Callable[[], bool] | None = None):
        """wanted: whether the client is still there, asked as each batch's tokenizer turn comes."""
        return iter_candidate_batches(
            decision,
            self.tokenizer,
            self.meta.max_length,
            abi.BATCH_CANDIDATES,
            max_tokens=self.max_request_tokens,
            encode=self._encode if wanted is None else functools.partial(self._encode, wanted=wanted),
        )

    def _check_lengths(self, decision: DecisionRequest, wanted: Callable[[], bool]) -> None:
        """The contract's last check (every candidate within max_length, the token limit), with
        no worker to send the batches to; stops at the batch after the client left (a request of
        seconds of tokenizing was checked to its end for a caller long gone)."""
        try:
            for _ in self._batches(decision, wanted):
                pass
        except ContractError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
        except Abandoned as gone:
            raise Refused(grpc.StatusCode.CANCELLED, str(gone)) from None

    def _unary_request(
        self, decision: DecisionRequest, policy: PrefixPolicy | None, request_id: str, worker_span, wanted
    ) -> tuple[wire.ExecuteUnaryRequest, int]:
        """The whole request in one message, tokenized on this thread (through the same gate as
        the streams' batches) before anything is sent: a candidate that is too long is
        INVALID_ARGUMENT with no worker call at all."""
        request = wire.ExecuteUnaryRequest(header=self._header(decision, policy, request_id))
        num_tokens = 0
        tokenize_span = tracing.start("tokenize", parent=worker_span)
        try:
            for batch in self._batches(decision, wanted):
                num_tokens += worker_calls.add_candidates(request.candidates, batch)
        except ContractError as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
        except Abandoned as gone:
            raise Refused(grpc.StatusCode.CANCELLED, str(gone)) from None
        finally:
            tokenize_span.set_attribute("tokens", num_tokens)
            tokenize_span.end()
        return request, num_tokens

    def _stream(
        self,
        decision: DecisionRequest,
        policy: PrefixPolicy | None,
        request_id: str,
        refusal: list[str],
        token_count: list[int],
        tokenize_span,
        wanted: Callable[[], bool],
    ) -> Iterator[wire.ExecuteRequest]:
        """The Execute stream: header, each batch as it is tokenized, commit. A candidate found too
        long part-way ends it without a commit (into `refusal`), so the worker never runs it."""
        yield wire.ExecuteRequest(header=self._header(decision, policy, request_id))
        try:
            for batch in self._batches(decision, wanted):
                message = wire.ExecuteRequest()
                token_count[0] += worker_calls.add_candidates(message.batch.candidates, batch)
                yield message
        except ContractError as error:
            refusal.append(error.message)  # not the error: its traceback holds the frame that holds the list
            return
        except Abandoned:  # the client left, which cancelled the call: nothing more to send
            return
        finally:
            tokenize_span.set_attribute("tokens", token_count[0])
            tokenize_span.end()
        yield wire.ExecuteRequest(commit=wire.Commit())

    def _route(
        self,
        call: Callable,
        replayable: Callable[[], bool],
        ended_early: Callable[[], bool],
        decision: DecisionRequest,
        context,
        deadline: float,
        fields,
        route: _Routing,
    ):
        """`call(stub, extra_metadata, seconds)` on the channel the routing picks. With affinity,
        a request its context's worker refused unrun (queue full) goes once more, round-robin,
        if `replayable()` (never one that `ended_early()` on a contract error); a retry after
        that resend stays round-robin, so the full worker is not asked a third time."""

        def routed(chosen: tuple[str, str]) -> None:
            route.chosen = chosen
            fields["route"] = chosen[0]  # the request's log line says how it was routed

        def not_replayed() -> None:  # unless the stream ended on a contract error: that answers it
            if not ended_early():
                routed(routing.AFFINITY_NOT_REPLAYED)

        if not self.link.affinity or route.fallback is not None:
            routed(route.fallback or routing.ROUND_ROBIN)
            with self.link.traffic() as traffic:
                return call(traffic.stub, (), deadline - time.monotonic())
        key = routing.affinity_key(decision.state_text, self.affinity_prefix_bytes)
        routed(routing.AFFINITY)
        try:
            with self.link.traffic() as traffic:
                return call(traffic.affinity_stub, [(routing.AFFINITY_HEADER, key)], deadline - time.monotonic())
        except Refused as refused:
            if ended_early() or not (refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.unrun):
                raise
            if not replayable():  # asked after the batch being tokenized, which may end the stream early
                not_replayed()
                raise
            # The context's worker refused it unrun (queue full): once more, round-robin.
            route.fallback = routing.FALLBACK_QUEUE_FULL
            routed(routing.FALLBACK_QUEUE_FULL)
            remaining = deadline - time.monotonic()
            if not context.is_active():  # the client left: nothing to send again for
                raise Refused(grpc.StatusCode.CANCELLED, refused.message) from refused
            if remaining <= 0:
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, refused.message) from refused
            try:
                with self.link.traffic() as traffic:
                    return call(traffic.stub, (), remaining)
            except routing.NotReplayable:  # a batch tokenized since the check ended the stream early
                not_replayed()
                raise refused from None

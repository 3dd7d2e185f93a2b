"""Read and validate an Execute stream (header, candidate batches, commit) or an ExecuteUnary
request (header and candidates in one message, checked as a committed stream).

The worker trusts no caller: anyone who reaches its port can send any stream, so everything is
checked here as if the frontend did not exist, and nothing reaches the engine before the whole
stream is known valid (every check runs before the commit is accepted). Any violation raises
`BadStream` with a message naming what is wrong; the servicer answers it INVALID_ARGUMENT as
"malformed execute stream: {message}" (ExecuteUnary: "malformed execute request: {message}").

Checked, in stream order:
- the first message is a header, and there is only one; an empty message is an error;
- the prefix policy is UNSPECIFIED or one the ABI names;
- 1..max_questions questions; every kind is choice, score or noul; candidates per question as the
  contract allows (noul exactly 1, choice 1..255, score 2..10); at most max_candidates in all;
- each candidate: indices inside the header's shape, not sent twice; 1..max_length token ids,
  every id inside the tokenizer's range (specials included, padding rows of the embedding
  excluded); the running token total within max_tokens; then the worker's budget of held
  tokens (openjev.worker.held: QueueFull, answered RESOURCE_EXHAUSTED, as load, not a fault);
- at commit (for ExecuteUnary: in its one message): every candidate present.
The commit ends the reading: whatever a caller sends after it is not read, checked or answered
(the frontend half-closes right after its commit; a caller that keeps sending gets its first
request's answer alone).
Token ids are kept as array('I') (4 bytes an id), never as lists of Python ints (28+ bytes each).
"""

from __future__ import annotations

import heapq
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog

from openjev import abi, interceptors
from openjev.contract.literals import PREFIX_POLICIES, QuestionKind
from openjev.contract.request import MAX_CANDIDATES, MAX_CHOICE_CANDIDATES, MAX_SCORE_LEVELS, MIN_SCORE_LEVELS
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire

if TYPE_CHECKING:
    from openjev.worker.held import Hold

log = structlog.get_logger(__name__)

# Candidates per question by kind, as the request contract allows them.
CANDIDATES_PER_KIND: dict[QuestionKind, tuple[int, int]] = {
    "noul": (1, 1),
    "choice": (1, MAX_CHOICE_CANDIDATES),
    "score": (MIN_SCORE_LEVELS, MAX_SCORE_LEVELS),
}
_KNOWN_POLICIES = {api.PREFIX_POLICY_UNSPECIFIED, *(abi.policy_to_enum(p) for p in PREFIX_POLICIES)}


class BadStream(Exception):
    """The caller broke the Execute protocol or a limit; nothing is executed."""


@dataclass(frozen=True)
class StreamLimits:
    max_questions: int
    max_candidates: int = MAX_CANDIDATES
    max_length: int = 16384
    num_token_ids: int = 248320  # ids 0..num_token_ids-1 are valid
    max_tokens: int | None = None  # submitted tokens per request
    max_batch_candidates: int | None = None  # candidates per message (Describe states it)


@dataclass(frozen=True)
class Collected:
    header: wire.ExecuteHeader
    kinds: tuple[QuestionKind, ...]
    candidates: tuple[tuple[array, ...], ...]  # [question][candidate] -> array('I') of ids
    num_tokens: int


OnHeader = Callable[[wire.ExecuteHeader, tuple[QuestionKind, ...]], None]


def collect(
    messages: Iterable[wire.ExecuteRequest],
    limits: StreamLimits,
    hold: Hold | None = None,
    on_header: OnHeader | None = None,
) -> Collected | None:
    """Read the stream up to its commit. None when it ended without one (the frontend found the
    request invalid part-way through tokenizing, or the client went away). hold: the worker's
    budget of held tokens, taken from as candidates arrive (QueueFull when it is spent).
    on_header(header, kinds): once the header has passed its checks (what a later refusal of the
    call is logged and counted under)."""
    collector: _Collector | None = None
    for message in messages:
        item = message.WhichOneof("item")
        if item == "header":
            if collector is not None:
                raise BadStream("second header")
            collector = _Collector(message.header, limits, hold, on_header=on_header)
        elif item == "batch":
            if collector is None:
                raise BadStream("batch before header")
            collector.add(message.batch.candidates)
        elif item == "commit":
            if collector is None:
                raise BadStream("commit before header")
            return collector.finish("at commit")
        else:
            raise BadStream("empty message (no header, batch or commit)")
    return None


def collect_unary(
    request: wire.ExecuteUnaryRequest, limits: StreamLimits, hold: Hold | None = None, on_header: OnHeader | None = None
) -> Collected:
    """An ExecuteUnary request: its header and candidates, checked as a committed stream's."""
    if not request.HasField("header"):
        raise BadStream("no header")
    # the whole request is here: the budget keeps room for its own total, not the header's bound
    total = sum(len(candidate.token_ids) for candidate in request.candidates) if hold is not None else None
    collector = _Collector(request.header, limits, hold, total, on_header)
    collector.add(request.candidates)
    return collector.finish("")


class _Collector:
    """One request's candidates as they arrive, each checked against the header and the limits."""

    def __init__(
        self,
        header: wire.ExecuteHeader,
        limits: StreamLimits,
        hold: Hold | None,
        total: int | None = None,
        on_header: OnHeader | None = None,
    ):
        self.header = header
        self.kinds = _check_header(header, limits)
        if on_header is not None:
            on_header(header, self.kinds)
        self.limits = limits
        self.hold = hold
        if hold is not None:  # the most it may send: the room the budget keeps while it is the oldest arriving
            if total is None:
                total = sum(q.num_candidates for q in header.questions) * limits.max_length
                total = total if limits.max_tokens is None else min(total, limits.max_tokens)
            hold.expect(total)
        self.slots: list[list[array | None]] = [[None] * q.num_candidates for q in header.questions]
        self.missing = sum(q.num_candidates for q in header.questions)
        self.num_tokens = 0

    def add(self, candidates: Sequence[wire.Candidate]) -> None:
        limits, slots = self.limits, self.slots
        if limits.max_batch_candidates is not None and len(candidates) > limits.max_batch_candidates:
            raise BadStream(
                f"a message of {len(candidates)} candidates; the worker takes at most {limits.max_batch_candidates} "
                "a message (its Describe limits' max_batch_candidates)"
            )
        for candidate in candidates:
            q, c = candidate.question_index, candidate.candidate_index
            if q >= len(slots) or c >= len(slots[q]):
                raise BadStream(f"candidate ({q}, {c}) is outside the header's questions and candidates")
            if slots[q][c] is not None:
                raise BadStream(f"candidate ({q}, {c}) sent twice")
            # the length before any copy: an over-long candidate near the message limit would
            # otherwise cost ~40 bytes an id as Python ints before it is refused
            length = len(candidate.token_ids)
            if not 1 <= length <= limits.max_length:
                raise BadStream(f"candidate ({q}, {c}) has {length} tokens; expected 1 to {limits.max_length}")
            # one copy out of the message, checked there, then packed: protobuf's upb container
            # hands numpy its ids without a Python int each (0.02 against 1.5 ms for 34,000 ids
            # through a list)
            ids = np.asarray(candidate.token_ids, dtype=np.uintc)  # the C unsigned int of array("I")
            top = int(ids.max())
            if top >= limits.num_token_ids:
                raise BadStream(
                    f"candidate ({q}, {c}) has token id {top}, outside the tokenizer's "
                    f"range 0..{limits.num_token_ids - 1}"
                )
            self.num_tokens += length
            if limits.max_tokens is not None and self.num_tokens > limits.max_tokens:
                raise BadStream(f"request exceeds the worker's limit of {limits.max_tokens} tokens")
            if self.hold is not None:  # after every check: a request's own faults come first
                self.hold.take(length)
            packed = array("I")
            packed.frombytes(ids.tobytes())
            slots[q][c] = packed
            self.missing -= 1

    def finish(self, where: str) -> Collected:
        if self.missing:
            raise BadStream(" ".join(filter(None, [f"{self.missing} candidates missing", where])))
        candidates = tuple(tuple(ids for ids in question if ids is not None) for question in self.slots)
        if self.hold is not None:
            self.hold.arrived()
        return Collected(self.header, self.kinds, candidates, self.num_tokens)


def _check_header(header: wire.ExecuteHeader, limits: StreamLimits) -> tuple[QuestionKind, ...]:
    if header.prefix_policy not in _KNOWN_POLICIES:
        raise BadStream(f"unknown prefix policy {header.prefix_policy}")
    # the frontend sends its x-request-id here (at most 128 visible ASCII); the message limit
    # alone let a caller send 60 MB of it
    if header.request_id and not interceptors.valid_request_id(header.request_id):
        raise BadStream(f"request_id of {len(header.request_id)} characters is not 1-128 visible ASCII characters")
    if not 1 <= len(header.questions) <= limits.max_questions:
        raise BadStream(f"{len(header.questions)} questions; the worker takes 1 to {limits.max_questions}")
    kinds: list[QuestionKind] = []
    total = 0
    for index, question in enumerate(header.questions):
        try:
            kind = abi.kind_from_enum(question.kind)
        except KeyError:
            raise BadStream(f"question {index} has unknown kind {question.kind}") from None
        low, high = CANDIDATES_PER_KIND[kind]
        if not low <= question.num_candidates <= high:
            expected = "exactly 1" if low == high else f"{low} to {high}"
            raise BadStream(f"{kind} question {index} has {question.num_candidates} candidates; expected {expected}")
        total += question.num_candidates
        kinds.append(kind)
    if total > limits.max_candidates:
        raise BadStream(f"{total} candidates; the worker takes at most {limits.max_candidates}")
    return tuple(kinds)


class _Deadlines:
    """One daemon thread that calls each scheduled function at its time, unless cancelled first:
    a timer thread started per request would cost a thread start on every Execute.

    Every request schedules and cancels one deadline, so both are O(1) on the request path:
    cancelling forgets the function (the heap entry is dropped when it comes due), and the
    thread is woken only when a new deadline is earlier than every pending one (with one
    timeout for all, only when none is pending)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._pending: dict[int, Callable[[], None]] = {}  # scheduled and not cancelled
        self._next_id = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, seconds: float, fn: Callable[[], None]) -> int:
        with self._cond:
            self._next_id += 1
            entry = (time.monotonic() + seconds, self._next_id)
            heapq.heappush(self._heap, entry)
            self._pending[self._next_id] = fn
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="commit-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:  # the thread sleeps until an earlier deadline otherwise
                self._cond.notify()
            return self._next_id

    def cancel(self, handle: int) -> None:
        with self._cond:
            self._pending.pop(handle, None)
            # a cancelled deadline stays in the heap until due: with a long timeout that is every
            # stream's, so drop them once they outnumber the live ones
            if len(self._heap) > 2 * len(self._pending) + 1024:
                self._heap = [entry for entry in self._heap if entry[1] in self._pending]
                heapq.heapify(self._heap)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    # a wait beyond TIMEOUT_MAX raises (a huge --commit-timeout-seconds ended the thread)
                    wait = None if not self._heap else min(self._heap[0][0] - time.monotonic(), threading.TIMEOUT_MAX)
                    self._cond.wait(wait)
                _, handle = heapq.heappop(self._heap)
                fn = self._pending.pop(handle, None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # this thread times every stream's commit: it must not end
                    log.exception("commit_deadline_failed")


_deadlines = _Deadlines()


class CommitTimer:
    """Cancels a stream that has not committed within `seconds`: an Execute that never commits
    would otherwise hold its thread and call slot for as long as its caller likes."""

    def __init__(self, seconds: float | None, cancel):
        self.expired = False
        self._handle: int | None = None
        # the deadline thread may already hold `expire` when the stream commits and stops the
        # timer: one lock makes it either expired (and cancelled) or stopped, never cancelled late
        self._lock = threading.Lock()
        self._stopped = False
        if seconds:

            def expire() -> None:
                with self._lock:
                    if self._stopped:
                        return
                    self.expired = True
                cancel()

            self._handle = _deadlines.schedule(seconds, expire)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self._handle is not None:
            _deadlines.cancel(self._handle)

"""Context affinity: requests about the same context go to the same worker, whose cache then
holds that context's states.

The ring is gRPC's own `ring_hash` balancer on a second traffic channel (`WorkerLink`), keyed by
the `x-openjev-affinity` header this module computes: a hash of the request's state, its first
`prefix_bytes` UTF-8 bytes (every candidate prompt starts with the chat prefix, "Context:" and
the state, so those bytes are the leading tokens all of a request's candidates share, and an
agent's later, longer state keeps the same key). gRPC hashes the header onto the ring of the
workers whose health is SERVING and walks past ones that are down; a call no worker accepted is
tried again by the frontend (`DecisionServicer._execute`, gRPC's own retries are off) on the
round-robin channel: the ring would pick the same worker again, and one that refuses the call
(replaced by another export) stays on the ring while its health says SERVING. A call a worker
accepted and then refused with a full queue (`RESOURCE_EXHAUSTED`, before any result), or
refused part-way by its budget of held tokens (before the commit), ran nowhere: `Replay` keeps
the sent messages so that the frontend can send such a request once more, round-robin (what it
had not sent yet follows them).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Iterator

from openjev import metrics
from openjev.worker.v1 import worker_pb2 as wire

AFFINITY_HEADER = "x-openjev-affinity"
DEFAULT_PREFIX_BYTES = 4096
# grpcio 1.84 honours `requestHashHeader` only with this set (tested in
# tests/frontend/test_routing.py); without it every call fails INTERNAL "hash attribute not present".
# The variable is read when a channel parses its service config, so setting it here suffices.
REQUEST_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
# `ring_hash` is registered under this name in grpcio 1.84 (a plain "ring_hash" is unknown).
RING_HASH = {"ring_hash_experimental": {"requestHashHeader": AFFINITY_HEADER, "minRingSize": 1024}}
# A worker that takes TCP connections but never answers (stopped, black-holed) holds the calls
# sent to it while gRPC connects; this bounds that wait on both traffic channels (gRPC's default
# is 20 s).
CONNECT_TIMEOUT_MS = 3000
# What Replay may keep: per request and in all.
REPLAY_REQUEST_BYTES = 16 * 1024 * 1024
REPLAY_TOTAL_BYTES = 256 * 1024 * 1024

# Label values of metrics.frontend_routed_requests (route, reason).
AFFINITY = ("affinity", "context")
FALLBACK_QUEUE_FULL = ("fallback", "queue_full")
# the context's worker took no call (lost, or refusing this frontend's): retried round-robin
FALLBACK_NOT_ACCEPTED = ("fallback", "not_accepted")
AFFINITY_NOT_REPLAYED = ("affinity", "queue_full_not_replayable")
ROUND_ROBIN = ("round_robin", "affinity_off")
ROUTES = (AFFINITY, FALLBACK_QUEUE_FULL, FALLBACK_NOT_ACCEPTED, AFFINITY_NOT_REPLAYED, ROUND_ROBIN)


def enable_request_hash_header() -> None:
    os.environ[REQUEST_HASH_ENV] = "true"


def affinity_key(state_text: str, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> str:
    """16 hex digits from the state's first prefix_bytes UTF-8 bytes (gRPC hashes it again)."""
    # A character is at most 4 bytes: the first prefix_bytes characters cover the bytes needed.
    head = state_text[:prefix_bytes].encode("utf-8", "surrogatepass")[:prefix_bytes]
    return hashlib.blake2b(head, digest_size=8).hexdigest()


def record(route: tuple[str, str]) -> None:
    metrics.frontend_routed_requests.labels(*route).inc()


def declare_routes() -> None:
    """Every route at 0 from the start, so a rate over the series exists before the first fallback."""
    for route in ROUTES:
        metrics.frontend_routed_requests.labels(*route)


class ReplayBudget:
    """Bytes all requests' Replay buffers may hold together, so that many large requests at once
    cannot grow the frontend (a request that finds it spent is not replayed)."""

    def __init__(self, max_bytes: int):
        self._left = max_bytes
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n


class NotReplayable(Exception):
    """Replay.again() on a stream that cannot be sent again (Replay.replayable)."""


class Replay:
    """Passes an Execute request stream through and keeps its messages, up to max_bytes (and
    what `budget` has left), so that a request a worker refused before running it can be sent
    again without tokenizing again: `again()` gives what was kept, then what the source has not
    given yet (a worker's held-token budget refuses a stream part-way, before its commit).
    `replayable` unless something was not kept or the source ended without a commit (a contract
    error part-way: that is the answer). `close()` gives the bytes back; the servicer calls it
    when the request ends."""

    def __init__(self, source: Iterator[wire.ExecuteRequest], max_bytes: int, budget: ReplayBudget):
        self._source = source
        self._max_bytes = max_bytes
        self._budget = budget
        self._kept: list[wire.ExecuteRequest] = []
        self._bytes = 0
        self._overflow = False
        self._committed = False
        self._ended = False
        self._lock = threading.Lock()  # gRPC's sending thread fills it, the RPC thread closes it
        # Pulls from the source, one at a time: the refused call's sending thread may still be in
        # one when `again()` takes over; after that, that thread's iterator pulls nothing more.
        self._pulling = threading.Lock()
        self._generation = 0

    def __iter__(self) -> Iterator[wire.ExecuteRequest]:
        return self._pull(0)

    def _pull(self, generation: int) -> Iterator[wire.ExecuteRequest]:
        while True:
            with self._pulling:
                if generation != self._generation:  # a newer call took over the source
                    return
                message = next(self._source, None)
                if message is None:
                    self._ended = True
                    return
                self._keep(message)
                if message.WhichOneof("item") == "commit":
                    self._committed = True
            yield message

    def _keep(self, message: wire.ExecuteRequest) -> None:
        with self._lock:
            if self._overflow:
                return
            size = message.ByteSize()
            if self._bytes + size <= self._max_bytes and self._budget.take(size):
                self._bytes += size
                self._kept.append(message)
            else:
                self._drop()

    def _drop(self) -> None:
        self._overflow = True
        self._kept = []
        self._budget.give(self._bytes)
        self._bytes = 0

    def close(self) -> None:
        with self._lock:
            self._drop()

    @property
    def replayable(self) -> bool:
        """After a pull in progress: the batch being tokenized may end the stream on a contract
        error (then that is the answer, not a resend) or overflow what is kept."""
        with self._pulling:
            return self._can_replay()

    def _can_replay(self) -> bool:
        return not self._overflow and (self._committed or not self._ended)

    def again(self) -> Iterator[wire.ExecuteRequest]:
        """NotReplayable where a pull since `replayable` was asked made it so."""
        with self._pulling:  # after a pull the refused call's thread may be in
            if not self._can_replay():
                raise NotReplayable("this request stream cannot be replayed")
            self._generation += 1
            kept = list(self._kept)
        return itertools.chain(kept, self._pull(self._generation))

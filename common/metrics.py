"""Prometheus series of both servers, and the HTTP endpoint that serves them (`--metrics-port`).

Each process serves its own registry: the frontend's (`openjev_frontend_*`) or the worker's
(`openjev_worker_*`), plus the standard `process_*` / `python_*` series. Request series are
recorded by `openjev.interceptors` observers, never by the servicers. Labels are small closed
sets: `kind` is choice | score | noul | mixed (several kinds in one request) | unknown (refused
before the kinds were known); `outcome` is the gRPC status code name.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)

from openjev.interceptors import Observer, RequestInfo
from openjev.worker.v1 import worker_pb2 as wire

# Agents expect tens of milliseconds; long CPU-path or 16k-token requests reach seconds, and a
# call may run to the frontend's 120 s worker deadline (or a client's longer one).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# 65,536 candidates at 64 segments a pass take 1,024 passes
PASS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
CANDIDATE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 65536)


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


frontend_registry = _registry()
worker_registry = _registry()

# --- frontend -----------------------------------------------------------------------------
frontend_request_seconds = Histogram(
    "openjev_frontend_request_seconds",
    "Decide latency as the frontend serves it, by question kind and outcome",
    ["kind", "outcome"],
    buckets=LATENCY_BUCKETS_S,
    registry=frontend_registry,
)
frontend_in_flight_requests = Gauge(
    "openjev_frontend_in_flight_requests", "Decide calls being served now", registry=frontend_registry
)
frontend_input_tokens = Counter(
    "openjev_frontend_input_tokens",
    "Candidate tokens of answered requests (usage.input_tokens)",
    registry=frontend_registry,
)
frontend_saved_tokens = Counter(
    "openjev_frontend_saved_tokens",
    "Prefix tokens whose computation workers skipped, for answered requests",
    registry=frontend_registry,
)
frontend_request_candidates = Histogram(
    "openjev_frontend_request_candidates",
    "Candidates per answered request",
    buckets=CANDIDATE_BUCKETS,
    registry=frontend_registry,
)
frontend_worker_up = Gauge(
    "openjev_frontend_worker_up",
    "1 while the frontend sees this worker reachable, compatible and SERVING",
    ["worker"],
    registry=frontend_registry,
)
frontend_workers_serving = Gauge(
    "openjev_frontend_workers_serving", "Workers the frontend may send traffic to", registry=frontend_registry
)
# Recorded by openjev.frontend.routing, once per request that went to a worker (labels there).
frontend_routed_requests = Counter(
    "openjev_frontend_routed_requests",
    "Requests sent to workers, by the route that answered or failed them and why",
    ["route", "reason"],
    registry=frontend_registry,
)

# --- worker -------------------------------------------------------------------------------
worker_execute_seconds = Histogram(
    "openjev_worker_execute_seconds",
    "Execute latency in the worker from the call's first message (a stream still arriving, queue, inference), "
    "by question kind and outcome",
    ["kind", "outcome"],
    buckets=LATENCY_BUCKETS_S,
    registry=worker_registry,
)
worker_queue_seconds = Histogram(
    "openjev_worker_queue_seconds",
    "Time an executed request waited for its first forward pass",
    buckets=LATENCY_BUCKETS_S,
    registry=worker_registry,
)
worker_queue_depth = Gauge(
    "openjev_worker_queue_depth", "Requests admitted and not finished (waiting or in passes)", registry=worker_registry
)
worker_held_tokens = Gauge(
    "openjev_worker_held_tokens",
    "Candidate tokens held by calls from their first candidate to their answer (--max-held-tokens bounds it)",
    registry=worker_registry,
)
worker_pass_requests = Histogram(
    "openjev_worker_pass_requests",
    "Requests sharing one forward pass",
    buckets=SEQUENCE_BUCKETS,
    registry=worker_registry,
)
worker_passes_per_request = Histogram(
    "openjev_worker_passes_per_request",
    "Forward passes an executed request ran in",
    buckets=PASS_BUCKETS,
    registry=worker_registry,
)
worker_submitted_tokens = Counter(
    "openjev_worker_submitted_tokens", "Candidate tokens of answered requests", registry=worker_registry
)
worker_computed_tokens = Counter(
    "openjev_worker_computed_tokens",
    "Tokens the requests' plans compute, state-cache hits included (less the hit tokens: what the model ran)",
    registry=worker_registry,
)
worker_saved_tokens = Counter(
    "openjev_worker_saved_tokens", "Prefix tokens whose computation was skipped", registry=worker_registry
)
worker_launches = Counter("openjev_worker_launches", "Forward passes (packed batches) run", registry=worker_registry)
worker_launch_sequences = Histogram(
    "openjev_worker_launch_sequences",
    "Batch size: packed sequences per pass",
    buckets=SEQUENCE_BUCKETS,
    registry=worker_registry,
)
worker_launch_tokens = Histogram(
    "openjev_worker_launch_tokens", "Batch size: tokens per pass", buckets=TOKEN_BUCKETS, registry=worker_registry
)
# Incremented by the CUDA runner's graph cache; stays 0 on the CPU path.
graph_cache_hits = Counter(
    "openjev_worker_graph_cache_hits", "Launches replayed from a captured CUDA graph", registry=worker_registry
)
graph_cache_misses = Counter(
    "openjev_worker_graph_cache_misses", "Launches that needed a capture or ran uncaptured", registry=worker_registry
)


worker_state_cache_hit_tokens = Counter(
    "openjev_worker_state_cache_hit_tokens",
    "Tokens whose states came from the state cache (not computed), of answered requests",
    registry=worker_registry,
)
worker_state_cache_hits = Counter(
    "openjev_worker_state_cache_hits",
    "Answered requests that hung from at least one cached state",
    registry=worker_registry,
)
worker_state_cache_inserts = Counter(
    "openjev_worker_state_cache_inserts", "States put into the state cache", registry=worker_registry
)
worker_state_cache_evictions = Counter(
    "openjev_worker_state_cache_evictions", "States evicted from the state cache", registry=worker_registry
)
worker_state_cache_bytes = Gauge(
    "openjev_worker_state_cache_bytes", "Bytes of states the state cache holds", registry=worker_registry
)
worker_state_cache_budget_bytes = Gauge(
    "openjev_worker_state_cache_budget_bytes", "The state cache's byte budget (0: off)", registry=worker_registry
)


class StateCacheObserver:
    """The state cache's listener (openjev.worker.cache.store.CacheListener)."""

    def on_hit(self, tokens: int) -> None:
        worker_state_cache_hits.inc()
        worker_state_cache_hit_tokens.inc(tokens)

    def on_insert(self, nbytes: int) -> None:
        worker_state_cache_inserts.inc()

    def on_evict(self, count: int, nbytes: int) -> None:
        worker_state_cache_evictions.inc(count)


def kind_label(kinds: set[str]) -> str:
    if not kinds:
        return "unknown"
    return next(iter(kinds)) if len(kinds) == 1 else "mixed"


class FrontendObserver(Observer):
    """Decide: latency by kind and outcome, requests in flight, tokens of answered requests."""

    def on_start(self, info: RequestInfo) -> None:
        frontend_in_flight_requests.inc()

    def on_response(self, info: RequestInfo, message) -> None:
        info.response = message  # counted once the call ends OK: a caller that left got no answer

    def on_end(self, info: RequestInfo, outcome: str, seconds: float) -> None:
        frontend_in_flight_requests.dec()
        frontend_request_seconds.labels(kind_label(info.kinds), outcome).observe(seconds)
        message = info.response
        if outcome == "OK" and message is not None:
            frontend_input_tokens.inc(message.usage.input_tokens)
            frontend_saved_tokens.inc(message.metadata.prefix_cache.saved_tokens)
            frontend_request_candidates.observe(message.metadata.candidate_sequences)


class WorkerObserver(Observer):
    """Execute and ExecuteUnary: latency by kind and outcome; token counts of answered calls from
    the summary message (Execute) or reply (ExecuteUnary) they sent."""

    def on_response(self, info: RequestInfo, message) -> None:
        if isinstance(message, wire.ExecuteResponse) and message.WhichOneof("item") != "summary":
            return
        info.response = message.summary  # counted once the call ends answered (on_end)

    def on_end(self, info: RequestInfo, outcome: str, seconds: float) -> None:
        worker_execute_seconds.labels(kind_label(info.kinds), outcome).observe(seconds)
        s = info.response
        if outcome != "OK" or s is None:  # a caller gone before its answer got none
            return
        worker_submitted_tokens.inc(s.submitted_tokens)
        worker_computed_tokens.inc(s.computed_tokens)
        worker_saved_tokens.inc(s.saved_tokens)
        worker_queue_seconds.observe(s.queue_seconds)
        worker_passes_per_request.observe(s.num_launches)


def observe_pass(num_requests: int, num_tokens: int, seconds: float) -> None:
    """The scheduler's per-pass hook (tokens and sequences are counted by CountingRunner)."""
    worker_pass_requests.observe(num_requests)


class CountingRunner:
    """A model runner that records each launch's batch size, then delegates everything."""

    def __init__(self, runner: Any):
        self._runner = runner

    def run_launch(self, runs: Sequence[Any]):
        worker_launches.inc()
        worker_launch_sequences.observe(len(runs))
        worker_launch_tokens.observe(sum(len(run.token_ids) for run in runs))
        return self._runner.run_launch(runs)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def listen_host(listen: str) -> str:
    """The host part of a gRPC `--listen` address: metrics are served on the same interface."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"


# The metrics port: a thread a connection (prometheus_client's server), so each is bounded in
# time and in number: 1,000 idle connections held 1,000 threads for as long as they stayed open.
METRICS_IDLE_SECONDS = 10
MAX_METRICS_CONNECTIONS = 64


class _MetricsHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_SECONDS  # the socket's: a silent client is dropped after it

    def setup(self) -> None:
        super().setup()
        # and a whole connection gets as long: a byte every few seconds would pass the socket's
        # timeout forever (a scrape takes milliseconds)
        self._limit = threading.Timer(self.timeout or METRICS_IDLE_SECONDS, self._cut)
        self._limit.daemon = True
        self._limit.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._limit.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # scrapes are not worth a log line each (prometheus_client's handler is quiet too)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # the listen backlog (socketserver's default is 5)

    def __init__(self, address, handler) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # over the cap: closed at once
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a timeout or a reset: the client's doing
            super().handle_error(request, client_address)


def serve(registry: CollectorRegistry, listen: str, port: int, program: str):
    """Serve `registry` at http://HOST:port/metrics (HOST from `listen`); None when port is 0. A
    port it cannot listen on ends the program with one line, as the gRPC port does."""
    if port == 0:
        return None
    host = listen_host(listen)
    try:
        server = make_server(
            host, port, make_wsgi_app(registry), server_class=_MetricsServer, handler_class=_MetricsHandler
        )
    except OSError as error:
        raise SystemExit(f"{program}: cannot listen on {host}:{port} for metrics: {error.strerror or error}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server

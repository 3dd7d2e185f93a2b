"""The frontend's view of its workers: one load-balanced traffic channel, each worker's
self-description, and whether the frontend may send traffic (every reachable worker compatible:
same ABI version, same tokenizer, same max_length; at least one of them SERVING, and the
traffic channel connected).

Balancing and health are gRPC's own: round_robin over every address the target names, sending
only to workers whose `grpc.health.v1` status is SERVING. A `dns:///` name the frontend also
resolves each refresh (for its probes) and, when its addresses change, builds new traffic
channels: a new channel resolves at once, while gRPC re-resolves an old one only when a
connection drops, at most every 30 s and backing off to 120 s while the name fails (seen: a name
that resolved late served 30 s later, a worker added to it got no traffic for 75 s while its probe
said ok). The old channels close when their last call ends.

Failover is the frontend's (`DecisionServicer._execute`): a call that failed UNAVAILABLE before
its worker accepted it (the worker's response headers carry `abi.ACCEPTED_METADATA_KEY` once the
stream is committed) is tried again, round robin over the workers; after acceptance a
lost worker is UNAVAILABLE, never a second execution. gRPC's own retries are off: with them
(grpcio 1.84) a retried call that failed could report its status without ever completing its
pending reads, and grpcio's response iterator then waited for good, past every deadline
(docs/reliability.md).

With context affinity on, a second traffic channel balances the same workers with gRPC's
`ring_hash` instead (`openjev.frontend.routing`); the round-robin channel stays the one that
readiness is judged on and that a request is sent to again when its context's worker refused it
with a full queue or did not accept it."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openjev import abi, logs, metrics, serving
from openjev.frontend import routing
from openjev.frontend.worker_targets import parse_worker_targets
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

log = logs.get("openjev.frontend")

# The longest a probe (Describe, health Check) waits, at least: a busy worker on a loaded host can
# take longer than a short refresh period to answer, and one late answer marks it down for a whole
# period, refusing every request meanwhile (seen: the hostile soak, --worker-refresh-seconds 0.5,
# two shared cores). A worker that is gone fails its probe at once (connection refused).
MIN_PROBE_TIMEOUT_SECONDS = 2.0
# While the fleet is refused (FAILED_PRECONDITION: a worker of another model or checkpoint), the
# workers are described again at least this often: its end (that worker replaced or gone) comes
# with no READY while the traffic channel stays ready through the others, and the refusal lasted
# a whole --worker-refresh-seconds (7-20 s at 10-30 s in a review helper's run).
FLEET_RECHECK_SECONDS = 1.0


ROUND_ROBIN: dict = {"round_robin": {}}


def service_config(balancing: dict = ROUND_ROBIN) -> str:
    """`balancing` (round_robin, or routing.RING_HASH) over SERVING workers. No retryPolicy: see
    the module's docstring."""
    return json.dumps({"loadBalancingConfig": [balancing], "healthCheckConfig": {"serviceName": ""}})


def traffic_channel_options(balancing: dict = ROUND_ROBIN) -> list[tuple[str, object]]:
    return [
        *serving.channel_options(),
        ("grpc.service_config", service_config(balancing)),
        ("grpc.service_config_disable_resolution", 1),  # ours, not one from DNS TXT records
        ("grpc.enable_retries", 0),
        *serving.liveness_options(),
        ("grpc.keepalive_permit_without_calls", 1),
        # never idle: readiness below is this channel's connectivity, and an idle channel would
        # only reconnect for traffic that a not-ready frontend no longer receives
        ("grpc.client_idle_timeout_ms", 2**31 - 1),
        # gRPC's minimum connect timeout (the option's other meaning): routing.CONNECT_TIMEOUT_MS
        ("grpc.min_reconnect_backoff_ms", routing.CONNECT_TIMEOUT_MS),
    ]


def affinity_channel_options() -> list[tuple[str, object]]:
    return traffic_channel_options(routing.RING_HASH)


def _policy_name(value: int) -> str:
    try:
        return abi.policy_from_enum(value) or "unspecified"
    except KeyError:  # a newer worker's
        return f"policy {value}"


@dataclass(frozen=True)
class LinkState:
    """describe: a compatible worker's last answer (None: none yet), never an incompatible one's.
    problem: why requests are refused (None: traffic may flow). workers: each known worker -> its
    problem (None: usable). execute_unary: every worker that answered Describe serves
    ExecuteUnary (a request may land on any of them). weights: their weights fingerprint where
    every one gave it ("" where one is from before it: the expected digest is then the one such a
    worker computes, which the newer ones accept too)."""

    describe: wire.DescribeResponse | None
    problem: str | None
    status: grpc.StatusCode
    workers: tuple[tuple[str, str | None], ...] = ()
    execute_unary: bool = False
    weights: str = ""

    @functools.cached_property
    def expected_fleet(self) -> str | None:
        """What every worker call expects its worker to have agreed on (the expect-fleet header),
        computed once a state, not once a call; None before any worker was described."""
        return None if self.describe is None else _fleet(self.describe, self.weights)


def _fleet(d: wire.DescribeResponse, weights: str) -> str:
    """The expect-fleet digest of workers that answer d with that weights fingerprint."""
    return abi.expected_fleet(d.checkpoint_revision, d.default_prefix_policy, weights)


def _weights(answers: list) -> str:
    """The described workers' weights fingerprint (they agree), or "" where one is from before it."""
    described = [d for d, _p, _r in answers if d is not None]
    return described[0].weights_fingerprint if described and all(d.weights_fingerprint for d in described) else ""


def _channel(target: str, options: list, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def _when_ready(channel: grpc.Channel, callback: Callable[[grpc.ChannelConnectivity], None], on_ready) -> Callable:
    """callback on every connectivity change, then on_ready() each time the channel becomes READY
    (it keeps connecting: subscribed with try_to_connect); returns what to unsubscribe."""
    last: grpc.ChannelConnectivity | None = None

    def changed(connectivity: grpc.ChannelConnectivity) -> None:
        nonlocal last
        callback(connectivity)
        if connectivity == grpc.ChannelConnectivity.READY != last:
            on_ready()
        last = connectivity

    channel.subscribe(changed, try_to_connect=True)
    return changed


class _Probe:
    """One worker's own channel, for Describe and Health.Check (never for traffic)."""

    def __init__(
        self,
        endpoint: str,
        credentials: grpc.ChannelCredentials | None = None,
        options: list | None = None,
        on_ready: Callable[[], None] = lambda: None,
    ):
        self.channel = _channel(
            endpoint,
            [
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", serving.MAX_RECONNECT_BACKOFF_MS),
                *(options or []),
            ],
            credentials,
        )
        self.worker = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        _when_ready(self.channel, lambda connectivity: None, on_ready)


class _Traffic:
    """The traffic channels built at one time (round robin; ring_hash with affinity), and the
    calls on them: once replaced (`retire`) they close when the last call ends."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None,
        tls_options: list,
        affinity: bool,
        on_ready: Callable[[], None],
    ):
        self.channel = _channel(target, [*traffic_channel_options(), *tls_options], credentials)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        # Context affinity: the same workers on a ring_hash channel. It connects to a worker only
        # when a call is hashed to it, so readiness stays the round-robin channel's.
        self.affinity_channel: grpc.Channel | None = None
        self.affinity_stub: worker_pb2_grpc.WorkerServiceStub | None = None
        if affinity:
            self.affinity_channel = _channel(target, [*affinity_channel_options(), *tls_options], credentials)
            self.affinity_stub = worker_pb2_grpc.WorkerServiceStub(self.affinity_channel)
        self.connectivity = grpc.ChannelConnectivity.IDLE
        self.ready = threading.Event()
        self._calls = 0
        self._retired = False
        self._lock = threading.Lock()
        self._subscribed = _when_ready(self.channel, self._on_connectivity, on_ready)

    def _on_connectivity(self, connectivity: grpc.ChannelConnectivity) -> None:
        self.connectivity = connectivity
        if connectivity == grpc.ChannelConnectivity.READY:
            self.ready.set()

    def enter(self) -> None:
        with self._lock:
            self._calls += 1

    def leave(self) -> None:
        with self._lock:
            self._calls -= 1
            last = self._retired and self._calls == 0
        if last:
            self.close()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            idle = self._calls == 0
        if idle:
            self.close()

    def close(self) -> None:
        self.channel.unsubscribe(self._subscribed)
        self.channel.close()
        if self.affinity_channel is not None:
            self.affinity_channel.close()


class WorkerLink:
    def __init__(
        self,
        target: str,
        *,
        fingerprint: str,
        max_length: int,
        model_id: str = "",
        temperature: float | None = None,
        max_questions: int = 0,
        max_candidates: int = 0,
        max_request_tokens: int = 0,
        refresh_seconds: float = 2.0,
        on_state: Callable[[LinkState], None] = lambda state: None,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
        affinity: bool = False,
    ):
        self.target = target
        self.targets = parse_worker_targets(target)
        self._on_state = on_state
        self._credentials = credentials
        # The name the workers' certificates carry, when it is not the address dialled (an IP).
        self._tls_options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        self.affinity = affinity
        if affinity:
            routing.enable_request_hash_header()
        # The workers the probes describe: a name's last addresses that resolved. A failed lookup
        # keeps them, as gRPC's resolver keeps a channel's (a DNS hiccup of a second refused every
        # request for a refresh period and rebuilt both traffic channels, which stayed connected
        # throughout); workers gone for good fail their probes.
        self._endpoints: list[str] = self.targets.endpoints() or []
        self._lookup_failed = False
        # A name's addresses when the traffic channels were built, as the probes saw them (None: IPs).
        self._resolved = None if self.targets.fixed is not None else frozenset(self._endpoints)
        # The probes answer on their own channels; after a worker restarts they can say SERVING
        # while the traffic channel still waits out its reconnect backoff, so readiness needs both.
        # A link state computed while a channel was still connecting says UNAVAILABLE ("its
        # connection is idle", or the probe's Describe failed): a channel's READY, the traffic's or
        # a probe's, asks for a refresh at once, not a period later (600 s in a test, where the
        # first requests were refused all that time).
        self._wake = threading.Event()  # the next refresh now: close(), or refresh_soon()
        self._traffic = _Traffic(
            self.targets.traffic_target, credentials, self._tls_options, affinity, self.refresh_soon
        )
        self._traffic_lock = threading.Lock()  # a call taking the channels against their swap
        self._fingerprint = fingerprint
        self._max_length = max_length
        self._model_id = model_id
        self._temperature = temperature
        self._max_questions = max_questions
        self._max_candidates = max_candidates
        self._max_request_tokens = max_request_tokens
        self._refresh_seconds = refresh_seconds
        self._probe_timeout = max(refresh_seconds, MIN_PROBE_TIMEOUT_SECONDS)
        self._state = LinkState(None, f"worker at {target} has not answered yet", grpc.StatusCode.UNAVAILABLE)
        self._served: LinkState | None = None  # the last state that served: what the workers agreed on then
        self._probes: dict[str, _Probe] = {}
        self._probes_lock = threading.Lock()  # refresh (the link's thread) against close
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="worker-probe")
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> LinkState:
        return self._state

    def start(self) -> None:
        """Describe now and then every refresh_seconds, so a restarted, added or replaced worker
        is checked before traffic depends on it."""
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="worker-link", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def traffic(self) -> Iterator[_Traffic]:
        """The traffic channels, for one call: channels replaced meanwhile stay open until it ends."""
        with self._traffic_lock:
            traffic = self._traffic
            traffic.enter()
        try:
            yield traffic
        finally:
            traffic.leave()

    def _follow(self, endpoints: list[str]) -> None:
        """New traffic channels when a name's addresses changed (see the module's docstring),
        swapped in once connected or after a probe timeout: readiness does not drop meanwhile."""
        resolved = frozenset(endpoints)
        if self._resolved is None or resolved == self._resolved:
            return
        self._resolved = resolved
        if not resolved:  # nothing to connect to; the addresses coming back, even the same, rebuild
            return
        new = _Traffic(
            self.targets.traffic_target, self._credentials, self._tls_options, self.affinity, self.refresh_soon
        )
        new.ready.wait(self._probe_timeout)
        with self._traffic_lock:
            if self._stop.is_set():  # closed meanwhile
                new.close()
                return
            old, self._traffic = self._traffic, new
        old.retire()
        log.info("worker_channels", target=self.target, addresses=sorted(resolved))

    def refresh_soon(self) -> None:
        """Describe the workers now, not at the next period: a call was refused before any worker
        accepted it (one died, or was replaced by another that refuses this frontend's calls)."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._traffic_lock:
            self._traffic.close()
        # a refresh running now (a dns:/// target's addresses changing) adds no probe after this
        with self._probes_lock:
            probes, self._probes = list(self._probes.values()), {}
        for probe in probes:
            probe.channel.close()
        self._pool.shutdown(wait=False)

    def refresh(self) -> LinkState:
        found = self.targets.endpoints()
        if found is None and not self._lookup_failed and self._endpoints:  # once, not every period
            log.warning("worker_lookup_failed", target=self.target, keeping=self._endpoints)
        self._lookup_failed = found is None
        self._endpoints = endpoints = self._endpoints if found is None else found
        with self._probes_lock:
            if self._stop.is_set():
                return self._state
            gone = {endpoint: self._probes.pop(endpoint) for endpoint in set(self._probes) - set(endpoints)}
            for endpoint in endpoints:
                if endpoint not in self._probes:
                    self._probes[endpoint] = _Probe(endpoint, self._credentials, self._tls_options, self.refresh_soon)
            probes = [self._probes[endpoint] for endpoint in endpoints]
        for endpoint, probe in gone.items():
            probe.channel.close()
            try:
                metrics.frontend_worker_up.remove(endpoint)
            except KeyError:
                pass
        self._follow(endpoints)
        answers = list(self._pool.map(self._check, endpoints, probes))
        state = self._combine(endpoints, answers)
        for endpoint, (_describe, problem, _reachable) in zip(endpoints, answers, strict=True):
            metrics.frontend_worker_up.labels(endpoint).set(0 if problem else 1)
        # none while the link refuses traffic (an incompatible worker among them, the channel not
        # ready): the gauge is the workers requests may go to, which is none then
        serving = sum(problem is None for _d, problem, _r in answers)
        metrics.frontend_workers_serving.set(0 if state.problem else serving)
        if state.problem != self._state.problem or state.workers != self._state.workers:
            log.info(
                "worker_link",
                target=self.target,
                problem=state.problem,
                workers={endpoint: problem or "ok" for endpoint, problem in state.workers},
            )
        with self._state_lock:
            self._state = state
            if state.status == grpc.StatusCode.OK:
                self._served = state
        self._on_state(state)
        return state

    def note_no_execute_unary(self) -> None:
        """A worker answered ExecuteUnary UNIMPLEMENTED (replaced by an older one since the last
        Describe): streams only, until the next refresh finds every worker serving it again."""
        with self._state_lock:
            self._state = replace(self._state, execute_unary=False)

    def _check(self, endpoint: str, probe: _Probe) -> tuple[wire.DescribeResponse | None, str | None, bool]:
        """(describe, problem, reachable) of one worker; reachable without a description: not a
        worker at all."""
        try:
            describe = probe.worker.Describe(wire.DescribeRequest(), timeout=self._probe_timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:  # something answers there, not a worker
                return None, f"worker at {endpoint} is not an Open-Jev worker (Describe is UNIMPLEMENTED)", True
            return None, f"worker at {endpoint} is unavailable: {error.code().name}", False
        problem = self._incompatibility(endpoint, describe)
        if problem is None:
            try:
                reply = probe.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._probe_timeout)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    problem = f"worker at {endpoint} is not serving"
            except grpc.RpcError as error:
                # As gRPC's own client-side health checking: a worker without the health
                # service counts as healthy; any other failure as not serving.
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    problem = f"worker at {endpoint} health check failed: {error.code().name}"
        return describe, problem, True

    def _combine(self, endpoints: list[str], answers: list) -> LinkState:
        workers = tuple((endpoint, problem) for endpoint, (_d, problem, _r) in zip(endpoints, answers, strict=True))
        # A reachable incompatible worker could receive traffic: refuse everything until it is
        # gone or replaced, rather than answer some requests with another model or tokenizer.
        # Its description is never this frontend's (DescribeModel): keep the last compatible one.
        for endpoint, (describe, problem, reachable) in zip(endpoints, answers, strict=True):
            if reachable and (describe is None or self._incompatibility(endpoint, describe) is not None):
                return LinkState(self._state.describe, problem, grpc.StatusCode.FAILED_PRECONDITION, workers)
        # Workers of one model id, tokenizer and temperature but two checkpoints (a retrained head)
        # would answer each request by whichever one it reached: the same request alternated
        # between two answers. Whichever checkpoint the workers hold, they must hold the same one
        # (not necessarily this frontend's export's: a benchmark's workers hold synthetic weights).
        # Likewise a request without a policy: run `auto` by one worker and `off` by another, its
        # answer and its prefix_cache metadata would depend on where it landed.
        reached = [
            (endpoint, d)
            for endpoint, (d, _p, reachable) in zip(endpoints, answers, strict=True)
            if reachable and d is not None
        ]
        for disagreement, value in (
            ("serve different checkpoint revisions", lambda d: repr(d.checkpoint_revision)),
            ("have different default prefix policies", lambda d: _policy_name(d.default_prefix_policy)),
            # one revision, another config.json or head (a worker from before the field: not compared)
            ("serve different weights (config.json or head) under one revision", lambda d: d.weights_fingerprint),
        ):
            values = {endpoint: shown for endpoint, describe in reached if (shown := value(describe))}
            if len(set(values.values())) > 1:
                named = ", ".join(f"{endpoint} {shown}" for endpoint, shown in sorted(values.items()))
                problem = f"workers at {self.target} {disagreement}: {named}"
                return LinkState(self._state.describe, problem, grpc.StatusCode.FAILED_PRECONDITION, workers)
        if changed := self._changed_while_away(endpoints, answers, reached):
            return LinkState(self._state.describe, changed, grpc.StatusCode.FAILED_PRECONDITION, workers)
        for describe, problem, _reachable in answers:
            if problem is None:
                connectivity = self._traffic.connectivity
                if connectivity != grpc.ChannelConnectivity.READY:
                    return LinkState(
                        describe,
                        f"worker at {self.target} is serving; this frontend's connection to it "
                        f"is {connectivity.name.lower()}",
                        grpc.StatusCode.UNAVAILABLE,
                        workers,
                    )
                unary = all(d.execute_unary for d, _p, _r in answers if d is not None)
                return LinkState(
                    describe, None, grpc.StatusCode.OK, workers, execute_unary=unary, weights=_weights(answers)
                )
        if not answers:
            problem = f"worker at {self.target} is unavailable: no address resolved"
        elif len(answers) == 1:
            problem = answers[0][1]
        else:
            problem = f"no worker at {self.target} is serving: " + "; ".join(p for _d, p, _r in answers)
        return LinkState(self._state.describe, problem, grpc.StatusCode.UNAVAILABLE, workers)

    def _changed_while_away(self, endpoints: list[str], answers: list, reached: list) -> str | None:
        """Why the workers that answer may not serve yet (None: they may): they agree on another
        checkpoint, default policy or weights than the fleet served before, while a worker of it
        cannot be reached. Those alone would become the fleet (a worker restarted with another
        export while the other was down answered in the model's name), and then, once the other
        came back, the fleet would disagree: another checkpoint is served once every worker
        answers (or the unreachable ones leave the --worker list or DNS)."""
        away = [endpoint for endpoint, (_d, _p, reachable) in zip(endpoints, answers, strict=True) if not reachable]
        served = self._served
        if not away or not reached or served is None or served.describe is None:
            return None
        first = reached[0][1]
        if _fleet(first, _weights(answers)) == served.expected_fleet:
            return None
        return (
            f"workers at {self.target} answer with revision {first.checkpoint_revision!r} (or another default "
            f"policy or weights) where the fleet served {served.describe.checkpoint_revision!r}, and "
            f"{', '.join(sorted(away))} cannot be reached: another checkpoint is served only once every worker answers"
        )

    def _incompatibility(self, endpoint: str, d: wire.DescribeResponse) -> str | None:
        """Why that worker cannot serve this frontend (None: it can), naming it: one of several
        workers is the wrong one."""
        worker = f"worker at {endpoint}"
        if d.abi_version != abi.ABI_VERSION:
            return (
                f"{worker} has ABI version {d.abi_version}, which does not match this frontend's "
                f"ABI version {abi.ABI_VERSION}"
            )
        if d.tokenizer_fingerprint != self._fingerprint:
            return (
                f"{worker} has tokenizer fingerprint {d.tokenizer_fingerprint[:16]}, which does not match "
                f"this frontend's {self._fingerprint[:16]}"
            )
        if d.max_length != self._max_length:
            return f"{worker} has max_length {d.max_length}, which does not match this frontend's {self._max_length}"
        # Answers carry this frontend's model id and temperature: another model's (the same
        # tokenizer, another head) would be answers under the wrong name.
        if self._model_id and d.model_id != self._model_id:
            return f"{worker} serves model {d.model_id!r}, not this frontend's {self._model_id!r}"
        if self._temperature is not None and d.temperature != self._temperature:
            return f"{worker} has temperature {d.temperature}, which does not match this frontend's {self._temperature}"
        # A request this frontend accepts must fit the worker: else it would fail part-way.
        if d.limits.max_questions < self._max_questions:
            return (
                f"{worker} accepts at most {d.limits.max_questions} questions per request, fewer than this "
                f"frontend's --max-questions {self._max_questions}"
            )
        if d.limits.max_candidates < self._max_candidates:
            return (
                f"{worker} accepts at most {d.limits.max_candidates} candidates per request, fewer than this "
                f"frontend's --max-candidates {self._max_candidates}"
            )
        # 0: not stated. This frontend sends batches of abi.BATCH_CANDIDATES: a worker that takes
        # fewer a message would refuse every request of more candidates than its limit
        if 0 < d.limits.max_batch_candidates < abi.BATCH_CANDIDATES:
            return (
                f"{worker} accepts at most {d.limits.max_batch_candidates} candidates per message, fewer than "
                f"the {abi.BATCH_CANDIDATES} this frontend sends"
            )
        # 0: a worker that does not state its token limit (built before the field); its refusals
        # of a too-long request still reach the client, as INTERNAL
        if 0 < d.limits.max_request_tokens < self._max_request_tokens:
            return (
                f"{worker} accepts at most {d.limits.max_request_tokens} tokens per request, fewer than this "
                f"frontend's --max-request-tokens {self._max_request_tokens}"
            )
        return None

    def _loop(self) -> None:
        while True:
            refused = self._state.status == grpc.StatusCode.FAILED_PRECONDITION
            self._wake.wait(min(self._refresh_seconds, FLEET_RECHECK_SECONDS) if refused else self._refresh_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            # close() meanwhile shut the probe pool (RuntimeError) or closed a probe's channel
            # before its call started (ValueError: not a grpc.RpcError)
            except (RuntimeError, ValueError):
                if not self._stop.is_set():
                    raise

"""Context affinity pieces: the key, the replay buffer, and gRPC's ring_hash balancer with the
frontend's own service config, over three real in-process gRPC servers that answer their name
(the balancing is gRPC's; the three-worker test in tests/test_affinity_routing.py runs the rest)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from openjev.contract.request import parse_request_json
from openjev.frontend import routing
from openjev.frontend.main import affinity_on
from openjev.frontend.worker_link import affinity_channel_options
from openjev.worker.v1 import worker_pb2 as wire

BASE = "A customer says: I was charged twice. " * 200
# blake2b, 8-byte digest, of the leading bytes: fixed across processes, hosts and releases. Every
# frontend must route one state to one worker, so the key may not change (a salted `hash()`, or
# another digest, would send a rolled frontend's requests to other workers than the old ones').
GOLDEN_KEYS = [
    ((BASE,), "2359864e3f556d29"),
    (("short",), "1861d0984ace92d1"),
    (("€" * 30, 60), "521459ecc5d47938"),
]


@pytest.mark.parametrize(("args", "key"), GOLDEN_KEYS)
def test_key_is_a_fixed_digest(args, key):
    assert routing.affinity_key(*args) == key


def test_frontend_processes_agree_on_the_key():
    """Two frontends (processes with different hash seeds) route one state to one worker."""
    code = "import sys; from openjev.frontend import routing; print(routing.affinity_key(sys.stdin.read()))"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            input=BASE,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert keys == {routing.affinity_key(BASE)}


def test_key_is_the_states_leading_bytes():
    # An agent's state that grew keeps its worker; another state gets another key.
    assert routing.affinity_key(BASE + "Later: and again.") == routing.affinity_key(BASE)
    assert routing.affinity_key("B" + BASE) != routing.affinity_key(BASE)
    assert routing.affinity_key("short") != routing.affinity_key("short!")
    assert routing.affinity_key(BASE, 64) == routing.affinity_key(BASE[:64] + "anything", 64)
    # Bytes, not characters: a 3-byte character counts three.
    assert routing.affinity_key("€" * 30, 60) == routing.affinity_key("€" * 20 + "x", 60)


def test_requests_about_one_state_share_the_key_whatever_they_ask():
    def decision(state, question):
        body = {"state": state, "questions": {"q": {"type": "noul", "instructions": question}}}
        return parse_request_json(json.dumps(body), accepted_models=frozenset({"m"}))

    one, two = decision({"log": [1, 2]}, "Is it done?"), decision({"log": [1, 2]}, "Did it fail?")
    assert one.state_text == two.state_text == '{"log": [1, 2]}'
    assert routing.affinity_key(one.state_text) == routing.affinity_key(two.state_text)


def messages(n: int, commit: bool = True):
    yield wire.ExecuteRequest(header=wire.ExecuteHeader(request_id="r"))
    for i in range(n):
        batch = wire.ExecuteRequest()
        batch.batch.candidates.add(question_index=0, candidate_index=i, token_ids=list(range(100)))
        yield batch
    if commit:
        yield wire.ExecuteRequest(commit=wire.Commit())


def test_replay_sends_the_same_messages_again_unless_the_source_ended_without_a_commit():
    budget = routing.ReplayBudget(1 << 20)
    replay = routing.Replay(messages(3), 1 << 20, budget)
    sent = list(replay)
    assert replay.replayable and list(replay.again()) == sent and len(sent) == 5
    cut = routing.Replay(messages(3, commit=False), 1 << 20, budget)  # a contract error part-way
    list(cut)
    assert not cut.replayable
    with pytest.raises(routing.NotReplayable):
        cut.again()
    large = routing.Replay(messages(3), 300, budget)  # each batch is over 100 bytes
    assert list(large) == sent
    assert not large.replayable


def test_a_stream_refused_part_way_is_sent_again_whole():
    """A worker's held-token budget refuses a stream before its commit: `again()` sends what went
    out, then the rest of the source, each message once; the refused call's iterator pulls no more."""
    replay = routing.Replay(messages(3), 1 << 20, routing.ReplayBudget(1 << 20))
    first = iter(replay)
    sent = [next(first), next(first)]  # the worker refused the call here
    assert replay.replayable
    resend = replay.again()
    assert next(first, None) is None  # the refused call's iterator takes nothing from the resend
    assert list(resend) == list(messages(3)) and sent == list(messages(3))[:2]


def test_a_pull_in_progress_when_the_call_was_refused_is_sent_again():
    """The refused call's sending thread may be inside a pull (tokenizing a batch) when the resend
    starts: the resend waits for it and sends its message, in order, once."""
    pulling, release = threading.Event(), threading.Event()

    def slow():
        for index, message in enumerate(messages(3)):
            if index == 2:
                pulling.set()
                assert release.wait(10)
            yield message

    replay = routing.Replay(slow(), 1 << 20, routing.ReplayBudget(1 << 20))
    first = iter(replay)
    old = [next(first), next(first)]
    late: list = []
    sender = threading.Thread(target=lambda: late.append(next(first)))  # the refused call's last pull
    sender.start()
    assert pulling.wait(10)
    resent: list = []
    resender = threading.Thread(target=lambda: resent.extend(replay.again()))
    resender.start()
    time.sleep(0.2)
    assert not resent  # waiting for the pull in progress
    release.set()
    sender.join(10)
    resender.join(10)
    assert old + late == list(messages(3))[:3] and resent == list(messages(3))


def test_replays_share_one_budget_and_give_it_back():
    size = sum(m.ByteSize() for m in messages(3))
    budget = routing.ReplayBudget(size + size // 2)
    first, second = (routing.Replay(messages(3), 1 << 20, budget) for _ in range(2))
    list(first)
    list(second)
    assert first.replayable and not second.replayable  # the second found the budget spent
    first.close()
    second.close()
    third = routing.Replay(messages(3), 1 << 20, budget)
    list(third)
    assert third.replayable and not first.replayable


def test_affinity_defaults_to_on_unless_one_fixed_worker():
    assert affinity_on("auto", "127.0.0.1:1,127.0.0.1:2")
    assert affinity_on("auto", "dns:///worker:50052")
    assert not affinity_on("auto", "127.0.0.1:1")
    assert not affinity_on("off", "127.0.0.1:1,127.0.0.1:2")
    assert affinity_on("on", "127.0.0.1:1")


class Named:
    """A gRPC server with health that answers /t.T/Who with its name."""

    def __init__(self, name: str):
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handler = grpc.method_handlers_generic_handler(
            "t.T", {"Who": grpc.unary_unary_rpc_method_handler(lambda request, context: name.encode())}
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.set(True)

    def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)


@pytest.fixture
def named():
    servers = [Named(f"w{i}") for i in range(3)]
    yield servers
    for s in servers:
        s.server.stop(0)


def ring_channel(servers, ports=()) -> grpc.Channel:
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in [*(s.port for s in servers), *ports])
    return grpc.insecure_channel(target, options=affinity_channel_options())


def who(channel: grpc.Channel, key: str, timeout: float = 5.0) -> str:
    call = channel.unary_unary("/t.T/Who")
    try:
        return call(b"", metadata=[(routing.AFFINITY_HEADER, key)], timeout=timeout).decode()
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"


def wait_until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_ring_hash_keeps_keys_on_one_server_and_moves_only_a_lost_servers_keys(named, monkeypatch):
    monkeypatch.delenv(routing.REQUEST_HASH_ENV, raising=False)
    routing.enable_request_hash_header()
    keys = [f"context-{i}" for i in range(30)]
    with ring_channel(named) as channel:
        first = {key: who(channel, key) for key in keys}
        assert set(first.values()) == {"w0", "w1", "w2"}, first  # spread over all three
        assert {key: who(channel, key) for key in keys} == first  # and stable

        # NOT_SERVING (draining, loading) is off the ring; only its keys move, and come back.
        named[0].set(False)
        assert wait_until(lambda: "w0" not in {who(channel, k) for k in keys})
        moved = {key: who(channel, key) for key in keys}
        assert all(moved[k] == first[k] for k in keys if first[k] != "w0")
        named[0].set(True)
        assert wait_until(lambda: {key: who(channel, key) for key in keys} == first)

        # A server that is gone: its keys go to the others at once, the rest stay. Gone means
        # stopped: a call sent while its shutdown is still under way may meet the GOAWAY itself
        # (UNAVAILABLE, "Stream removed").
        named[1].server.stop(0).wait()
        gone = {key: who(channel, key) for key in keys}
        assert set(gone.values()) <= {"w0", "w2"}, gone
        assert all(gone[k] == first[k] for k in keys if first[k] != "w1")


def test_ring_hash_header_needs_the_environment_variable(named, monkeypatch):
    """Why routing sets REQUEST_HASH_ENV: grpcio 1.84 ignores requestHashHeader without it (and
    a plain "ring_hash" policy name is unknown). Should this fail after a grpcio upgrade, the
    variable (or the policy name) is no longer needed: update routing.py."""
    monkeypatch.delenv(routing.REQUEST_HASH_ENV, raising=False)
    with ring_channel(named) as channel:
        assert who(channel, "k") == "INTERNAL: hash attribute not present"


def test_a_server_that_never_answers_holds_its_keys_for_the_connect_timeout_only(named, monkeypatch):
    """A listening socket that never speaks HTTP/2 (a stopped worker, a black-holed host): the
    calls hashed to it wait while gRPC connects (20 s by default), then go to the others."""
    monkeypatch.delenv(routing.REQUEST_HASH_ENV, raising=False)
    routing.enable_request_hash_header()
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        keys = [f"context-{i}" for i in range(30)]
        with ring_channel(named[:2], [hole.getsockname()[1]]) as channel, futures.ThreadPoolExecutor(30) as pool:
            started = time.monotonic()
            answers = list(pool.map(lambda key: who(channel, key, timeout=15), keys))
            seconds = time.monotonic() - started
    assert set(answers) == {"w0", "w1"}, answers
    limit = routing.CONNECT_TIMEOUT_MS / 1000
    assert limit <= seconds < limit + 2.0, seconds  # some keys did wait for the hole, not longer

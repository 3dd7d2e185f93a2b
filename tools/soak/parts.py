"""The hostile mix's threads, beside the clients: idle streams on both ports, oversized requests,
cancellations and short deadlines, and kill -9 of the worker. Each loop records its requests'
outcomes in the shared Run (run.py) and ends when the run's `stop` is set."""

from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev.client import Client, response_to_json
from openjev.tools.soak.outcomes import Outcome
from openjev.tools.soak.workload import MEDIUM, comparable, tagged, tagged_answer
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

if TYPE_CHECKING:
    from openjev.tools.soak.run import Run


def hostile_threads(run: Run, public: grpc.Channel) -> list[threading.Thread]:
    """The threads of the run's hostile parts (none without a mix), not started; idle streams on
    the public port use the channel `public`."""
    extra: list[threading.Thread] = []
    hostile, parts = run.hostile, run.parts
    if hostile and "idle" in parts:
        health = health_pb2_grpc.HealthStub(public)
        reflection = reflection_pb2_grpc.ServerReflectionStub(public)
        long = run.duration + run.bound + 60
        for _ in range(hostile.watch_streams):
            opener = functools.partial(health.Watch, health_pb2.HealthCheckRequest(), timeout=long)
            extra.append(threading.Thread(target=idle_stream, args=(run, "idle_watch", opener), daemon=True))
        for _ in range(hostile.reflection_streams):
            first = reflection_pb2.ServerReflectionRequest(list_services="")
            opener = functools.partial(reflection.ServerReflectionInfo, _blocked(first, run.release), timeout=long)
            extra.append(threading.Thread(target=idle_stream, args=(run, "idle_reflection", opener), daemon=True))
        if run.worker is not None:
            extra += [
                threading.Thread(target=idle_execute_loop, args=(run,), daemon=True)
                for _ in range(hostile.execute_streams)
            ]
    if run.oversized:
        extra.append(threading.Thread(target=oversized_loop, args=(run,), daemon=True))
    if "cancel" in parts:
        extra += [threading.Thread(target=cancel_loop, args=(run, run.seed + i), daemon=True) for i in range(2)]
    if "kill" in parts:
        extra.append(threading.Thread(target=kill_loop, args=(run,), name="kill", daemon=True))
    return extra


def _blocked(first: Any, release: threading.Event) -> Iterator[Any]:
    """A request stream that sends `first` and then nothing until released."""
    yield first
    release.wait()


def oversized_loop(run: Run) -> None:
    with Client(run.address) as client:
        i = 0
        while not run.stop.is_set():
            outcome = run.expect_refusal(client, "oversized", *run.oversized[i % len(run.oversized)])
            i += 1
            run.finish(outcome)
            run.stop.wait(0.5)


def cancel_loop(run: Run, seed_: int) -> None:
    local = random.Random(seed_)
    with Client(run.address) as client:
        while not run.stop.is_set():
            kind = local.choice(("cancel", "deadline"))
            request_id, started = run.begin(kind)
            tag = request_id.rsplit("-", 1)[1]
            body = api.DecideRequest(request_json=json.dumps(tagged(MEDIUM, tag)), prefix_policy=api.PREFIX_POLICY_OFF)
            metadata = [("x-request-id", request_id)]
            try:
                if kind == "cancel":
                    future = client.stub.Decide.future(body, timeout=run.timeout, metadata=metadata)
                    time.sleep(local.uniform(0.05, 1.0))
                    future.cancel()
                    reply = future.result()
                else:
                    reply = client.stub.Decide(body, timeout=local.uniform(0.05, 0.8), metadata=metadata)
                same = comparable(response_to_json(reply)) == tagged_answer(run.expected_medium, tag)
                outcome = Outcome(kind, "OK", 0.0, same, request_id, started, answered_ok=same)
            except grpc.FutureCancelledError:
                outcome = Outcome(kind, "CANCELLED", 0.0, True, request_id, started)
            except grpc.RpcError as error:
                outcome = Outcome(kind, error.code().name, 0.0, True, request_id, started, detail=error.details() or "")
            run.finish(outcome)
            if outcome.status == "UNAVAILABLE":
                run.stop.wait(0.2)


def idle_stream(run: Run, kind: str, open_call: Any) -> None:
    """One idle stream on the public port: it must answer its first message (or be refused
    with the cap's message) within the stream bound, then stays open until the end."""
    request_id, started = run.begin(kind, prefix=kind)
    try:
        call = open_call()
        next(call)
    except grpc.RpcError as error:
        code = error.code().name
        good = code != "RESOURCE_EXHAUSTED" or "concurrent" in (error.details() or "")
        run.finish(Outcome(kind, code, 0.0, good, request_id, started, detail=error.details() or ""))
        return
    outcome = Outcome(kind, "OPEN", 0.0, True, request_id, started, ended=time.monotonic())
    with run.lock:
        run.streams.append(call)
    run.stop.wait()
    if call.done() and call.code() != grpc.StatusCode.CANCELLED:  # ended by the server mid-run
        outcome.status, outcome.detail = call.code().name, call.details() or ""
    call.cancel()
    run.finish(outcome)


def idle_execute_loop(run: Run) -> None:
    """Execute streams on the worker port that send a header and never commit: the worker
    cancels each after --commit-timeout-seconds; a new one is opened at once."""
    header = wire.ExecuteRequest(
        header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    )
    worker, hostile = run.worker, run.hostile
    assert worker is not None and hostile is not None
    channel_address = worker.address
    channel = grpc.insecure_channel(channel_address)
    try:
        while not run.stop.is_set():
            request_id, started = run.begin("idle_execute", prefix="idle-execute")
            call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(
                _blocked(header, run.release),
                timeout=hostile.commit_timeout_seconds + run.bound,
                metadata=[("x-request-id", request_id)],
            )
            with run.lock:
                run.streams.append(call)
            try:
                for _ in call:
                    pass
                outcome = Outcome("idle_execute", "OK", 0.0, False, request_id, started)
            except grpc.RpcError as error:
                code = error.code().name
                if run.stop.is_set() and code == "CANCELLED" and "Locally cancelled" in (error.details() or ""):
                    code = "STOPPED"
                outcome = Outcome("idle_execute", code, 0.0, True, request_id, started, detail=error.details() or "")
            run.finish(outcome)
            if outcome.status == "UNAVAILABLE":
                run.stop.wait(0.3)
    finally:
        channel.close()


def kill_loop(run: Run) -> None:
    worker, hostile = run.worker, run.hostile
    assert worker is not None and hostile is not None
    from openjev.tools import launch

    for k in range(hostile.kills):
        wait = run.run_started + run.duration * (k + 1) / (hostile.kills + 1) - time.monotonic()
        if run.stop.wait(max(0.0, wait)):
            return
        with run.lock:
            in_flight = [i for i, (kind, _) in run.pending.items() if not kind.startswith("idle_")]
        record: dict[str, Any] = {"at_s": round(time.monotonic() - run.run_started, 1), "in_flight": len(in_flight)}
        killed_at = time.monotonic()
        record["_killed_at"] = killed_at
        run.kills.append(record)
        try:
            worker.kill_and_restart()
            with run.lock:
                run.pids["worker"] = worker.process.popen.pid
            launch.wait_serving(run.address, timeout_seconds=60)
            record["_up_at"] = time.monotonic()
            record["down_s"] = round(record["_up_at"] - killed_at, 2)
        except launch.LaunchError as error:
            record["error"] = str(error)[:500]
            return
        record["_in_flight_ids"] = in_flight

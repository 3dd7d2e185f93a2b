"""Time a request spends outside the model: latency minus the worker's inference_seconds, for one
small request sent (a) to the frontend (`Decide`, the whole service) and (b) straight to the
worker (`Execute`, the internal stream, and `ExecuteUnary`, the one message the frontend sends
for a request of one batch where the worker serves it), interleaved, next to (c) the bare cost
of gRPC's Python streaming with the same message pattern, and of a unary call, with no work at
all.

    .venv/bin/python benchmarks/service_overhead.py [--model .openjev/demo-model] [--repeats 200]
        [--case NAME]...   (requests of benchmarks/workload.jsonl instead of the small noul one)
        [--baseline-python OTHER/.venv/bin/python] [--shuffle] [--worker-args "--synthetic 27b"] [--awake]

--baseline-python starts a second worker and frontend with another environment's interpreter
(another checkout's editable install: the code before a change) and interleaves its two arms with
this checkout's, so a before/after comparison shares every moment's machine load. The worker's
inference_seconds (which includes its planning) and the whole latency are printed too: a change
must not buy its overhead back inside the model. --worker-args starts the workers with those flags
(on a GPU machine, `--synthetic 27b`: the CUDA path with the 27B shape); the worker's own wait
for the scheduler (its log's queue_ms, part of the time outside inference) is printed last.
--awake runs every arm a second time with the host's CPUs kept busy by SCHED_IDLE spinners
(cpu_awake.py), interleaved with the plain arms: what waking idle CPUs costs a request.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
from cpu_awake import Spinners

from openjev import abi
from openjev.contract.request import parse_request
from openjev.export import load_export_meta
from openjev.frontend.batches import iter_candidate_batches
from openjev.serving import channel_options
from openjev.tokenizer import PromptTokenizer
from openjev.tools import launch
from openjev.tools.bench import workload
from openjev.tools.soak import log_events
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

REQUEST = {
    "state": "The parcel arrived late and the box was damaged.",
    "questions": {"q": {"type": "noul", "instructions": "Is the customer upset?"}},
}


def workload_request(name: str) -> dict:
    for case in workload.read_jsonl(Path(__file__).parent / "workload.jsonl"):
        if case.name == name:
            return case.request
    raise SystemExit(f"no case {name!r} in benchmarks/workload.jsonl")


def execute_messages(model: Path, request: dict) -> list[wire.ExecuteRequest]:
    """What the frontend streams for the request: header, its batches, commit."""
    meta, tokenizer = load_export_meta(model), PromptTokenizer.from_export(model)
    decision = parse_request(request, accepted_models=meta.accepted_model_names)
    header = wire.ExecuteHeader(request_id="overhead", prefix_policy=abi.policy_to_enum("auto"))
    for q in decision.questions:
        header.questions.add(kind=abi.kind_to_enum(q.kind), num_candidates=len(q.prompts))
    messages = [wire.ExecuteRequest(header=header)]
    for batch in iter_candidate_batches(decision, tokenizer, meta.max_length):
        message = wire.ExecuteRequest()
        for c in batch:
            message.batch.candidates.add(
                question_index=c.question_index, candidate_index=c.candidate_index, token_ids=c.token_ids
            )
        messages.append(message)
    return messages + [wire.ExecuteRequest(commit=wire.Commit())]


def unary_request(messages: list[wire.ExecuteRequest]) -> wire.ExecuteUnaryRequest:
    """The same request as ExecuteUnary's one message."""
    request = wire.ExecuteUnaryRequest(header=messages[0].header)
    for message in messages[1:-1]:
        request.candidates.extend(message.batch.candidates)
    return request


def via_frontend(address: str, text: str):
    """An arm: Decide through the frontend at `address`; returns the worker's inference_seconds."""
    stub = decision_pb2_grpc.DecisionServiceStub(grpc.insecure_channel(address, options=channel_options()))
    request = api.DecideRequest(request_json=text, prefix_policy=abi.policy_to_enum("auto"))
    return lambda: stub.Decide(request, timeout=30).metadata.inference_seconds


def via_worker(address: str, messages: list[wire.ExecuteRequest]):
    """An arm: the frontend's Execute stream straight to the worker at `address`."""
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(address, options=channel_options()))

    def arm() -> float:
        replies = stub.Execute(iter(messages), timeout=30)
        return [m.summary for m in replies if m.WhichOneof("item") == "summary"][0].inference_seconds

    return arm


def via_worker_unary(address: str, request: wire.ExecuteUnaryRequest):
    """An arm: ExecuteUnary straight to the worker at `address` (a future, as the frontend calls it)."""
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(address, options=channel_options()))
    return lambda: stub.ExecuteUnary.future(request, timeout=30).result().summary.inference_seconds


def serves_unary(address: str) -> bool:
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(address, options=channel_options()))
    return stub.Describe(wire.DescribeRequest(), timeout=30).execute_unary


def bare_stream(up: int, down: int):
    """A server whose stream method reads `up` messages and answers `down`, doing nothing else."""

    def method(requests, context):
        for _ in requests:
            pass
        for _ in range(down):
            yield b"r"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bare.Bare", {"S": grpc.stream_stream_rpc_method_handler(method)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    call = grpc.insecure_channel(f"127.0.0.1:{port}").stream_stream("/bare.Bare/S")
    return server, lambda: list(call(iter([b"q"] * up)))


def bare_unary_server() -> tuple[grpc.Server, int]:
    """A started server on loopback whose unary method /bare.Bare/U answers at once; its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"r")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bare.Bare", {"U": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def bare_unary():
    """A bare unary server, called as a future, as the frontend does."""
    server, port = bare_unary_server()
    call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/bare.Bare/U")
    return server, lambda: call.future(b"q").result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument(
        "--case", action="append", default=[], help="a request of benchmarks/workload.jsonl by name (repeatable)"
    )
    p.add_argument("--baseline-python", type=Path, help="another environment's python: its servers are arms too")
    p.add_argument("--shuffle", action="store_true", help="each round runs the arms in a new (seeded) random order")
    p.add_argument("--worker-args", default="", help="more worker flags, one string (e.g. '--synthetic 27b')")
    p.add_argument("--awake", action="store_true", help="each arm also with every CPU kept busy (cpu_awake.py)")
    args = p.parse_args()
    requests = {name: workload_request(name) for name in args.case} or {"small noul": REQUEST}
    workdir = Path(tempfile.mkdtemp(prefix="openjev-overhead-"))
    # repeats of the same requests: the state cache would answer them from cached states
    no_cache = ["--state-cache-bytes", "0", *shlex.split(args.worker_args)]
    pairs = {}
    try:
        for suffix, python in [("", None), (", baseline", args.baseline_python)][: 1 + bool(args.baseline_python)]:
            (workdir / (suffix or "this")).mkdir()
            pairs[suffix] = launch.start_pair(
                args.model, workdir / (suffix or "this"), worker_args=no_cache, python=python or sys.executable
            )
    except BaseException:
        for pair in pairs.values():
            pair.stop()
        raise
    messages = {name: execute_messages(args.model, request) for name, request in requests.items()}
    first = next(iter(messages.values()))
    num_down = len(first[0].header.questions) + 1  # a result per question, then the summary
    bare_server, bare = bare_stream(len(first), num_down)
    single_server, single = bare_stream(1, 1)
    unary_server, unary = bare_unary()
    spinners = Spinners() if args.awake else None
    try:
        arms = {}
        for case, request in requests.items():
            tag = f" [{case}]" if len(requests) > 1 else ""
            for suffix, pair in pairs.items():
                launch.wait_serving(pair.frontend.address)
                arms[f"frontend (Decide){suffix}{tag}"] = via_frontend(pair.frontend.address, json.dumps(request))
                arms[f"worker (Execute){suffix}{tag}"] = via_worker(pair.worker.address, messages[case])
                if serves_unary(pair.worker.address):
                    unary_call = unary_request(messages[case])
                    arms[f"worker (ExecuteUnary){suffix}{tag}"] = via_worker_unary(pair.worker.address, unary_call)

        def no_model(call):
            def arm() -> float:
                call()
                return 0.0

            return arm

        arms |= {
            f"bare gRPC stream, {len(first)} up / {num_down} down": no_model(bare),
            "bare gRPC stream, 1 up / 1 down": no_model(single),
            "bare gRPC unary (future)": no_model(unary),
        }
        # (name, call, CPUs kept awake)
        order = [(name, fn, False) for name, fn in arms.items()]
        if spinners:
            order += [(f"{name}, CPUs awake", fn, True) for name, fn in arms.items()]
        outside: dict[str, list[float]] = {name: [] for name, _, _ in order}
        model: dict[str, list[float]] = {name: [] for name, _, _ in order}
        for rep in range(args.repeats + 10):
            if args.shuffle:  # no arm always follows the same one (what runs just before matters)
                random.Random(rep).shuffle(order)
            for name, fn, awake in order:  # interleaved: drift lands on every arm alike
                if spinners:
                    spinners.awake(awake)
                started = time.perf_counter()
                inference = fn()
                if rep >= 10:
                    outside[name].append(1e3 * (time.perf_counter() - started - inference))
                    model[name].append(1e3 * inference)
    finally:
        if spinners:
            spinners.close()
        bare_server.stop(None)
        single_server.stop(None)
        unary_server.stop(None)
        for pair in pairs.values():
            pair.stop()
    print(f"requests: {', '.join(requests)}; worker flags: {' '.join(no_cache)}\n")
    print(f"ms outside inference, {args.repeats} interleaved repeats\n")
    # inference_seconds also holds the worker's planning: the latency column counts everything
    print("| path | p10 | p50 | p90 | model p50 | latency p50 |")
    print("|---|---|---|---|---|---|")
    for name, values in outside.items():
        q = statistics.quantiles(values, n=10)
        inside = f"{statistics.median(model[name]):.2f}" if any(model[name]) else "-"
        latency = statistics.median(a + b for a, b in zip(values, model[name], strict=True))
        print(f"| {name} | {q[0]:.2f} | {statistics.median(values):.2f} | {q[-1]:.2f} | {inside} | {latency:.2f} |")
    for suffix, pair in pairs.items():
        print(f"\nworker{suffix}: its wait for the scheduler (queue_ms of its log, every request) {queue_ms(pair)}")


def queue_ms(pair: launch.Pair) -> str:
    """p10 / p50 / p90 of the queue_ms fields of the worker's execute log lines."""
    values = [e["queue_ms"] for e in log_events(pair.worker.log_text(), "execute") if "queue_ms" in e]
    if len(values) < 2:
        return "(no execute lines with queue_ms: is the log level above info?)"
    q = statistics.quantiles(values, n=10)
    return f"{q[0]:.3f} / {statistics.median(values):.3f} / {q[-1]:.3f} ms over {len(values)} requests"


if __name__ == "__main__":
    main()

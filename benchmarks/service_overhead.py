"""Time a request spends outside the model: latency minus the worker's inference_seconds, for one
small request sent (a) to the frontend (`Decide`, the whole service) and (b) straight to the
worker (`Execute`, the internal stream the frontend would send), interleaved, next to (c) the
bare cost of gRPC's Python streaming with the same message pattern and no work at all.

    .venv/bin/python benchmarks/service_overhead.py [--model .openjev/demo-model] [--repeats 200]
        [--case NAME]   (a request of benchmarks/workload.jsonl instead of the small noul one)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

from openjev import abi
from openjev.contract.request import parse_request
from openjev.export import load_export_meta
from openjev.frontend.batches import iter_candidate_batches
from openjev.serving import channel_options
from openjev.tokenizer import PromptTokenizer
from openjev.tools import launch
from openjev.tools.bench import workload
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--case", default="", help="a request of benchmarks/workload.jsonl by name")
    args = p.parse_args()
    request = workload_request(args.case) if args.case else REQUEST
    messages = execute_messages(args.model, request)
    pair = launch.start_pair(
        # repeats of the same requests: the state cache would answer them from cached states
        args.model,
        Path(tempfile.mkdtemp(prefix="openjev-overhead-")),
        worker_args=["--state-cache-bytes", "0"],
    )
    bare_server, bare = bare_stream(len(messages), 2)
    single_server, single = bare_stream(1, 1)
    try:
        launch.wait_serving(pair.frontend.address)
        worker = worker_pb2_grpc.WorkerServiceStub(
            grpc.insecure_channel(pair.worker.address, options=channel_options())
        )
        frontend = decision_pb2_grpc.DecisionServiceStub(
            grpc.insecure_channel(pair.frontend.address, options=channel_options())
        )
        text = json.dumps(request)

        def via_frontend() -> float:
            reply = frontend.Decide(
                api.DecideRequest(request_json=text, prefix_policy=abi.policy_to_enum("auto")), timeout=30
            )
            return reply.metadata.inference_seconds

        def via_worker() -> float:
            summary = [
                m.summary for m in worker.Execute(iter(messages), timeout=30) if m.WhichOneof("item") == "summary"
            ]
            return summary[0].inference_seconds

        def no_model(call):
            def arm() -> float:
                call()
                return 0.0

            return arm

        arms = {
            "frontend (Decide)": via_frontend,
            "worker (Execute)": via_worker,
            f"bare gRPC stream, {len(messages)} up / 2 down": no_model(bare),
            "bare gRPC stream, 1 up / 1 down": no_model(single),
        }
        outside = {name: [] for name in arms}
        for rep in range(args.repeats + 10):
            for name, fn in arms.items():  # interleaved: drift lands on every arm alike
                started = time.perf_counter()
                inference = fn()
                if rep >= 10:
                    outside[name].append(1e3 * (time.perf_counter() - started - inference))
    finally:
        bare_server.stop(None)
        single_server.stop(None)
        pair.stop()
    print(f"ms outside inference, {args.repeats} interleaved repeats\n")
    print("| path | p10 | p50 | p90 |")
    print("|---|---|---|---|")
    for name, values in outside.items():
        q = statistics.quantiles(values, n=10)
        print(f"| {name} | {q[0]:.2f} | {statistics.median(values):.2f} | {q[-1]:.2f} |")


if __name__ == "__main__":
    main()

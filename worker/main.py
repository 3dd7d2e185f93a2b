"""`openjev-worker`: load a checkpoint, warm it, serve openjev.worker.v1 over gRPC."""

from __future__ import annotations

import argparse
from pathlib import Path

from openjev import abi, config, interceptors, logs, metrics, serving, tracing
from openjev.export import load_export_meta_or_exit
from openjev.tokenizer import PromptTokenizer
from openjev.worker import backends
from openjev.worker.admission import AdmissionQueue
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits
from openjev.worker.service import WorkerIdentity, WorkerServicer
from openjev.worker.v1 import worker_pb2, worker_pb2_grpc

log = logs.get("openjev.worker")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openjev-worker",
        description="Serve an Open-Jev export on one device (the internal worker ABI). "
        "Every flag also reads OPENJEV_<FLAG> from the environment.",
    )
    p.add_argument("--model", required=True, type=Path, help="Open-Jev export directory")
    p.add_argument("--listen", default="127.0.0.1:50052", help="HOST:PORT (port 0 picks one)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=backends.BACKENDS,
        help="auto: cuda when a GPU is present, else torch; transformers: the benchmark baseline (policy off)",
    )
    p.add_argument(
        "--synthetic",
        default=None,
        help="27b|9b|small: seeded random weights of that "
        "shape on the GPU instead of the export's (the export still gives tokenizer and metadata)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic weights")
    p.add_argument("--prefix-policy", default="auto", choices=abi.POLICIES, help="policy for requests that name none")
    p.add_argument("--queue-capacity", type=int, default=64, help="requests that may wait")
    p.add_argument("--max-launch-sequences", type=int, default=16)
    p.add_argument("--max-launch-tokens", type=int, default=4096)
    p.add_argument("--max-questions", type=int, default=4096)
    p.add_argument("--max-candidates", type=int, default=65536)
    p.add_argument("--threads", type=int, default=None, help="CPU threads of the torch backend")
    p.add_argument(
        "--graph-cache-size",
        type=int,
        default=128,
        help="CUDA graphs the cuda backend keeps, one per launch shape bucket (0: eager launches)",
    )
    p.add_argument(
        "--graph-capture-after",
        type=int,
        default=2,
        help="capture a shape's graph on its Nth launch (1: at once; a capture costs several eager launches)",
    )
    p.add_argument(
        "--gemm-min-rows",
        type=_rows,
        default=None,
        metavar="auto|N",
        help="cuda backend: pad products of fewer rows to N, so that a token's result does not depend "
        "on its launch's size; auto (default): probe each weight shape at start (openjev/worker/cuda/gemm.py)",
    )
    p.add_argument(
        "--gdn-kernel",
        choices=("serial", "chunked"),
        default="serial",
        help="cuda backend: Gated DeltaNet prefill as the token recurrence (faster on the H200, "
        "measured) or the chunked tensor-core form (docs/cuda-kernels.md)",
    )
    p.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port here once serving (for --listen HOST:0)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://LISTEN_HOST:PORT/metrics (0: off)",
    )
    p.add_argument(
        "--max-connection-age-seconds",
        type=float,
        default=0.0,
        help="ask frontends to reconnect this often, so that they re-resolve a DNS name "
        "and spread over workers added since (0: never)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default="",
        help="export OpenTelemetry traces over OTLP/gRPC, e.g. http://HOST:4317 (empty: off)",
    )
    p.add_argument("--log-level", default="info")
    return p


def _rows(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError("expected auto or a row count")
    return int(text)


def warm_up(engine: Engine, temperature: float, policy: str) -> None:
    """One tiny request through the whole path, so the first real request pays no load cost
    (lazy kernels, allocator growth, graph capture)."""
    engine.execute([QuestionWork("choice", ((1, 2, 3, 4), (1, 2, 3, 5)))], temperature=temperature, policy=policy)


def main(argv: list[str] | None = None) -> None:
    args = config.parse_with_env(parser(), argv)
    logs.configure(args.log_level)
    config.log_config("openjev.worker", args)
    meta = load_export_meta_or_exit(args.model, "openjev-worker")
    backend = backends.resolve_backend(args.backend)
    runner = backends.build_runner(
        backend,
        args.model,
        synthetic=args.synthetic,
        seed=args.seed,
        threads=args.threads,
        cuda_options={
            "graph_cache_size": args.graph_cache_size,
            "graph_capture_after": args.graph_capture_after,
            "gemm_min_rows": args.gemm_min_rows,
            "gdn_kernel": args.gdn_kernel,
        },
    )
    tokenizer = PromptTokenizer.from_export(args.model)
    num_token_ids = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if runner.config.vocab_size < num_token_ids:  # e.g. --synthetic small, whose table is tiny
        raise SystemExit(
            f"openjev-worker: the model's vocab_size {runner.config.vocab_size} is smaller than "
            f"the tokenizer's {num_token_ids} token ids"
        )
    forced_policy = None
    if backend == "transformers":
        forced_policy = args.prefix_policy = "off"  # it cannot start from a parent's state
        args.max_launch_tokens = max(args.max_launch_tokens, meta.max_length)  # whole prompts, no chunks
    limits = PackLimits(max_sequences=args.max_launch_sequences, max_tokens=args.max_launch_tokens)
    cost_model = default_cost_model("cuda" if backend == "cuda" else "torch")
    engine = Engine(
        metrics.CountingRunner(runner), pack_limits=limits, cost_model=cost_model, default_policy=args.prefix_policy
    )
    identity = WorkerIdentity(
        model_id=meta.model_id,
        alias=meta.alias,
        checkpoint_revision=meta.checkpoint_revision
        + (f"+synthetic-{args.synthetic}-seed{args.seed}" if args.synthetic else ""),
        temperature=meta.temperature,
        max_length=meta.max_length,
        vocab_size=runner.config.vocab_size,
        tokenizer_fingerprint=tokenizer.fingerprint,
        backend=backend,
        default_policy=args.prefix_policy,
        max_questions=args.max_questions,
        max_candidates=args.max_candidates,
        max_batch_candidates=16,
        max_launch_sequences=args.max_launch_sequences,
        max_launch_tokens=args.max_launch_tokens,
        queue_capacity=args.queue_capacity,
    )
    queue = AdmissionQueue(args.queue_capacity)
    metrics.worker_queue_depth.set_function(lambda: queue.depth)
    servicer = WorkerServicer(engine, identity, queue, forced_policy=forced_policy)
    name = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
    traced = tracing.configure("openjev-worker", args.otlp_endpoint)
    server = serving.build_server(
        args.listen,
        lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s),
        [name],
        interceptors=[
            *([tracing.ServerInterceptor({f"/{name}/Execute"})] if traced else []),
            interceptors.RequestInterceptor({f"/{name}/Execute": metrics.WorkerObserver()}, make_ids=False),
        ],
        max_connection_age_seconds=args.max_connection_age_seconds,
    )
    metrics.serve(metrics.worker_registry, args.listen, args.metrics_port)
    warm_up(engine, meta.temperature, forced_policy or "shared")
    server.set_serving(True)
    if args.port_file:
        args.port_file.write_text(str(server.port))
    log.info("serving", port=server.port, backend=backend, model_id=meta.model_id)
    serving.serve_until_signal(server, grace_seconds=args.grace_seconds, on_stop=lambda: stop(queue, runner))


def stop(queue: AdmissionQueue, runner) -> None:
    queue.close()
    tracing.shutdown()  # export the spans still buffered
    try:
        import torch

        if torch.cuda.is_available():  # the benchmark reads this line
            graphs = getattr(runner, "graphs", None)
            stats = (
                {}
                if graphs is None
                else {
                    "graph_captures": graphs.cache.num_captures,
                    "graph_replays": graphs.hits,
                    "graph_capture_failures": graphs.failures,
                }
            )
            log.info("peak_memory", device_bytes=torch.cuda.max_memory_allocated(), **stats)
    except ImportError:
        pass


if __name__ == "__main__":
    main()

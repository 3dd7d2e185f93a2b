"""`openjev-worker`: load a checkpoint, warm it, serve openjev.worker.v1 over gRPC."""

from __future__ import annotations

import argparse
import gc
import threading
import time
from pathlib import Path

from openjev import logs

logs.quiet_grpc_core()  # before grpc's first import (by the modules below): its variable is read then

from openjev import abi, config, interceptors, metrics, security, serving, tracing
from openjev.config import non_negative_float, non_negative_int, positive_float, positive_int
from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.export import load_export_meta_or_exit, or_exit
from openjev.limits import CallLimits
from openjev.tokenizer import TokenizerFile
from openjev.worker import backends
from openjev.worker.cache.sizing import CPU_DEFAULT_BYTES, build_state_cache, gpu_default_bytes
from openjev.worker.checkpoint.config import ModelConfig, load_model_config
from openjev.worker.cuda.traits import GDN_CHUNKED
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.geometry import DEFAULT_GDN_SPLIT_AT, GDN_CHUNK_TOKENS
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits, default_chunk_tokens, shared_pass_tokens
from openjev.worker.scheduler import InferenceError
from openjev.worker.service import WorkerIdentity, WorkerServicer
from openjev.worker.v1 import worker_pb2, worker_pb2_grpc

log = logs.get("openjev.worker")

# Submitted tokens per request: 16 MiB of ids held in the worker (planning one such request took
# the worker's RSS up ~480 MiB; its segments then keep 4 bytes an id), about 15 s of the
# demo model on 2 CPU cores; the largest request the contract allows (65,536 short candidates) and
# a capacity case (33 candidates of 16,384 tokens) fit, the 18-million-token requests seen do not.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 22

# Health Watch streams the worker admits: every frontend holds one on each worker for each of its
# traffic channels (round robin, and the affinity ring), and while a channel is replaced the old
# one's stays until its last call ends, so up to 4 a frontend. A refused Watch leaves that
# frontend's channel unhealthy and the frontend NOT_SERVING for as long as it lasts: at the
# public port's 32 the 17th frontend never served. Each stream holds one idle pool thread; 256
# serve 64 frontends through a rolling restart.
WATCH_STREAMS = 256

# The shapes of cuda/fused_weights.SHAPES a served model can take: their vocabularies hold the
# tokenizer's ids ("small" there is the kernel tests' shape, with a 4,096-entry table).
SYNTHETIC_SHAPES = ("27b", "9b")


def chunk_tokens(text: str) -> int:
    """A positive multiple of the GDN chunk: `fixed` cuts prompts at multiples of it and is
    bit-identical to `off` only on that grid (docs/prefix-reuse.md)."""
    value = positive_int(text)
    if value % GDN_CHUNK_TOKENS:
        raise argparse.ArgumentTypeError(f"expected a multiple of {GDN_CHUNK_TOKENS}, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = config.OneLineParser(
        prog="openjev-worker",
        description="Serve an Open-Jev export on one device (the internal worker ABI). "
        "Every flag also reads OPENJEV_<FLAG> from the environment.",
    )
    p.add_argument("--model", required=True, type=Path, help="Open-Jev export directory")
    p.add_argument("--listen", type=config.host_port, default="127.0.0.1:50052", help="HOST:PORT (port 0 picks one)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=backends.BACKENDS,
        help="auto: cuda when a GPU is present, else torch; transformers: the benchmark baseline (policy off)",
    )
    p.add_argument(
        "--synthetic",
        default=None,
        choices=SYNTHETIC_SHAPES,
        help="seeded random weights of that shape on the GPU instead of the export's (the export "
        "still gives tokenizer and metadata)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of --synthetic weights")
    p.add_argument(
        "--prefix-policy", default="auto", choices=PREFIX_POLICIES, help="policy for requests that name none"
    )
    p.add_argument(
        "--queue-capacity",
        type=non_negative_int,
        default=64,
        help="requests that may wait for their first pass (0: none while the worker is busy)",
    )
    p.add_argument(
        "--max-launch-sequences",
        type=positive_int,
        default=64,
        help="pass budget: most segments one forward pass carries, across requests",
    )
    p.add_argument(
        "--max-launch-tokens",
        type=positive_int,
        default=4096,
        help="pass budget: most tokens one forward pass carries, across requests",
    )
    p.add_argument(
        "--shared-launch-tokens",
        type=chunk_tokens,
        default=None,
        help="most tokens of a pass while several requests wait: shorter passes answer the requests "
        "riding beside a long prompt's chunks sooner, and the long prompt later (a multiple of 64; "
        "default: the pass budget)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=chunk_tokens,
        default=None,
        help="longer prompt parts run as chunks of this many tokens over successive passes, "
        "leaving room in each pass for other requests (a multiple of 64; default: half of "
        "--shared-launch-tokens, else of the pass budget: 2048)",
    )
    p.add_argument("--max-questions", type=positive_int, default=4096, help="questions a request may hold")
    p.add_argument(
        "--max-candidates",
        type=positive_int,
        default=65536,
        help="candidates a request may hold, all questions together",
    )
    p.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help="candidate tokens one request may submit (all candidates together)",
    )
    p.add_argument(
        "--max-held-tokens",
        type=positive_int,
        default=None,
        help="candidate tokens the worker holds at once over requests arriving, waiting and running; a "
        "candidate past it ends its call RESOURCE_EXHAUSTED (default: twice --max-request-tokens; at "
        "least --max-request-tokens)",
    )
    p.add_argument(
        "--commit-timeout-seconds",
        type=positive_float,
        default=60.0,
        help="an Execute stream not committed within this long is cancelled",
    )
    p.add_argument(
        "--max-collecting",
        type=positive_int,
        default=16,
        help="Execute streams that may be arriving (not yet committed) beside the queue's requests",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads of the torch backend (default: 1 for models of hidden size <= 1024, else one per core)",
    )
    p.add_argument(
        "--graph-cache-size",
        type=non_negative_int,
        default=128,
        help="0: the cuda backend runs every pass eagerly; otherwise it captures one CUDA graph per "
        "shape bucket of the pass budget at start (a smaller value is raised to the bucket count)",
    )
    p.add_argument(
        "--graph-capture-after",
        type=positive_int,
        default=2,
        help="no effect since graphs are captured at start for every pass shape (before SERVING); "
        "kept so that existing command lines still start",
    )
    p.add_argument(
        "--graph-tile-from",
        type=non_negative_int,
        default=1024,
        help="graph passes of more tokens pad to a multiple of 128 rows (the products' tile), not to 4 "
        "sizes an octave (0: never)",
    )
    p.add_argument(
        "--gemm-min-rows",
        type=_rows,
        default=None,
        metavar="auto|N",
        help="cuda backend: pad products of fewer rows to N, so that a token's result does not depend "
        "on its launch's size; auto (default): probe each weight shape at start (worker/cuda/gemm.py)",
    )
    p.add_argument(
        "--gdn-kernel",
        choices=("serial", "chunked", "split"),
        default="serial",
        help="cuda backend: Gated DeltaNet prefill as the token recurrence (the default: faster below "
        "~650 tokens, where most requests are), the chunked tensor-core form (5-7%% faster above, "
        "measured on an H100), or split: the recurrence before position --gdn-split-at and the "
        "chunked form from it on (~5%% faster from 2,049 tokens, ~4%% slower at 129-512, twice the "
        "start-up and ~2.2 GiB more device memory on the 27B shape; docs/benchmarks/index.md)",
    )
    p.add_argument(
        "--gdn-split-at",
        type=chunk_tokens,
        default=DEFAULT_GDN_SPLIT_AT,
        help="cuda backend, --gdn-kernel split: the first position the chunked form takes, a positive "
        "multiple of 64 (default %(default)s)",
    )
    p.add_argument(
        "--state-cache-bytes",
        type=non_negative_int,
        default=None,
        help="bytes of tree-node states kept across requests (0: off; default: 256 MiB on the torch "
        "backend, half the GPU memory free after start-up on cuda; docs/state-cache.md)",
    )
    p.add_argument(
        "--max-connection-age-seconds",
        type=non_negative_float,
        default=0.0,
        help="ask frontends to reconnect this often, so that they re-resolve a DNS name "
        "and spread over workers added since (0: never)",
    )
    config.add_server_flags(p, client="frontend", watch_streams=WATCH_STREAMS)
    return p


def _rows(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a row count >= 1, got {text!r}")
    return int(text)


def call_limits(args: argparse.Namespace, work_methods: tuple[str, ...]) -> CallLimits:
    """Execute and ExecuteUnary calls: every request the scheduler may hold (those in passes and
    those waiting, Scheduler.max_admitted) and the streams still arriving (an ExecuteUnary call is
    counted once its message is in; while it arrives it holds a pool thread outside any cap:
    docs/reliability.md). With a thread for each, a full queue is what refuses (RESOURCE_EXHAUSTED
    from the scheduler), never a thread pool that makes the rest wait unseen."""
    return CallLimits(
        work=args.queue_capacity + args.max_launch_sequences + args.max_collecting,
        watch=args.max_watch_streams,
        reflection=args.max_reflection_streams,
        work_methods=work_methods,
    )


def state_cache_budget(requested: int | None, backend: str) -> int:
    """The flag's value, else the default rule (openjev.worker.cache.sizing)."""
    if requested is not None:
        return requested
    return gpu_default_bytes() if backend == "cuda" else CPU_DEFAULT_BYTES


END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # what a Qwen3.5 config's eos_token_id names


def check_model_tokens(tokenizer: TokenizerFile, model: ModelConfig) -> None:
    """The tokenizer's ids must fit the model's embedding, and config.json's end-of-sequence ids
    must be the tokenizer's end tokens: a tokenizer.json of another model (another vocabulary,
    renumbered specials) otherwise serves answers computed on ids the weights never saw, every
    other check passed."""
    num_token_ids = tokenizer.num_token_ids
    if model.vocab_size < num_token_ids:
        raise SystemExit(
            f"openjev-worker: config.json's vocab_size {model.vocab_size} is smaller than "
            f"tokenizer.json's {num_token_ids} token ids: the tokenizer is not this model's"
        )
    for eos in model.eos_token_ids:
        if (token := tokenizer.id_to_token(eos)) not in END_TOKENS:
            raise SystemExit(
                f"openjev-worker: config.json's eos_token_id {eos} is {token!r} in tokenizer.json, "
                f"not one of {', '.join(END_TOKENS)}: the tokenizer is not this model's"
            )


def warm_up(engine: Engine, runner, temperature: float, policy: PrefixPolicy) -> None:
    """Before SERVING: the CUDA runner captures a graph for every pass shape within the budget
    (no request within capacity then pays a capture or an eager pass), and one tiny request
    goes through the whole path (lazy kernels, allocator growth). A capture that failed stops
    the start: that shape would run eagerly, ~5x slower, for the life of the process, and such
    failures are systematic (a driver, a kernel that cannot be captured, memory)."""
    started = time.perf_counter()
    ready = getattr(runner, "warm_up", None)
    if ready is not None:
        log.info("graphs_capturing", note="every pass shape of the budget, before SERVING")
        stats = ready()
        if stats is not None:
            log.info("graphs_ready", **stats)
            if stats.get("failures"):
                raise SystemExit(
                    f"openjev-worker: {stats['failures']} CUDA graph captures failed at start (first: "
                    f"{stats.get('first_failure')}); passes of those shapes would run eagerly. A smaller "
                    "pass budget (--max-launch-tokens, --max-launch-sequences) needs less memory; "
                    "--graph-cache-size 0 runs every pass eagerly on purpose"
                )
    # an engine of its own over the bare runner: the metrics count served requests only
    warming = Engine(runner, pack_limits=engine.pack_limits, cost_model=engine.cost_model)
    try:
        top = runner.config.vocab_size - 1  # a model may have as few as 5 token ids (the chat template's)
        ids = tuple(tuple(min(i, top) for i in c) for c in ((1, 2, 3, 4), (1, 2, 3, 5)))
        warming.execute([QuestionWork("choice", ids)], temperature=temperature, policy=policy)
    finally:
        warming.close()
    log.info("warm", seconds=round(time.perf_counter() - started, 3))


def main(argv: list[str] | None = None) -> None:
    flags = parser()
    args = config.parse_with_env(flags, argv)
    # the pass budget before anything loads: a bad one is a usage error (status 2), not a refusal
    # after the weights have loaded
    if args.shared_launch_tokens is not None and args.shared_launch_tokens > args.max_launch_tokens:
        flags.error(
            f"--shared-launch-tokens {args.shared_launch_tokens} exceeds --max-launch-tokens {args.max_launch_tokens}"
        )
    shared = shared_pass_tokens(args.max_launch_tokens, args.shared_launch_tokens)
    if args.chunk_tokens is None:
        if shared < GDN_CHUNK_TOKENS:
            flags.error(f"--max-launch-tokens {args.max_launch_tokens} is below {GDN_CHUNK_TOKENS}, the smallest chunk")
        args.chunk_tokens = default_chunk_tokens(shared)
    elif args.chunk_tokens > shared:
        what = "--max-launch-tokens" if args.shared_launch_tokens is None else "--shared-launch-tokens"
        flags.error(f"--chunk-tokens {args.chunk_tokens} exceeds {what} {shared}")
    # split: a sequence crossing --gdn-split-at is two segments of the chunked kernel's plan. Only
    # for --backend cuda named: the torch runner has no such kernel, and with auto serve() checks
    # the budget once the backend is known (budget_problem).
    most = GDN_CHUNKED.max_segments // (2 if args.gdn_kernel == "split" else 1)
    if args.backend == "cuda" and args.gdn_kernel != "serial" and args.max_launch_sequences > most:
        flags.error(
            f"--max-launch-sequences {args.max_launch_sequences} exceeds {most}, "
            f"the most sequences a pass of --gdn-kernel {args.gdn_kernel} plans"
        )
    if args.max_held_tokens is None:
        args.max_held_tokens = 2 * args.max_request_tokens
    elif args.max_held_tokens < args.max_request_tokens:  # a request alone must always fit
        flags.error(f"--max-held-tokens {args.max_held_tokens} is below --max-request-tokens {args.max_request_tokens}")
    logs.configure(args.log_level)
    # Starting allocates containers that live on (torch's modules: 170k) or are read and dropped
    # (a tokenizer.json whose merges are [left, right] pairs: 500k), which the collector walked
    # again and again: 0.35 s of the demo worker's start (0.85 s with such a file). None until
    # serve() is done starting (started_collecting(): one collection, ~0.15 s).
    gc.disable()
    try:
        with serving.exit_on_signal_while_starting("openjev-worker"):
            serve(args)
    finally:
        gc.enable()


def started_collecting() -> None:
    """The start's garbage collected once; what is left lives as long as the process, so it is
    frozen (later collections do not walk it again), and collections resume."""
    gc.collect()
    gc.freeze()
    gc.enable()


def serve(args: argparse.Namespace) -> None:
    """Check the flags' files, load the model, warm up, serve until SIGTERM (main has checked
    the pass budget and set chunk_tokens)."""
    config.log_config("openjev.worker", args)
    shared = shared_pass_tokens(args.max_launch_tokens, args.shared_launch_tokens)
    if args.chunk_tokens > shared // 2:
        log.warning(
            "chunk_fills_pass",
            chunk_tokens=args.chunk_tokens,
            max_launch_tokens=args.max_launch_tokens,
            shared_launch_tokens=shared,
            hint="a long prompt's chunk leaves other requests little or no room in its passes; "
            "a --chunk-tokens of at most half --shared-launch-tokens (or --max-launch-tokens) keeps room",
        )
    try:
        credentials = security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        security.require_tls(
            credentials,
            plaintext=args.plaintext,
            link="the worker port",
            flags="--tls-cert and --tls-key, and --tls-client-ca for mutual TLS",
        )
    except security.SecurityError as error:
        raise SystemExit(f"openjev-worker: {error}") from None
    if credentials is None:
        log.warning(
            "plaintext", reason="--plaintext", hint="set --tls-cert, --tls-key and --tls-client-ca for mutual TLS"
        )
    elif args.tls_client_ca is None:  # TLS, but any client may call: the frontend is not checked
        log.warning("no_client_auth", hint="set --tls-client-ca so only the frontends' certificates are accepted")
    # before the weights: without the tracing extra --otlp-endpoint is refused in a second
    traced = tracing.configure("openjev-worker", args.otlp_endpoint)
    meta = load_export_meta_or_exit(args.model, "openjev-worker")
    # the tokenizer before the weights: a bad tokenizer.json is refused in a second, not after a load
    tokenizer = or_exit(TokenizerFile.from_export, args.model, program="openjev-worker")
    backend = backends.resolve_backend(args.backend)
    if backend == "cuda":  # a pass budget the kernels cannot launch, refused before the weights load
        from openjev.worker.cuda.runner import budget_problem, chunked_from, pass_budget

        passes = pass_budget(args.max_launch_tokens, args.max_launch_sequences, tile_from=args.graph_tile_from)
        problem = budget_problem(passes, chunked_from(args.gdn_kernel, args.gdn_split_at))
        if problem:
            given = f"--max-launch-tokens {args.max_launch_tokens} --max-launch-sequences {args.max_launch_sequences}"
            raise SystemExit(f"openjev-worker: {given} (--gdn-kernel {args.gdn_kernel}): {problem}")
    if args.synthetic is None:  # config.json against the tokenizer before the weights load, not after
        check_model_tokens(tokenizer, or_exit(load_model_config, args.model, program="openjev-worker"))
    runner = or_exit(
        backends.build_runner,
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
            "gdn_split_at": args.gdn_split_at,
            "graph_tile_from": args.graph_tile_from,
            "max_pass_tokens": args.max_launch_tokens,
            "max_pass_segments": args.max_launch_sequences,
        },
        program="openjev-worker",
    )
    if args.synthetic is not None:  # the shape's own config (an export's was checked above)
        check_model_tokens(tokenizer, runner.config)
    forced_policy: PrefixPolicy | None = None
    if backend == "transformers":
        forced_policy = args.prefix_policy = "off"  # it cannot start from a parent's state
        args.max_launch_tokens = max(args.max_launch_tokens, meta.max_length)  # whole prompts, no chunks
        args.chunk_tokens = args.max_launch_tokens
        args.shared_launch_tokens = None
    try:
        limits = PackLimits(
            max_sequences=args.max_launch_sequences,
            max_tokens=args.max_launch_tokens,
            chunk_tokens=args.chunk_tokens,
            shared_tokens=args.shared_launch_tokens,
        )
    except ValueError as error:
        raise SystemExit(f"openjev-worker: {error}") from None
    cost_model = default_cost_model("cuda" if backend == "cuda" else "torch")
    revision = meta.checkpoint_revision + (f"+synthetic-{args.synthetic}-seed{args.seed}" if args.synthetic else "")
    # budget 0 until warm-up is over: the GPU's default is measured after it; states of another
    # GDN kernel or split position have other bits
    gdn = args.gdn_kernel + (f"@{args.gdn_split_at}" if args.gdn_kernel == "split" else "")
    state_cache = build_state_cache(
        runner,
        0,
        fingerprint=f"{meta.model_id}@{revision}/{backend}/{gdn}/{args.gemm_min_rows}",
        listener=metrics.StateCacheObserver(),
    )
    # a device that can run nothing more (a sticky CUDA error): stop serving and exit 1, so that a
    # supervisor restarts the worker, rather than fail every request while health says SERVING
    device_lost: list[str] = []
    stopping = threading.Event()

    def on_device_lost(reason: str) -> None:
        device_lost.append(reason)
        stopping.set()

    engine = Engine(
        metrics.CountingRunner(runner),
        pack_limits=limits,
        cost_model=cost_model,
        default_policy=args.prefix_policy,
        queue_capacity=args.queue_capacity,
        on_pass=observe_pass,
        state_cache=state_cache,
        on_device_lost=on_device_lost,
    )
    identity = WorkerIdentity(
        model_id=meta.model_id,
        alias=meta.alias,
        checkpoint_revision=revision,
        temperature=meta.temperature,
        max_length=meta.max_length,
        vocab_size=runner.config.vocab_size,
        tokenizer_fingerprint=tokenizer.fingerprint,
        weights_fingerprint=abi.weights_fingerprint(repr(runner.config), meta.head_weight, meta.head_bias),
        backend=backend,
        default_policy=args.prefix_policy,
        max_questions=args.max_questions,
        max_candidates=args.max_candidates,
        max_batch_candidates=abi.BATCH_CANDIDATES,
        max_launch_sequences=args.max_launch_sequences,
        max_launch_tokens=args.max_launch_tokens,
        queue_capacity=args.queue_capacity,
        num_token_ids=tokenizer.num_token_ids,
        max_request_tokens=args.max_request_tokens,
    )
    metrics.worker_queue_depth.set_function(lambda: engine.scheduler.depth)
    servicer = WorkerServicer(
        engine,
        identity,
        forced_policy=forced_policy,
        commit_timeout_seconds=args.commit_timeout_seconds,
        max_held_tokens=args.max_held_tokens,
        ready=False,
    )
    metrics.worker_held_tokens.set_function(lambda: servicer.held.held)
    name = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
    work_methods = (f"/{name}/Execute", f"/{name}/ExecuteUnary")
    # before the gRPC server starts: a port it cannot have ends the process with nothing serving
    metrics.serve(metrics.worker_registry, args.listen, args.metrics_port, "openjev-worker")
    server = serving.build_server(
        args.listen,
        lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s),
        [name],
        interceptors=[
            *([tracing.ServerInterceptor(set(work_methods))] if traced else []),
            interceptors.RequestInterceptor(dict.fromkeys(work_methods, metrics.WorkerObserver()), make_ids=False),
        ],
        max_connection_age_seconds=args.max_connection_age_seconds,
        limits=call_limits(args, work_methods),
        credentials=credentials,
        program="openjev-worker",
    )
    try:
        warm_up(engine, runner, meta.temperature, forced_policy or "shared")
    except InferenceError as error:  # weights that load but cannot answer (e.g. overflow in a product)
        raise SystemExit(f"openjev-worker: the warm-up request failed: {error}") from None
    if state_cache is not None:
        state_cache.budget_bytes = state_cache_budget(args.state_cache_bytes, backend)
        metrics.worker_state_cache_bytes.set_function(lambda: state_cache.nbytes)
        if state_cache.budget_bytes and not state_cache.enabled:
            log.warning(
                "state_cache_off",
                reason="budget below the smallest state",
                requested_bytes=state_cache.budget_bytes,
                state_bytes=state_cache.min_entry_bytes,
            )
    budget = state_cache.budget_bytes if state_cache is not None and state_cache.enabled else 0
    metrics.worker_state_cache_budget_bytes.set(budget)
    log.info("state_cache", budget_bytes=budget)
    serving.stop_if_signalled_while_starting()
    started_collecting()
    servicer.ready.set()
    server.set_serving(True)
    if args.port_file:
        args.port_file.write_text(str(server.port))
    log.info("serving", port=server.port, backend=backend, model_id=meta.model_id)
    serving.serve_until_signal(
        server, grace_seconds=args.grace_seconds, on_stop=lambda: stop(engine, runner), stop=stopping
    )
    if device_lost:
        raise SystemExit(f"openjev-worker: the device failed ({device_lost[0]}); exiting so that it is restarted")


def observe_pass(num_requests: int, num_tokens: int, seconds: float) -> None:
    """Each pass: a metric, and at --log-level debug a `pass` line (how requests shared passes)."""
    metrics.observe_pass(num_requests, num_tokens, seconds)
    log.debug("pass", requests=num_requests, tokens=num_tokens, ms=round(seconds * 1e3, 3))


def stop(engine: Engine, runner) -> None:
    engine.close()
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
                    "graph_eager_passes": graphs.fallbacks,
                }
            )
            # reserved, not allocated: the allocator's cached blocks are the device's too (the
            # CUDA context and CuPy's own pool are still not counted)
            log.info(
                "peak_memory",
                device_bytes=torch.cuda.max_memory_reserved(),
                allocated_bytes=torch.cuda.max_memory_allocated(),
                **stats,
            )
    except ImportError:
        pass


if __name__ == "__main__":
    main()

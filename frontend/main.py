"""`openjev-frontend`: the public Open-Jev gRPC API in front of a worker."""

from __future__ import annotations

import argparse
from pathlib import Path

from openjev import config, interceptors, logs, metrics, serving, tracing
from openjev.export import load_export_meta_or_exit
from openjev.frontend.service import DecisionServicer
from openjev.frontend.worker_link import WorkerLink
from openjev.frontend.worker_targets import TargetError
from openjev.tokenizer import PromptTokenizer
from openjev.v1 import decision_pb2, decision_pb2_grpc

log = logs.get("openjev.frontend")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openjev-frontend",
        description="Serve the public Open-Jev decision API; tokenizes and forwards to a worker. "
        "Every flag also reads OPENJEV_<FLAG> from the environment.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="Open-Jev export directory (the frontend reads only its tokenizer and metadata)",
    )
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 picks one)")
    p.add_argument(
        "--worker",
        default="127.0.0.1:50052",
        help="worker(s): HOST:PORT, IP:PORT,IP:PORT,... or dns:///NAME:PORT (every address "
        "of NAME); balanced round-robin over the SERVING ones",
    )
    p.add_argument("--max-questions", type=int, default=4096)
    p.add_argument("--max-candidates", type=int, default=65536)
    p.add_argument("--worker-refresh-seconds", type=float, default=2.0, help="how often the worker is described again")
    p.add_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port here once listening (for --listen HOST:0)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://LISTEN_HOST:PORT/metrics (0: off)",
    )
    p.add_argument(
        "--http-listen",
        default="",
        help="also serve the HTTP/JSON API (POST /v1/systemone, /health, /metrics, /openapi.json) "
        "at HOST:PORT (empty: off)",
    )
    p.add_argument(
        "--http-max-body-bytes", type=int, default=serving.MAX_MESSAGE_BYTES, help="larger HTTP bodies get 413"
    )
    p.add_argument(
        "--otlp-endpoint",
        default="",
        help="export OpenTelemetry traces over OTLP/gRPC, e.g. http://HOST:4317 (empty: off)",
    )
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    args = config.parse_with_env(parser(), argv)
    logs.configure(args.log_level)
    config.log_config("openjev.frontend", args)
    meta = load_export_meta_or_exit(args.model, "openjev-frontend")
    tokenizer = PromptTokenizer.from_export(args.model)
    servers: list[serving.Server] = []

    def on_worker_state(state) -> None:
        # Health mirrors the worker link: SERVING only while a compatible worker answers.
        if servers:
            servers[0].set_serving(state.problem is None)

    try:
        link = WorkerLink(
            args.worker,
            fingerprint=tokenizer.fingerprint,
            max_length=meta.max_length,
            refresh_seconds=args.worker_refresh_seconds,
            on_state=on_worker_state,
        )
    except TargetError as error:
        raise SystemExit(f"openjev-frontend: {error}")
    servicer = DecisionServicer(
        meta, tokenizer, link, max_questions=args.max_questions, max_candidates=args.max_candidates
    )
    name = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"].full_name
    observers = {f"/{name}/Decide": metrics.FrontendObserver()}
    traced = tracing.configure("openjev-frontend", args.otlp_endpoint)
    servers.append(
        serving.build_server(
            args.listen,
            lambda s: decision_pb2_grpc.add_DecisionServiceServicer_to_server(servicer, s),
            [name],
            interceptors=[
                *([tracing.ServerInterceptor({f"/{name}/Decide"})] if traced else []),
                interceptors.RequestInterceptor(observers, make_ids=True),
            ],
        )
    )
    server = servers[0]
    metrics.serve(metrics.frontend_registry, args.listen, args.metrics_port)
    http = start_http(args, servicer, link) if args.http_listen else None
    link.start()
    if args.port_file:
        args.port_file.write_text(str(server.port))
    log.info("listening", port=server.port, worker=args.worker, http_port=http.port if http else None)

    def stop() -> None:
        if http is not None:
            http.wait_stopped()
        link.close()
        tracing.shutdown()

    serving.serve_until_signal(
        server,
        grace_seconds=args.grace_seconds,
        on_signal=http.begin_stop if http else lambda: None,
        on_stop=stop,
    )


def start_http(args, servicer: DecisionServicer, link: WorkerLink):
    """The HTTP API on its own port; /health is ready exactly when the gRPC health says SERVING."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    api = HttpApi(servicer, lambda: link.state.problem, max_body_bytes=args.http_max_body_bytes)
    http = HttpServer(api, args.http_listen, grace_seconds=args.grace_seconds)
    http.start()
    return http


if __name__ == "__main__":
    main()

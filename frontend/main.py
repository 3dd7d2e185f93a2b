"""`openjev-frontend`: the public Open-Jev gRPC API in front of a worker."""

from __future__ import annotations

import argparse
from pathlib import Path

from openjev import logs

logs.quiet_grpc_core()  # before grpc's first import (by the modules below): its variable is read then

from openjev import config, interceptors, metrics, security, serving, tracing
from openjev.config import positive_float, positive_int
from openjev.contract.request import MAX_CANDIDATES, MAX_QUESTIONS, MAX_RENDERED_BYTES
from openjev.export import load_export_meta_or_exit, or_exit
from openjev.frontend import routing
from openjev.frontend.memory import return_large_blocks, trim_heap
from openjev.frontend.service import DEFAULT_MAX_REQUEST_TOKENS, DecisionServicer
from openjev.frontend.worker_link import WorkerLink
from openjev.frontend.worker_targets import TargetError, parse_worker_targets
from openjev.limits import CallLimits
from openjev.tokenizer import PromptTokenizer
from openjev.v1 import decision_pb2, decision_pb2_grpc

log = logs.get("openjev.frontend")


def parser() -> argparse.ArgumentParser:
    p = config.OneLineParser(
        prog="openjev-frontend",
        description="Serve the public Open-Jev decision API; tokenizes and forwards to a worker. "
        "Every flag also reads OPENJEV_<FLAG> from the environment.",
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="Open-Jev export directory (the frontend loads its tokenizer and metadata; of the weights it checks "
        "only the files' headers)",
    )
    p.add_argument("--listen", type=config.host_port, default="127.0.0.1:50051", help="HOST:PORT (port 0 picks one)")
    p.add_argument(
        "--worker",
        default="127.0.0.1:50052",
        type=worker_target,
        help="worker(s): HOST:PORT, IP:PORT,IP:PORT,... or dns:///NAME:PORT (every address "
        "of NAME); balanced over the SERVING ones (--worker-affinity)",
    )
    p.add_argument(
        "--worker-affinity",
        choices=("auto", "on", "off"),
        default="auto",
        help="send requests with the same context to the same worker (gRPC ring_hash on the state's "
        "first --affinity-prefix-bytes), round-robin when its queue is full; off: round-robin only; "
        "auto: on unless --worker is a single IP:PORT",
    )
    p.add_argument(
        "--affinity-prefix-bytes",
        type=positive_int,
        default=routing.DEFAULT_PREFIX_BYTES,
        help="UTF-8 bytes of the state's start that choose its worker",
    )
    p.add_argument(
        "--max-questions", type=_at_most(MAX_QUESTIONS), default=MAX_QUESTIONS, help="questions a request may hold"
    )
    p.add_argument(
        "--max-candidates",
        type=_at_most(MAX_CANDIDATES),
        default=MAX_CANDIDATES,
        help="candidates a request may hold, all questions together",
    )
    p.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help="candidate tokens one request may submit, all candidates together",
    )
    p.add_argument(
        "--max-rendered-bytes",
        type=positive_int,
        default=MAX_RENDERED_BYTES,
        help="UTF-8 bytes of all of a request's chat-wrapped candidate prompts together, checked before tokenizing",
    )
    p.add_argument(
        "--max-message-bytes",
        type=config.message_bytes,
        default=serving.MAX_MESSAGE_BYTES,
        help="the largest gRPC message on the public port, either way: a larger request is refused "
        "RESOURCE_EXHAUSTED by gRPC, a larger answer INVALID_ARGUMENT by the frontend before it is sent",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=positive_int,
        default=128,
        help="Decide calls served at once, and as many HTTP route requests (at most 32, its threads) on "
        "the HTTP port: each port counts its own; more are refused RESOURCE_EXHAUSTED (HTTP 503)",
    )
    p.add_argument(
        "--tokenizer-threads",
        type=positive_int,
        default=2,
        help="batches tokenized at once, by all requests together, in each of two lanes: batches of at "
        "most 64 Ki characters and larger ones (on gRPC's sending threads)",
    )
    p.add_argument(
        "--large-body-parses",
        type=positive_int,
        default=1,
        help="request bodies over 1 MiB parsed at once, each in a child process, the others waiting their "
        "turn (each can take ~30 times its size in memory while it is parsed)",
    )
    p.add_argument(
        "--worker-deadline-seconds",
        type=positive_float,
        default=120.0,
        help="the longest a request waits for a worker (a client's shorter deadline applies as is)",
    )
    p.add_argument(
        "--worker-refresh-seconds", type=positive_float, default=2.0, help="how often the worker is described again"
    )
    p.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help=f"bearer tokens the public API accepts, one a line (also ${security.AUTH_TOKENS_ENV}, comma-separated)",
    )
    p.add_argument("--worker-tls-ca", type=Path, default=None, help="CA that signed the workers' certificates (TLS)")
    p.add_argument("--worker-tls-cert", type=Path, default=None, help="this frontend's client certificate (mTLS)")
    p.add_argument("--worker-tls-key", type=Path, default=None, help="PEM private key of --worker-tls-cert")
    p.add_argument("--worker-tls-server-name", default=None, help="the name the workers' certificates carry")
    p.add_argument(
        "--http-listen",
        type=lambda text: config.host_port(text) if text else "",
        default="",
        help="also serve the HTTP/JSON API (POST /v1/systemone, /health, /openapi.json) at HOST:PORT (empty: off)",
    )
    p.add_argument(
        "--http-metrics",
        action="store_true",
        help="serve GET /metrics on the HTTP port too, behind the bearer tokens where there are any (off: the "
        "registry names worker addresses; --metrics-port serves it on the internal network)",
    )
    p.add_argument(
        "--http-max-body-bytes",
        type=positive_int,
        default=None,
        help="larger HTTP bodies get 413 (default: --max-message-bytes)",
    )
    config.add_server_flags(p, client="client")
    return p


def worker_target(text: str) -> str:
    """--worker checked when the flags are parsed: a bad one is a one-line error, exit 2."""
    try:
        parse_worker_targets(text)
    except TargetError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _at_most(limit: int):
    def check(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected an integer 1..{limit} (the contract's limit), got {text!r}")
        return value

    return check


def affinity_on(setting: str, worker: str) -> bool:
    """auto: on unless the target is one fixed address (then there is nothing to choose)."""
    if setting != "auto":
        return setting == "on"
    fixed = parse_worker_targets(worker).fixed
    return fixed is None or len(fixed) > 1


def main(argv: list[str] | None = None) -> None:
    args = config.parse_with_env(parser(), argv)
    logs.configure(args.log_level)
    return_large_blocks()
    with serving.exit_on_signal_while_starting("openjev-frontend"):
        serve(args)


def serve(args: argparse.Namespace) -> None:
    """Check the flags' files, connect to the workers, serve until SIGTERM."""
    config.log_config("openjev.frontend", args)
    try:
        public_credentials = security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        worker_credentials = security.channel_credentials(
            args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key, args.worker_tls_server_name
        )
        security.require_tls(
            public_credentials, plaintext=args.plaintext, link="the public port", flags="--tls-cert and --tls-key"
        )
        security.require_tls(
            worker_credentials,
            plaintext=args.plaintext,
            link="the connection to the workers",
            flags="--worker-tls-ca, and --worker-tls-cert and --worker-tls-key for mutual TLS",
        )
        tokens = security.load_tokens(args.auth_token_file)
    except security.SecurityError as error:
        raise SystemExit(f"openjev-frontend: {error}") from None
    if short := sum(len(token) < security.SHORT_TOKEN_CHARS for token in tokens):
        # accepted (the operator chose them), but said: nothing limits how often a caller may guess
        log.warning(
            "short_bearer_tokens",
            count=short,
            hint=f"use tokens of at least {security.SHORT_TOKEN_CHARS} random characters; "
            "failed attempts are not rate-limited here (docs/deploy.md)",
        )
    if public_credentials is None:
        log.warning("plaintext", port="public", reason="--plaintext", hint="set --tls-cert and --tls-key to serve TLS")
    if worker_credentials is None:
        log.warning(
            "plaintext",
            port="worker",
            reason="--plaintext",
            hint="set --worker-tls-ca (and a client certificate for mTLS)",
        )
    meta = load_export_meta_or_exit(args.model, "openjev-frontend")
    tokenizer = or_exit(PromptTokenizer.from_export, args.model, program="openjev-frontend")
    trim_heap()  # building it freed ~90 MiB that glibc would keep (memory.py)
    servers: list[serving.Server] = []

    def on_worker_state(state) -> None:
        # Health mirrors the worker link: SERVING only while a compatible worker answers.
        if servers:
            servers[0].set_serving(state.problem is None)

    link = WorkerLink(
        args.worker,
        fingerprint=tokenizer.fingerprint,
        max_length=meta.max_length,
        model_id=meta.model_id,
        temperature=meta.temperature,
        max_questions=args.max_questions,
        max_candidates=args.max_candidates,
        max_request_tokens=args.max_request_tokens,
        refresh_seconds=args.worker_refresh_seconds,
        on_state=on_worker_state,
        credentials=worker_credentials,
        tls_server_name=args.worker_tls_server_name,
        affinity=affinity_on(args.worker_affinity, args.worker),
    )
    servicer = DecisionServicer(
        meta,
        tokenizer,
        link,
        max_questions=args.max_questions,
        max_candidates=args.max_candidates,
        max_request_tokens=args.max_request_tokens,
        max_rendered_bytes=args.max_rendered_bytes,
        tokenizer_threads=args.tokenizer_threads,
        worker_deadline_seconds=args.worker_deadline_seconds,
        max_answer_bytes=args.max_message_bytes,
        large_body_parses=args.large_body_parses,
        affinity_prefix_bytes=args.affinity_prefix_bytes,
    )
    routing.declare_routes()
    name = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"].full_name
    observers = {f"/{name}/Decide": metrics.FrontendObserver()}
    traced = tracing.configure("openjev-frontend", args.otlp_endpoint)
    # before the gRPC server starts: a port it cannot have ends the process with nothing serving
    metrics.serve(metrics.frontend_registry, args.listen, args.metrics_port, "openjev-frontend")
    servers.append(
        serving.build_server(
            args.listen,
            lambda s: decision_pb2_grpc.add_DecisionServiceServicer_to_server(servicer, s),
            [name],
            interceptors=[
                *([tracing.ServerInterceptor({f"/{name}/Decide"})] if traced else []),
                interceptors.RequestInterceptor(observers, make_ids=True),
                *([security.BearerAuth(tokens)] if tokens else []),
            ],
            max_message_bytes=args.max_message_bytes,
            credentials=public_credentials,
            limits=CallLimits(
                work=args.max_concurrent_requests,
                watch=args.max_watch_streams,
                reflection=args.max_reflection_streams,
                work_methods=(f"/{name}/Decide",),
            ),
            program="openjev-frontend",
        )
    )
    server = servers[0]
    serving.stop_if_signalled_while_starting()
    http = start_http(args, servicer, link, tokens) if args.http_listen else None
    link.start()
    if args.port_file:
        args.port_file.write_text(str(server.port))
    log.info("listening", port=server.port, worker=args.worker, http_port=http.port if http else None)

    def stop() -> None:
        if http is not None:
            http.wait_stopped()
        link.close()
        servicer.close()
        tracing.shutdown()

    serving.serve_until_signal(
        server,
        grace_seconds=args.grace_seconds,
        on_signal=http.begin_stop if http else lambda: None,
        on_stop=stop,
    )


def start_http(args, servicer: DecisionServicer, link: WorkerLink, tokens: tuple[bytes, ...]):
    """The HTTP/JSON API on its own port beside the gRPC one, with the same bearer tokens and TLS
    files (so it is no way around either); /health is ready exactly when the gRPC health says
    SERVING."""
    from openjev.frontend.http.app import MAX_WORKERS, HttpApi
    from openjev.frontend.http.server import HttpServer

    auth = security.BearerAuth(tokens) if tokens else None
    api = HttpApi(
        servicer,
        lambda: link.state.problem,
        max_body_bytes=args.max_message_bytes if args.http_max_body_bytes is None else args.http_max_body_bytes,
        max_workers=min(MAX_WORKERS, args.max_concurrent_requests),
        authorize=None if auth is None else auth.allowed_headers,
        serve_metrics=args.http_metrics,
    )
    http = HttpServer(
        api,
        args.http_listen,
        grace_seconds=args.grace_seconds,
        tls_cert=None if args.tls_cert is None else str(args.tls_cert),
        tls_key=None if args.tls_key is None else str(args.tls_key),
        tls_client_ca=None if args.tls_client_ca is None else str(args.tls_client_ca),
    )
    http.start()
    return http


if __name__ == "__main__":
    main()

"""What both gRPC servers share: health, reflection, message-size limits, graceful SIGTERM."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from openjev import logs

log = logs.get("openjev.serving")

# 64 MiB: a request of 65,536 candidates' token ids fits; anything larger is refused by gRPC
# itself with RESOURCE_EXHAUSTED before it reaches a servicer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class ParseRequests(grpc.ServerInterceptor):
    """Request bytes that are not the method's message (garbage, a string field that is not
    UTF-8) are the caller's fault: INVALID_ARGUMENT naming the message, where gRPC itself would
    answer INTERNAL ("Exception deserializing request!"). Parsing moves into the handler."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def parsed(raw, context):
            try:
                return parse(raw)
            except Exception as error:  # DecodeError, UnicodeDecodeError, ...
                log.warning("malformed_request", method=handler_call_details.method, reason=repr(error))
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message for {handler_call_details.method}"
                )

        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary

            def run(raw_iterator, context):
                return behavior((parsed(raw, context) for raw in raw_iterator), context)
        else:
            behavior = handler.unary_unary or handler.unary_stream

            def run(raw, context):
                return behavior(parsed(raw, context), context)

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(run, request_deserializer=None, response_serializer=handler.response_serializer)


@dataclass
class Server:
    grpc_server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)


def build_server(
    listen: str,
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    *,
    max_workers: int = 32,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    max_connection_age_seconds: float = 0.0,
) -> Server:
    """A started server that reports NOT_SERVING until the caller says otherwise.
    max_connection_age_seconds > 0: clients are asked to reconnect that often (in-flight calls
    finish first), so a DNS-named group of workers is re-resolved and new ones get traffic."""
    names = tuple(service_names)
    options = channel_options(max_message_bytes)
    if max_connection_age_seconds > 0:
        options += [
            ("grpc.max_connection_age_ms", int(max_connection_age_seconds * 1000)),
            ("grpc.max_connection_age_grace_ms", 2**31 - 1),
        ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=options,
        interceptors=[*interceptors, ParseRequests()],
    )
    register(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = server.add_insecure_port(listen)
    if port == 0:
        raise SystemExit(f"cannot listen on {listen}")
    server.start()
    result = Server(server, health_servicer, port, names)
    result.set_serving(False)
    return result


def serve_until_signal(
    server: Server,
    *,
    grace_seconds: float,
    on_stop: Callable[[], None] = lambda: None,
    on_signal: Callable[[], None] = lambda: None,
) -> None:
    """Block until SIGTERM/SIGINT; then go NOT_SERVING, refuse new RPCs, let in-flight ones
    finish within the grace period, and return. on_signal: run at once on the signal (another
    listener starts draining alongside); on_stop: once the gRPC server has stopped."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Timed waits, not one endless wait: the kernel may deliver the signal to any of the
    # server's threads, and Python runs the handler only when the main thread next runs
    # bytecode, which a main thread blocked in an untimed wait never does (seen: SIGTERM
    # ignored under load, the process serving on).
    while not stop.wait(0.1):
        pass
    log.info("shutdown", grace_seconds=grace_seconds)
    server.set_serving(False)
    on_signal()
    server.grpc_server.stop(grace_seconds).wait()
    on_stop()
    log.info("stopped")

"""What a worker call cancelled by its caller leaves behind in the calling process, by how the
call is made: a future (as the frontend calls ExecuteUnary) or a stream of one reply read on the
calling thread (grpcio's SingleThreadedUnaryStream channel option). The server holds each call
until it is cancelled; another thread cancels it a few ms in, as the frontend does when its
client goes away. Prints the process's resident memory before and after N such calls.

    .venv/bin/python benchmarks/grpc_cancel_leak.py [--calls 3000] [--ways future,one-reply]

Why it exists: the one-reply stream takes a reply as fast as a blocking call and, unlike one, can
be cancelled, but grpcio (1.84) frees such a call only once its caller has read every operation's
event, and a call cancelled locally stops being read at the cancel (docs/benchmarks/index.md,
"The worker call read on the handler's thread").
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time
from concurrent import futures

import grpc
from grpc_floor import one_reply_channel  # run from benchmarks/

from openjev.tools.soak import rss_bytes


def held(request, context):
    """Answers only after 2 s: every call here ends by its caller's cancel."""
    started = time.monotonic()
    while context.is_active() and time.monotonic() - started < 2:
        time.sleep(0.002)
    return request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--ways", default="future,one-reply")
    args = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    handler = grpc.unary_unary_rpc_method_handler(held)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("held.Held", {"U": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = one_reply_channel(port)
    unary, one_reply = channel.unary_unary("/held.Held/U"), channel.unary_stream("/held.Held/U")

    def cancelled(way: str) -> None:
        call = unary.future(b"q", timeout=10) if way == "future" else one_reply(b"q", timeout=10)
        timer = threading.Timer(0.003, call.cancel)
        timer.start()
        try:
            call.result() if way == "future" else list(call)
        except (grpc.RpcError, grpc.FutureCancelledError):
            pass
        timer.join()

    for way in args.ways.split(","):
        for _ in range(300):  # warm: grpcio's and the allocator's one-off growth
            cancelled(way)
        gc.collect()
        before = rss_bytes(os.getpid()) / 2**20
        for _ in range(args.calls):
            cancelled(way)
        gc.collect()
        time.sleep(1)
        grown = rss_bytes(os.getpid()) / 2**20 - before
        print(
            f"{way}: {args.calls} calls cancelled, resident {before:.1f} -> {before + grown:.1f} MiB "
            f"({grown * 2**20 / args.calls / 1024:.1f} KiB a call)"
        )
    server.stop(None)


if __name__ == "__main__":
    main()

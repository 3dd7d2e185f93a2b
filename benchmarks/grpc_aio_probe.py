"""Would an asyncio gRPC server (grpc.aio), or a Unix socket instead of TCP loopback, take less
time around a request than the thread-pool server on TCP that the worker and frontend run? Each
serves one unary method whose handler hands the work to another thread (as the worker hands a
request to its scheduler's thread) and waits for it; the work sleeps `--work-ms` (a pass waiting
on the GPU releases the GIL). Each server runs in a process of its own; the client calls them in
a shuffled order, each call after `--gap-ms` idle (as a request's hops idle through a pass), and
prints the time above the work, ms.

    .venv/bin/python benchmarks/grpc_aio_probe.py [--repeats 300] [--work-ms 8] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import random
import shutil
import tempfile
import threading
import time
from concurrent import futures

import grpc


def _same(b: bytes) -> bytes:
    return b


def _work_thread(work_s: float) -> queue.Queue:
    """A thread that runs jobs one at a time (the scheduler): sleeps work_s, then calls done()."""
    jobs: queue.Queue = queue.Queue()

    def loop() -> None:
        while True:
            done = jobs.get()
            time.sleep(work_s)
            done()

    threading.Thread(target=loop, daemon=True).start()
    return jobs


def _handlers(method) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler(method, _same, _same)
    return grpc.method_handlers_generic_handler("probe.P", {"M": unary})


def _serve_threads(work_s: float, address: str, ports: multiprocessing.Queue) -> None:
    jobs = _work_thread(work_s)

    def method(request, context):
        done = threading.Event()
        jobs.put(done.set)
        done.wait()
        return request

    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((_handlers(method),))
    ports.put(server.add_insecure_port(address))
    server.start()
    server.wait_for_termination()


def _serve_aio(work_s: float, address: str, ports: multiprocessing.Queue) -> None:
    jobs = _work_thread(work_s)

    async def method(request, context):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        jobs.put(lambda: loop.call_soon_threadsafe(done.set_result, None))
        await done
        return request

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(method),))
        ports.put(server.add_insecure_port(address))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--work-ms", type=float, default=8.0)
    p.add_argument("--gap-ms", type=float, default=20.0)
    args = p.parse_args()
    work_s = args.work_ms / 1e3
    spawn = multiprocessing.get_context("spawn")
    calls, servers = {}, []
    socket_dir = tempfile.mkdtemp(prefix="grpc-probe-")
    arms = (
        ("thread pool", _serve_threads, "127.0.0.1:0"),
        ("grpc.aio", _serve_aio, "127.0.0.1:0"),
        ("thread pool, Unix socket", _serve_threads, f"unix:{socket_dir}/probe.sock"),
    )
    for name, target, address in arms:
        ports: multiprocessing.Queue = spawn.Queue()
        server = spawn.Process(target=target, args=(work_s, address, ports), daemon=True)
        server.start()
        servers.append(server)
        port = ports.get(timeout=30)
        channel = grpc.insecure_channel(address if address.startswith("unix:") else f"127.0.0.1:{port}")
        calls[name] = channel.unary_unary("/probe.P/M", request_serializer=_same, response_deserializer=_same)
    try:
        for call in calls.values():
            for _ in range(10):
                call(b"x" * 100, timeout=10)
        above: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name in random.sample(list(calls), len(calls)):
                time.sleep(args.gap_ms / 1e3)
                started = time.perf_counter()
                calls[name](b"x" * 100, timeout=10)
                above[name].append((time.perf_counter() - started - work_s) * 1e3)
    finally:
        for server in servers:
            server.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
    print(f"ms above {args.work_ms} ms of work, {args.repeats} calls each after {args.gap_ms} ms idle")
    print("| server | p10 | p50 | p90 |")
    print("|---|---|---|---|")
    for name, values in above.items():
        values.sort()
        n = len(values)
        print(f"| {name} | {values[n // 10]:.3f} | {values[n // 2]:.3f} | {values[9 * n // 10]:.3f} |")


if __name__ == "__main__":
    main()

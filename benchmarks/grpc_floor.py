"""The floor a Python gRPC round trip puts under every request on this host: a unary call to a
server that answers at once, the server in another process (as frontend and worker are) and in
this one, called as a future (as the frontend calls its worker) and blocking (as a client does).

    python3 benchmarks/grpc_floor.py [--repeats 400] [--label TEXT]

Run it under different conditions (taskset, GRPC_POLL_STRATEGY, ...) to see what the host's
thread wake-ups cost: `device_run.sh grpc-floor` does that on the GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

SERVER = """
import sys, time
from concurrent import futures
import grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"r")
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bare.Bare", {"U": handler}),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()  # until the parent closes it
"""


def in_process_server() -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"r")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bare.Bare", {"U": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--label", default="")
    args = p.parse_args()
    child = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    other_port = int(child.stdout.readline())
    server, own_port = in_process_server()
    try:
        calls = {}
        for where, port in (("other process", other_port), ("this process", own_port)):
            call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/bare.Bare/U")
            calls[f"{where}, future"] = lambda call=call: call.future(b"q").result()
            calls[f"{where}, blocking"] = lambda call=call: call(b"q")
        times: dict[str, list[float]] = {name: [] for name in calls}
        for rep in range(args.repeats + 20):
            for name, fn in calls.items():  # interleaved: drift lands on every arm alike
                started = time.perf_counter()
                fn()
                if rep >= 20:
                    times[name].append(1e3 * (time.perf_counter() - started))
    finally:
        server.stop(None)
        child.stdin.close()
        child.wait(10)
    print(f"{args.label or 'default'}: bare unary round trip, ms p10 / p50 / p90 of {args.repeats}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"  {name:24s} {q[0]:.3f} / {statistics.median(values):.3f} / {q[-1]:.3f}")


if __name__ == "__main__":
    main()

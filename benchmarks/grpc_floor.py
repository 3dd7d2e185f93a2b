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

import grpc
from service_overhead import bare_unary_server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--label", default="")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the other process's part
    args = p.parse_args()
    if args.serve:  # print the port, serve until the parent closes stdin
        server, port = bare_unary_server()
        print(port, flush=True)
        sys.stdin.read()
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    other_port = int(child.stdout.readline())
    server, own_port = bare_unary_server()
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

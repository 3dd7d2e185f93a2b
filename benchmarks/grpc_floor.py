"""The floor a Python gRPC round trip puts under every request on this host: a unary call to a
server that answers at once, the server in another process (as frontend and worker are) and in
this one, called as a future (as the frontend calls its worker), blocking (as a client does) and
as a stream of one reply read on the calling thread (a SingleThreadedUnaryStream channel: as fast
as blocking and cancellable, but a call cancelled locally is never freed: grpc_cancel_leak.py).

    python3 benchmarks/grpc_floor.py [--repeats 400] [--label TEXT]

Run it under different conditions (taskset, GRPC_POLL_STRATEGY, ...) to see what the host's
thread wake-ups cost: `device_run.sh grpc-floor` does that on the GPU machine. With `--gap-ms G`
every call is also made after G ms of idling (untimed), as a request's hops idle through a model
pass, in three ways interleaved with the back-to-back calls: asleep; asleep with the kernel asked
for zero C-state exit latency (/dev/cpu_dma_latency held at 0 around the call, a system-wide
request, root only; the arm is left out where the device cannot be written); and spinning on
this thread. With `--awake` also asleep while every CPU of the host is kept busy by SCHED_IDLE
spinners (cpu_awake.py: no CPU idles, so none has to be woken for the call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import grpc
import grpc.experimental  # not imported by `import grpc`: ChannelOptions
from cpu_awake import Spinners
from service_overhead import bare_unary_server


def one_reply_channel(port: int) -> grpc.Channel:
    """A channel to 127.0.0.1:`port` whose unary-stream calls are read on the calling thread."""
    options = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def one_reply_call(port: int):
    """/bare.Bare/U at `port` as a stream of one reply, read on the calling thread."""
    channel = one_reply_channel(port)
    call = channel.unary_stream("/bare.Bare/U")
    return lambda channel=channel: list(call(b"q"))  # the default keeps the channel open


def hold_dma_latency() -> int | None:
    """An open /dev/cpu_dma_latency with 0 written (the request lasts while the file is open), or
    None where the device is missing or not writable."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        return None
    os.write(fd, (0).to_bytes(4, sys.byteorder))
    return fd


def idlers(gap_ms: float, spinners: Spinners | None) -> dict[str, tuple[object, object]]:
    """(before the call, after it) for each way of idling through the gap."""
    gap = gap_ms / 1e3
    nothing = lambda *_: None  # noqa: E731
    sleep = lambda: time.sleep(gap)  # noqa: E731

    def spin():
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass

    out: dict[str, tuple[object, object]] = {"back to back": (nothing, nothing)}
    if gap_ms:
        out[f"after {gap_ms:g} ms asleep"] = (sleep, nothing)
        probe = hold_dma_latency()
        if probe is not None:
            os.close(probe)
            held: list[int | None] = [None]

            def hold_and_sleep():
                held[0] = hold_dma_latency()
                sleep()

            def release():
                if held[0] is not None:
                    os.close(held[0])

            out[f"after {gap_ms:g} ms asleep, C-states held"] = (hold_and_sleep, release)
        out[f"after {gap_ms:g} ms spinning"] = (spin, nothing)
        if spinners is not None:

            def awake_and_sleep():
                spinners.awake(True)
                sleep()

            out[f"after {gap_ms:g} ms asleep, CPUs awake"] = (awake_and_sleep, lambda: spinners.awake(False))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--label", default="")
    p.add_argument("--gap-ms", type=float, default=0.0, help="also call after idling this long (untimed)")
    p.add_argument("--awake", action="store_true", help="with --gap-ms: an arm with every CPU kept busy")
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
    spinners = Spinners() if args.gap_ms and args.awake else None
    try:
        calls = {}
        for where, port in (("other process", other_port), ("this process", own_port)):
            call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/bare.Bare/U")
            calls[f"{where}, future"] = lambda call=call: call.future(b"q").result()
            calls[f"{where}, blocking"] = lambda call=call: call(b"q")
            calls[f"{where}, one-reply stream"] = one_reply_call(port)
        ways = idlers(args.gap_ms, spinners)
        times: dict[tuple[str, str], list[float]] = {(w, name): [] for w in ways for name in calls}
        for rep in range(args.repeats + 20):
            for way, (before, after) in ways.items():  # interleaved: drift lands on every arm alike
                for name, fn in calls.items():
                    before()
                    started = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - started
                    after()
                    if rep >= 20:
                        times[way, name].append(1e3 * elapsed)
    finally:
        if spinners is not None:
            spinners.close()
        server.stop(None)
        child.stdin.close()
        child.wait(10)
    print(f"{args.label or 'default'}: bare unary round trip, ms p10 / p50 / p90 of {args.repeats}")
    for (way, name), values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"  {way + ', ' + name:58s} {q[0]:.3f} / {statistics.median(values):.3f} / {q[-1]:.3f}")


if __name__ == "__main__":
    main()

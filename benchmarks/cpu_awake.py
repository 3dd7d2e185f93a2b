"""Keep every CPU of the host out of its idle state: one spinning process a CPU at SCHED_IDLE
priority (it runs only when nothing else wants that CPU), stopped and continued with signals so
that a benchmark can interleave "CPUs awake" with "CPUs allowed to idle" arm by arm.

Why: on the GPU host a gRPC hop after a model pass costs ~0.7 ms more than one back to back
(docs/benchmarks/index.md, "Where the time outside inference goes on the H200 host"), and neither
a zero C-state exit latency request nor spinning the calling thread changed it. If waking the
server's idle CPUs is that cost (a virtual machine's halted vCPUs, for one), CPUs kept busy
remove it. Measured: they do not (docs/benchmarks/index.md, "Idle CPUs are not the time outside
inference").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# The spinner: pinned to its CPU, at SCHED_IDLE, killed when the benchmark that started it dies
# (one stopped by `timeout` must not leave CPUs spinning for the next); set up in the child itself,
# not by a preexec_fn, which is unsafe in a process that already runs gRPC's threads.
_SPIN = """
import ctypes, os, signal, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):  # the benchmark ended before the line above
    sys.exit()
while True:
    pass
"""


class Spinners:
    """One SCHED_IDLE busy loop pinned to each CPU this process may run on; stopped at first."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        for cpu in sorted(os.sched_getaffinity(0)):
            self.procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), str(os.getpid())]))
        time.sleep(0.2)  # set up before first stopped (one that is not sets up when first continued)
        self.awake(False)

    def awake(self, on: bool) -> None:
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGCONT if on else signal.SIGSTOP)
        if on:
            time.sleep(0.002)  # scheduled on their CPUs before the timed call

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait()

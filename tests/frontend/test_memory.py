"""The frontend's large blocks go back to the operating system when freed (`frontend/memory.py`),
in fresh processes: 16 threads each take and free 4 MiB blocks, keeping a small block after each
(as a handler thread keeps its next small objects), which pinned the freed blocks in glibc's
per-thread heaps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from openjev.frontend.memory import return_large_blocks

    def rss_mib():
        for line in open(f"/proc/{os.getpid()}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    if sys.argv[1] == "on":
        assert return_large_blocks()
    before = rss_mib()
    kept = []

    def work():
        for _ in range(8):
            block = bytearray(4 << 20)
            block[::4096] = b"x" * len(block[::4096])  # every page touched
            kept.append(bytearray(200))
            del block

    threads = [threading.Thread(target=work) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(rss_mib() - before)
    """
)


def _growth_mib(arm: str) -> float:
    done = subprocess.run([sys.executable, "-c", SCRIPT, arm], capture_output=True, text=True, timeout=60, check=True)
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_freed_large_blocks_leave_the_process():
    on = _growth_mib("on")
    off = _growth_mib("off")  # glibc's default, the control: the same work keeps what it freed
    assert on < 4, on
    assert off > on + 6, (off, on)

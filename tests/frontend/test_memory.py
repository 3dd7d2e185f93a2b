"""The frontend's freed memory goes back to the operating system (`frontend/memory.py`), in fresh
processes: large blocks freed by 16 threads, each keeping a small block after each (as a handler
thread keeps its next small objects), which pinned the freed blocks in glibc's per-thread heaps;
and the heap the tokenizer's build freed, which a started frontend no longer holds."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from openjev.tools import launch
from openjev.tools.soak import rss_bytes

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


# The frontend's modules and its tokenizer built as `serve` builds them, without the trim after it;
# then it waits (stdin) while the test reads its resident size.
TOKENIZER_ONLY = textwrap.dedent(
    """
    import sys
    import openjev.frontend.main
    from openjev.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.from_export(sys.argv[1])
    print("built", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_started_frontend_does_not_keep_the_heap_its_tokenizer_freed(demo_model, tmp_path):
    """Building Qwen's tokenizer frees ~90 MiB of parsed document in small blocks, which glibc
    kept: the control sits at ~226 MiB, a started frontend at ~145 since it trims its heap."""
    command = [sys.executable, "-c", TOKENIZER_ONLY, str(demo_model)]
    control = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert control.stdout is not None and control.stdout.readline() == "built\n"
        untrimmed = rss_bytes(control.pid) / (1 << 20)
    finally:
        control.kill()
        control.wait(10)
    pair = launch.start_pair(demo_model, tmp_path)
    try:
        started = rss_bytes(pair.frontend.popen.pid) / (1 << 20)
    finally:
        pair.stop()
    assert untrimmed > 200, f"the control kept only {untrimmed:.0f} MiB: this test measures nothing"
    assert started < untrimmed - 60, (started, untrimmed)

"""The worker's held-tokens gauge, read from its metrics port (tests of the held-token budget)."""

from __future__ import annotations

import time
import urllib.request


def held(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith("openjev_worker_held_tokens "))


def wait_held(metrics_url: str, tokens: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := held(metrics_url)) != tokens:
        assert time.monotonic() < deadline, f"the worker holds {now} tokens, not {tokens}"
        time.sleep(0.02)

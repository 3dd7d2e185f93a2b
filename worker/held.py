"""The worker's budget of candidate tokens held at once, over every call from its first candidate
to its answer: streams still arriving (their ids kept until the commit, for up to the commit
timeout), requests waiting for a pass, being planned and running (4 bytes a token as ids, about
twice that while a plan is built).

The call caps count calls, not what each holds: without this, 144 uncommitted streams of 4 M
tokens held ~4.7 GiB, and every admitted request could plan 4 M tokens at once
(docs/reliability.md). A candidate that would take the total past the budget ends its call
RESOURCE_EXHAUSTED (QueueFull, as a full queue: load, retried later or by the frontend on another
worker).

Calls arrive interleaved, so a plain total would let several large requests each take part of
the budget and all be refused part-way, none served. Instead the oldest call holding tokens has
`reserve` tokens (the per-request limit) of its own, and the others share the rest: the oldest
is never refused, so some request always progresses, and the total stays within the budget.
"""

from __future__ import annotations

import threading

from openjev.worker.scheduler import QueueFull


class HeldTokens:
    """The worker's total; one `Hold` per call takes from it and gives back what it took.
    limit: the budget (None: none); reserve: the oldest holder's own share (at most limit)."""

    def __init__(self, limit: int | None, reserve: int = 0):
        if limit is not None and not 0 <= reserve <= limit:
            raise ValueError(f"reserve {reserve} is not within the budget of {limit} tokens")
        self.limit = limit
        self.reserve = reserve
        self._held = 0
        self._holders: dict[Hold, None] = {}  # in the order of their first take: the first is the oldest
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def hold(self) -> Hold:
        return Hold(self)

    def _take(self, hold: Hold, tokens: int) -> None:
        with self._lock:
            if self.limit is not None:
                oldest = next(iter(self._holders), hold)
                oldest_tokens = oldest.tokens + (tokens if oldest is hold else 0)
                shared = self._held + tokens - min(oldest_tokens, self.reserve)
                if shared > self.limit - self.reserve:
                    raise QueueFull(
                        f"worker is holding its limit of {self.limit} candidate tokens "
                        "(requests arriving, waiting and running); retry later"
                    )
            self._held += tokens
            hold.tokens += tokens
            self._holders.setdefault(hold)

    def _give_back(self, hold: Hold) -> None:
        with self._lock:
            self._held -= hold.tokens
            hold.tokens = 0
            self._holders.pop(hold, None)


class Hold:
    """One call's share: `take` as its candidates arrive, everything given back when the call
    ends (a context manager, so every way out of the call gives it back)."""

    def __init__(self, budget: HeldTokens):
        self._budget = budget
        self.tokens = 0

    def take(self, tokens: int) -> None:
        """Raises QueueFull when the worker's total would pass its budget."""
        self._budget._take(self, tokens)

    def release(self) -> None:
        self._budget._give_back(self)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

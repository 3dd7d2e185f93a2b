"""The worker's budget of candidate tokens held at once, over every call from its first candidate
to its answer: streams still arriving (their ids kept until the commit, for up to the commit
timeout), requests waiting for a pass, being planned and running (4 bytes a token as ids, about
twice that while a plan is built).

The call caps count calls, not what each holds: without this, 144 uncommitted streams of 4 M
tokens held ~4.7 GiB, and every admitted request could plan 4 M tokens at once
(docs/reliability.md). A candidate that would take the total past the budget ends its call
RESOURCE_EXHAUSTED (QueueFull, as a full queue: load, not a fault of the request; with context
affinity the frontend sends the request once more, round-robin).

Calls arrive interleaved, so a plain total would let several large requests each take part of
the budget and all be refused part-way, none served. So the other calls leave room for the
oldest request still arriving to finish arriving: what its header says it may still send (its
candidates times the longest prompt, at most the per-request token limit; an ExecuteUnary
request's own total), less what it holds. It is refused only when what the others took before
it became the oldest leaves it too little; as they end (or are refused) that comes back, so a
request always gets through.
"""

from __future__ import annotations

import threading

from openjev.worker.scheduler import QueueFull


class HeldTokens:
    """The worker's total; one `Hold` per call takes from it and gives back what it took.
    limit: the budget (None: none)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._held = 0
        self._arriving: dict[Hold, None] = {}  # uncommitted holders by first take: the first is the oldest
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
                oldest = next(iter(self._arriving), hold)
                room = 0 if oldest is hold else max(0, oldest.bound - oldest.tokens)
                if self._held + tokens + room > self.limit:
                    raise QueueFull(
                        f"worker cannot hold {tokens} more candidate tokens now ({self._held} of its "
                        f"{self.limit} held, {room} kept for the oldest request still arriving); retry later"
                    )
            self._held += tokens
            hold.tokens += tokens
            self._arriving.setdefault(hold)

    def _arrived(self, hold: Hold) -> None:
        with self._lock:
            self._arriving.pop(hold, None)

    def _give_back(self, hold: Hold) -> None:
        with self._lock:
            self._held -= hold.tokens
            hold.tokens = 0
            self._arriving.pop(hold, None)


class Hold:
    """One call's share: `expect` its most tokens once its header is read, `take` as its
    candidates arrive, `arrived` at its commit; everything given back when the call ends (a
    context manager, so every way out of the call gives it back)."""

    def __init__(self, budget: HeldTokens):
        self._budget = budget
        self.tokens = 0
        self.bound = 0  # the most tokens the call may hold in all, once its header is read

    def expect(self, bound: int) -> None:
        self.bound = bound

    def take(self, tokens: int) -> None:
        """Raises QueueFull when the worker's total would pass its budget."""
        self._budget._take(self, tokens)

    def arrived(self) -> None:
        """Every candidate is in: no room is kept for this call any more."""
        self._budget._arrived(self)

    def release(self) -> None:
        self._budget._give_back(self)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

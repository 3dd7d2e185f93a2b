"""The held-token budget's rule on random interleavings of calls: the total never passes the
budget, and requests arriving at once do not all starve one another part-way (the others leave
room for the oldest request still arriving)."""

from __future__ import annotations

import random

import pytest

from openjev.worker.held import HeldTokens
from openjev.worker.scheduler import QueueFull


def _round(rng: random.Random, limit: int, calls: int) -> int:
    """`calls` requests arriving at once, taking in turn in random steps; a refused call gives
    its tokens back only after every other call's next step (as in the worker, where a refused
    call's handler ends while the others go on receiving), a complete one is answered (gives back)
    at once. Returns how many completed."""
    budget = HeldTokens(limit)
    left = {}
    for _ in range(calls):
        hold = budget.hold()
        hold.expect(rng.randrange(limit // 2, limit + 1))
        left[hold] = hold.bound
    completed, refused = 0, []
    while left or refused:
        for hold in list(left):
            tokens = min(left[hold], rng.randrange(1, limit // 8 + 2))
            try:
                hold.take(tokens)
            except QueueFull:
                refused.append(hold)
                del left[hold]
                continue
            assert budget.held <= limit
            left[hold] -= tokens
            if not left[hold]:
                hold.arrived()
                hold.release()
                completed += 1
                del left[hold]
        for hold in refused:  # their handlers have ended by now
            hold.release()
        refused = []
    assert budget.held == 0
    return completed


@pytest.mark.parametrize("seed", range(30))
def test_requests_arriving_at_once_never_all_starve(seed):
    rng = random.Random(seed)
    assert _round(rng, limit=rng.randrange(10, 5000), calls=rng.randrange(2, 12)) >= 1


def test_without_room_for_the_oldest_they_can_all_starve():
    """The mutation the rule exists for: with no room kept (every call as if the oldest), some
    round of the seeds above ends with no request complete."""
    original = HeldTokens._take

    def plain(self, hold, tokens):
        with self._lock:
            if self._held + tokens > self.limit:
                raise QueueFull("full")
            self._held += tokens
            hold.tokens += tokens

    HeldTokens._take = plain  # type: ignore[method-assign]
    try:
        outcomes = []
        for seed in range(30):
            rng = random.Random(seed)
            outcomes.append(_round(rng, limit=rng.randrange(10, 5000), calls=rng.randrange(2, 12)))
    finally:
        HeldTokens._take = original  # type: ignore[method-assign]
    assert 0 in outcomes


def _oldest_and_other():
    budget = HeldTokens(100)
    oldest, other = budget.hold(), budget.hold()
    oldest.expect(10)
    oldest.take(1)  # 9 kept for it from now on
    other.expect(100)
    other.take(90)  # 1 + 90 + 9 = 100
    with pytest.raises(QueueFull, match=r"cannot hold 1 more candidate tokens now \(91 of its 100 held, 9 kept"):
        other.take(1)
    return budget, oldest, other


def test_the_oldest_arriving_request_takes_its_room():
    budget, oldest, _ = _oldest_and_other()
    oldest.take(9)
    assert budget.held == 100


def test_a_committed_request_keeps_no_room():
    budget, oldest, other = _oldest_and_other()
    oldest.arrived()  # committed with 1 token: nothing more comes
    other.take(9)
    assert budget.held == 100


def test_no_budget_takes_anything():
    budget = HeldTokens(None)
    hold = budget.hold()
    hold.take(1 << 40)
    assert budget.held == 1 << 40
    hold.release()
    assert budget.held == 0

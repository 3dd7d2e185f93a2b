"""The held-token budget's rule on random interleavings of calls: the total never passes the
budget, and the oldest holder is never refused while within its reserve (so concurrent large
requests cannot all be refused part-way)."""

from __future__ import annotations

import random

import pytest

from openjev.worker.held import HeldTokens
from openjev.worker.scheduler import QueueFull


@pytest.mark.parametrize("seed", range(20))
def test_random_calls_stay_within_the_budget_and_the_oldest_always_fits(seed):
    rng = random.Random(seed)
    reserve = rng.randrange(1, 2000)
    budget = HeldTokens(reserve + rng.randrange(0, 4000), reserve)
    live: list = []  # holds, oldest first by their first take
    refusals = 0
    for _ in range(2000):
        if live and rng.random() < 0.2:  # a call ends (answered, refused, cancelled)
            live.pop(rng.randrange(len(live))).release()
            continue
        hold = budget.hold() if not live or rng.random() < 0.3 else rng.choice(live)
        tokens = rng.randrange(1, reserve // 3 + 2)
        if hold.tokens + tokens > reserve:  # past the per-request limit: the stream refuses it before the budget
            continue
        oldest = next((h for h in live if h.tokens), None)
        try:
            hold.take(tokens)
        except QueueFull:
            assert hold is not oldest, "the oldest holder was refused within its reserve"
            refusals += 1
            hold.release()  # a refused call ends
            if hold in live:
                live.remove(hold)
            continue
        if hold not in live:
            live.append(hold)
        assert budget.held == sum(h.tokens for h in live) <= budget.limit
    assert refusals > 0  # the budget was reached
    for hold in live:
        hold.release()
    assert budget.held == 0


def test_the_oldest_holder_is_the_first_to_take():
    budget = HeldTokens(10, 6)
    first, second = budget.hold(), budget.hold()
    second.take(4)  # the first to take is the oldest: 4 of its own 6
    first.take(4)  # the shared 4
    with pytest.raises(QueueFull):
        first.take(1)
    second.take(2)  # the oldest, up to its reserve: the total is the budget
    assert budget.held == 10
    second.release()
    first.take(2)  # now the oldest: 6 of its own
    assert budget.held == 6


def test_no_budget_takes_anything():
    budget = HeldTokens(None)
    hold = budget.hold()
    hold.take(1 << 40)
    assert budget.held == 1 << 40
    hold.release()
    assert budget.held == 0

"""A pass keeps within the runner's room for states (CudaRunner's captured passes hold 8 parents'
states and 8 kept states; beyond them a pass ran eagerly), and the cache's deposits take only
the room left: answers do not change, deposits are best effort."""

from __future__ import annotations

import random

from openjev.worker.cache.sizing import build_state_cache
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner import PackLimits

TEMPERATURE = 2.0


class _Room:
    """The demo model's torch runner, saying it holds `states` states a pass (as CudaRunner
    does), and recording what each pass kept and read."""

    def __init__(self, runner, states: int | None):
        self._runner = runner
        if states is not None:
            self.max_pass_states, self.max_pass_context = states, 1 << 20
        self.passes: list[tuple[int, int]] = []  # (kept states, distinct parents' states)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run_launch(self, runs):
        parents = {id(r.parent_state) for r in runs if r.parent_state is not None}
        self.passes.append((sum(r.keep_state for r in runs), len(parents)))
        return self._runner.run_launch(runs)


def _own_contexts(seed: int) -> list[QuestionWork]:
    """6 choice questions of 3 candidates, each question over its own 300-token context."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    return [
        QuestionWork("choice", tuple(tuple(context + tokens(4)) for _ in range(3)))
        for context in (tokens(300) for _ in range(6))
    ]


def test_deposits_take_only_the_room_a_pass_has(torch_runner):
    """Such a request deposits more states than a captured pass keeps (18 kept with no room
    given). With room for 2, no pass keeps more than 2 or reads more than 2 parents' states,
    the answers are the same bits, and the cache still took 2 states from it."""
    work = _own_contexts(3)
    unbounded = _Room(torch_runner, None)
    Engine(unbounded, pack_limits=PackLimits(), state_cache=build_state_cache(unbounded, 256 << 20, "t")).execute(
        work, temperature=TEMPERATURE, policy="default"
    )
    assert max(kept for kept, _ in unbounded.passes) > 2
    room = _Room(torch_runner, 2)
    engine = Engine(room, pack_limits=PackLimits(), state_cache=build_state_cache(room, 256 << 20, "t"))
    got = engine.execute(work, temperature=TEMPERATURE, policy="default")
    assert all(kept <= 2 and parents <= 2 for kept, parents in room.passes), room.passes
    assert engine.state_cache is not None and len(engine.state_cache) == 2
    alone = Engine(torch_runner).execute(work, temperature=TEMPERATURE, policy="default")
    assert got.head_scores == alone.head_scores

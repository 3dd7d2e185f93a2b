"""Shape buckets of forest passes: the one key type (PassKey) and the one place that maps a pass
to its key, lays out its index buffer, and lists every key a budget needs (`Bucketing.keys`,
captured at start by CudaRunner.warm_up).

A key holds only what a captured graph's device-side shapes and launch counts depend on:
- tokens T_pad: fine steps (`steps` per octave, so at most 1/steps of a pass is padding; twice
  as many from `fine_from` tokens on, where a worker sets --graph-fine-from);
- levels: recurrence launches per GDN layer, 1, 2, 4, 8 (capped at the budget's depth): a
  level launch whose segments are all absent costs a grid of blocks that exit at once;
- kept: whether the pass keeps any state (then MAX_STATE_SLOTS output slots are copied).
The rest follows from T_pad alone, so the key set stays small: segments N_pad = min(budget
segments, T_pad) + 1 (the real ones, one pad segment holding the T_pad - T pad tokens, then
empty ones); attention max_q = T_pad rounded up to 64. Ancestors' K/V rows, parent states and
kv_rows live in static buffers of fixed size (graph_launch._Statics), outside the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from openjev.worker.cuda.graphs import fine_bucket
from openjev.worker.geometry import GDN_CHUNK_TOKENS

MAX_STATE_SLOTS = 8  # external parents / kept states a captured pass holds (~150 MB each, 27B shape)
LEVEL_STEPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class PassBudget:
    """What the runner is warmed for. tokens, segments: a pass's most tokens and segments (the
    scheduler's --max-pass-tokens, --max-pass-segments); depth: most levels (max_pass_depth);
    context: most ancestor K/V rows from kept states a pass reads; steps: token buckets per octave;
    fine_from: from this many tokens on (0: never), twice as many (products of long passes are
    compute-bound, so their padding costs its share of the time; more graphs at start)."""

    tokens: int = 4096
    segments: int = 64
    depth: int = 8
    context: int = 16384
    steps: int = 4
    fine_from: int = 0

    def bucket(self, n: int) -> int:
        """The padded token count of a pass of n tokens."""
        return fine_bucket(n, steps=self.steps * (2 if self.fine_from and n >= self.fine_from else 1))

    @property
    def kv_rows(self) -> int:
        """Capacity of the static kv_rows index buffer: every segment sees at most all
        ancestor rows and all of the pass's own rows."""
        return (self.segments + 1) * (self.context + self.bucket(self.tokens))


@dataclass(frozen=True, order=True)
class PassKey:
    """A captured graph's bucket."""

    tokens: int  # T_pad
    levels: int  # recurrence launches per GDN layer
    kept: bool  # kept states are copied out (MAX_STATE_SLOTS slots)
    segments: int  # N_pad
    max_q: int  # attention grid rows (multiple of 64)
    tail_rows: bool = False  # the chunked GDN kernel's tail sources (64 a segment) in the index buffer

    def layout(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, length) in the int32 index buffer."""
        T, N = self.tokens, self.segments
        sizes = [
            ("ids", T),
            ("pos", T),
            ("cu", N + 1),
            ("cu_k", N + 1),
            ("heads", N),
            ("gdn_init", N),
            ("level_off", self.levels + 1),
            ("win_src", 3 * N),
            ("tail_src", GDN_CHUNK_TOKENS * N if self.tail_rows else 0),
            ("keep", MAX_STATE_SLOTS if self.kept else 1),
        ]
        out, at = {}, 0
        for name, n in sizes:
            out[name] = (at, n)
            at += n
        return out

    @property
    def index_size(self) -> int:
        return sum(n for _, n in self.layout().values())


class Bucketing:
    """Pass -> PassKey under one budget; None (with the reason) for passes outside it."""

    def __init__(self, budget: PassBudget, tail_rows: bool = False):
        if budget.tokens < 1 or budget.depth < 1 or budget.segments < budget.depth or budget.context < 0:
            raise ValueError(f"bad pass budget {budget}")
        self.budget, self.tail_rows = budget, tail_rows

    def token_steps(self) -> list[int]:
        """Every T_pad a pass within budget can have, ascending."""
        out, n = [], 1
        while n <= self.budget.tokens:
            t = self.budget.bucket(n)
            out.append(t)
            n = t + 1
        return out

    def level_steps(self) -> list[int]:
        steps = [d for d in LEVEL_STEPS if d < self.budget.depth] + [self.budget.depth]
        return sorted(set(steps))

    def make(self, tokens_pad: int, levels: int, kept: bool) -> PassKey:
        segments = min(self.budget.segments, tokens_pad) + 1
        return PassKey(tokens_pad, levels, kept, segments, 64 * -(-tokens_pad // 64), self.tail_rows)

    def keys(self) -> list[PassKey]:
        """Every key a pass within budget maps to (what warm_up captures)."""
        return [self.make(t, d, kept) for t in self.token_steps() for d in self.level_steps() for kept in (False, True)]

    def key(
        self, tokens: int, segments: int, levels: int, parents: int, kept: int, base: int, kv_rows: int
    ) -> tuple[PassKey | None, str]:
        """(key, "") or (None, why the pass runs eagerly)."""
        b = self.budget
        checks = [
            (tokens <= b.tokens, f"{tokens} tokens > budget {b.tokens}"),
            (segments <= b.segments, f"{segments} segments > budget {b.segments}"),
            (levels <= b.depth, f"{levels} levels > budget {b.depth}"),
            (parents <= MAX_STATE_SLOTS, f"{parents} parent states > {MAX_STATE_SLOTS} slots"),
            (kept <= MAX_STATE_SLOTS, f"{kept} kept states > {MAX_STATE_SLOTS} slots"),
            (base <= b.context, f"{base} ancestor rows > budget {b.context}"),
            (kv_rows <= b.kv_rows, f"{kv_rows} key rows > capacity {b.kv_rows}"),
        ]
        for ok, why in checks:
            if not ok:
                return None, why
        levels_pad = next(d for d in self.level_steps() if d >= levels)
        return self.make(b.bucket(tokens), levels_pad, kept > 0), ""

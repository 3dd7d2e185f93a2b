"""Shape buckets of forest passes: the one key type (PassKey) and the one place that maps a pass
to its key, lays out its index buffer, and lists every key a budget needs (`Bucketing.keys`,
captured at start by CudaRunner.warm_up).

A key holds only what a captured graph's device-side shapes and launch counts depend on:
- tokens T_pad: fine steps (`steps` per octave, so at most 1/steps of a pass is padding); above
  `tile_from` tokens (--graph-tile-from), multiples of TILE_ROWS, the products' row tile: their
  padding costs its share of compute-bound products, so a 3,090-token pass runs 3,200 rows, not
  3,584 (7% faster on an H200: docs/cuda-kernels.md);
- levels, chunked_levels: the levels of the recurrence's and of the chunked kernel's runs,
  rounded up to 1, 2, 4, 8 (capped at the budget's depth) where the GDN launches depend on them
  (the chunked kernel's state pass runs once a level, as does the recurrence under
  `gdn_level_launches`: `level_keys`; a level launch whose segments are all absent costs a grid
  of blocks that exit at once), 0 where a kernel has no runs and so no launch. The default
  recurrence runs a whole forest in one launch whatever its depth, so its keys all take the
  budget's depth: one key a (tokens, kept), 64 graphs at the default budget instead of 208 (a
  pass of fewer levels leaves the extra ranges of `level_off` empty, which the kernel skips: the
  same items, so the same bits). With the kernels split by position (`split`) the recurrence
  keeps its one launch and the chunked kernel's levels are 0 (a pass with no run past the split:
  no chunked launch), 2 (a prompt's part past the split and its candidates) or the depth;
- kept: whether the pass keeps any state (then MAX_STATE_SLOTS output slots are copied).
Above tile_from a key is only levels 2 or the depth (where keys carry levels), and kept: an empty level
launch and the kept copies cost ~0.5 ms of a pass of over 100 ms, and so the finer token steps
add no graphs (24 steps x 2 keys from 1,024 to 4,096 tokens, where 8 steps x 8 keys were).
The rest follows from T_pad alone, so the key set stays small: segments N_pad = min(budget
segments, T_pad) + 1 (the real ones, one pad segment holding the T_pad - T pad tokens, then
empty ones; twice the budget's segments with `split`, each run crossing it being two); attention
max_q = T_pad rounded up to 64. Ancestors' K/V rows, parent states and
kv_rows live in static buffers of fixed size (graph_launch._Statics), outside the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from openjev.worker.cuda import traits
from openjev.worker.cuda.graphs import fine_bucket
from openjev.worker.geometry import GDN_CHUNK_TOKENS

MAX_STATE_SLOTS = 8  # external parents / kept states a captured pass holds (~150 MB each, 27B shape)
LEVEL_STEPS = (1, 2, 4, 8)
TILE_ROWS = 128  # row tile of cuBLAS's compute-bound products: long passes pad to a multiple of it


@dataclass(frozen=True)
class PassBudget:
    """What the runner is warmed for. tokens, segments: a pass's most tokens and segments (the
    scheduler's --max-pass-tokens, --max-pass-segments); depth: most levels (max_pass_depth);
    context: most ancestor K/V rows from kept states a pass reads; steps: token buckets per octave;
    tile_from: above this many tokens (0: never), token buckets are multiples of TILE_ROWS and
    keys only the long ones' levels and kept (module docstring)."""

    tokens: int = 4096
    segments: int = 64
    depth: int = 8
    context: int = 16384
    steps: int = 4
    tile_from: int = 1024

    def bucket(self, n: int) -> int:
        """The padded token count of a pass of n tokens."""
        if self.long(n):
            return -(-n // TILE_ROWS) * TILE_ROWS
        return fine_bucket(n, steps=self.steps)

    def long(self, n: int) -> bool:
        """Whether a pass of n tokens gets the long passes' buckets and keys."""
        return bool(self.tile_from) and n > self.tile_from


@dataclass(frozen=True, order=True)
class PassKey:
    """A captured graph's bucket."""

    tokens: int  # T_pad
    levels: int  # the recurrence's levels (0: no recurrence launch)
    kept: bool  # kept states are copied out (MAX_STATE_SLOTS slots)
    segments: int  # N_pad
    max_q: int  # the longest segment attention is told of, which picks its form (multiple of 64)
    tail_rows: bool = False  # the chunked GDN kernel's tail sources (64 a segment) in the index buffer
    chunked_levels: int = 0  # the chunked kernel's state-pass launches (0: no chunked launch)

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
            ("level_off", self.levels + self.chunked_levels + 1),
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
    """Pass -> PassKey under one budget; None (with the reason) for passes outside it.
    chunked_from: the chunked GDN kernel's first position (None: the recurrence only; 0: the
    chunked kernel everywhere; more: the kernels split there); level_keys: whether the recurrence
    launches once a level (module docstring)."""

    def __init__(self, budget: PassBudget, chunked_from: int | None = None, level_keys: bool = True):
        if budget.tokens < 1 or budget.depth < 1 or budget.segments < budget.depth or budget.context < 0:
            raise ValueError(f"bad pass budget {budget}")
        self.budget, self.level_keys = budget, level_keys
        # the chunked kernel's tail sources in the index; `split`: both kernels, split at a position
        self.tail_rows, self.split = chunked_from is not None, bool(chunked_from)
        # a pass's planned segments: a run crossing the split is two
        self.max_segments = budget.segments * (2 if self.split else 1)

    @property
    def kv_rows(self) -> int:
        """Capacity of the static kv_rows index buffer: every segment sees at most all
        ancestor rows and all of the pass's own rows."""
        b = self.budget
        return (self.max_segments + 1) * (b.context + b.bucket(b.tokens))

    def token_steps(self) -> list[int]:
        """Every T_pad a pass within budget can have, ascending. Each count's own bucket: with a
        tile_from between fine sizes the buckets are not monotone (1,100 tokens pad to 1,280,
        1,101 to 1,152), so stepping from one bucket to the next missed some."""
        return sorted({self.budget.bucket(n) for n in range(1, self.budget.tokens + 1)})

    def _by_level(self, tokens_pad: int) -> list[int]:
        """Levels rounded up to LEVEL_STEPS (long passes: 2 and the depth)."""
        depth = self.budget.depth
        steps = [d for d in LEVEL_STEPS if d < depth] + [depth]
        if self.budget.long(tokens_pad):
            steps = [min(2, depth), depth]
        return sorted(set(steps))

    def level_steps(self, tokens_pad: int = 1) -> list[int]:
        """The recurrence's levels keys of T_pad tokens have: none where the chunked kernel
        takes every position, by level with level_keys, else the depth (one launch)."""
        if self.tail_rows and not self.split:
            return [0]
        return self._by_level(tokens_pad) if self.level_keys else [self.budget.depth]

    def chunked_level_steps(self, tokens_pad: int = 1) -> list[int]:
        """The chunked kernel's levels keys of T_pad tokens have (module docstring)."""
        if not self.tail_rows:
            return [0]
        if self.split:
            return sorted({0, min(2, self.budget.depth), self.budget.depth})
        return self._by_level(tokens_pad)

    def kept_steps(self, tokens_pad: int) -> tuple[bool, ...]:
        return (True,) if self.budget.long(tokens_pad) else (False, True)

    def launch_problem(self) -> str | None:
        """Why the budget's widest pass would not launch, or None: conv1d's grid y (a block per
        16 rows and 3 a segment) passes CUDA's limit from ~21,400 tokens and segments."""
        widest = self.make(self.token_steps()[-1], 1, False)  # segments follow from the tokens
        grid_rows = traits.CONV.grid_rows(widest.tokens, widest.segments)
        if grid_rows > traits.MAX_GRID_Y:
            b = self.budget
            return (
                f"a pass budget of {b.tokens} tokens and {b.segments} segments launches conv1d on "
                f"{grid_rows} grid rows, over CUDA's {traits.MAX_GRID_Y}: lower --max-launch-tokens "
                "or --max-launch-sequences"
            )
        return None

    def make(self, tokens_pad: int, levels: int, kept: bool, chunked_levels: int = 0) -> PassKey:
        segments = min(self.max_segments, tokens_pad) + 1
        return PassKey(tokens_pad, levels, kept, segments, 64 * -(-tokens_pad // 64), self.tail_rows, chunked_levels)

    def keys(self) -> list[PassKey]:
        """Every key a pass within budget maps to (what warm_up captures)."""
        return [
            self.make(t, d, k, c)
            for t in self.token_steps()
            for d in self.level_steps(t)
            for c in self.chunked_level_steps(t)
            for k in self.kept_steps(t)
        ]

    def key(
        self,
        tokens: int,
        segments: int,
        levels: int,
        parents: int,
        kept: int,
        base: int,
        kv_rows: int,
        chunked_levels: int = 0,
        callers: int | None = None,
    ) -> tuple[PassKey | None, str]:
        """(key, "") or (None, why the pass runs eagerly); levels, chunked_levels: the
        recurrence's and the chunked kernel's (LaunchPlan.recurrent_levels, .chunked_levels);
        callers: the caller's runs (LaunchPlan.callers; None: not checked), which bound the
        chunked kernel's listed segments and so its held scratch (graph_launch._Statics)."""
        b = self.budget
        checks = [
            (tokens <= b.tokens, f"{tokens} tokens > budget {b.tokens}"),
            (segments <= self.max_segments, f"{segments} segments > budget {self.max_segments}"),
            (callers is None or callers <= b.segments, f"{callers} sequences > budget {b.segments}"),
            (max(levels, chunked_levels) <= b.depth, f"{max(levels, chunked_levels)} levels > budget {b.depth}"),
            (parents <= MAX_STATE_SLOTS, f"{parents} parent states > {MAX_STATE_SLOTS} slots"),
            (kept <= MAX_STATE_SLOTS, f"{kept} kept states > {MAX_STATE_SLOTS} slots"),
            (base <= b.context, f"{base} ancestor rows > budget {b.context}"),
            (kv_rows <= self.kv_rows, f"{kv_rows} key rows > capacity {self.kv_rows}"),
        ]
        for ok, why in checks:
            if not ok:
                return None, why
        tokens_pad = b.bucket(tokens)
        levels_pad = next((d for d in self.level_steps(tokens_pad) if d >= levels), None)
        chunked_pad = next((c for c in self.chunked_level_steps(tokens_pad) if c >= chunked_levels), None)
        if levels_pad is None or chunked_pad is None:  # a kernel this runner does not launch
            return None, f"{levels} recurrence and {chunked_levels} chunked levels: no key"
        return self.make(tokens_pad, levels_pad, kept > 0 or b.long(tokens_pad), chunked_pad), ""

"""Forest passes replayed from CUDA graphs, one graph per PassKey (buckets.py).

Eagerly a pass costs Python plus ~20 kernel launches a layer; at short lengths that host time
exceeds the GPU time (27B: 130 ms for a 74-token request whose device work is 20 ms). A graph
fixes every device-side shape, so each pass is padded to its key:
- tokens T -> T_pad; the T_pad - T pad tokens (id 0, positions 0..) form one extra segment after
  the real ones, no parent, never kept, its outputs ignored, in no level's range (the GDN
  recurrence skips it); empty segments fill the segment count up to N_pad. Pad rows can hold
  garbage and stay harmless: conv, recurrence and attention mix rows only within a segment (or
  from its ancestors), GEMMs and norms not at all.
- levels: the pass's depth rounded up (or the budget's depth, where the launches do not depend
  on it: buckets.py); the extra level ranges hold no segment.
- the attention pool of each layer is one static buffer: the pass's own keys from row 0,
  ancestors' rows (copied in before the replay) from row T_pad; kv_rows indexes it.
The static buffers (`_Statics`) are allocated once at the budget's size and shared by every graph:
index buffer, kv_rows, pool, MAX_STATE_SLOTS parent-state slots (slot 0 stays zero: no parent)
and kept-state output slots; so no key depends on ancestor rows or parent counts.
Before a replay the pass's indices, parents' states and ancestors' K/V are copied in; after it
the kept segments' final states and the K/V rows of materialised runs are copied out, so no
real state lives in a graph's buffers.

`warm_up` captures every key of the budget and reports any capture that failed (the worker then
refuses to start: worker/main.py); afterwards a pass without a captured key (outside the budget)
runs eagerly with a logged warning and a counted fallback. A
launcher never warmed captures a key on its `capture_after`-th sighting instead (tests, tools).
The launcher reaches the model only through `PassModel`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from openjev import progress
from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.cuda import chunked_gdn as KC
from openjev.worker.cuda import kernels as K
from openjev.worker.cuda.buckets import MAX_STATE_SLOTS, Bucketing, PassBudget, PassKey
from openjev.worker.cuda.graphs import GraphCache
from openjev.worker.cuda.launch import GdnLayers, KvLayers, Launch, LaunchPlan

if TYPE_CHECKING:
    from prometheus_client import Counter

# Prometheus counters, None on the kernel benchmarks' images (no server packages there).
cache_hits: Counter | None = None
cache_misses: Counter | None = None
capture_failures: Counter | None = None
eager_fallbacks: Counter | None = None
try:
    from prometheus_client import Counter

    from openjev import metrics
except ImportError:  # the kernel benchmarks run on images without the server's packages
    pass
else:
    cache_hits, cache_misses = metrics.graph_cache_hits, metrics.graph_cache_misses
    capture_failures = Counter(
        "openjev_worker_graph_capture_failures",
        "CUDA graph captures that failed (the launch ran eagerly)",
        registry=metrics.worker_registry,
    )
    eager_fallbacks = Counter(
        "openjev_worker_graph_eager_passes",
        "Passes that ran eagerly because no captured graph holds their shape",
        registry=metrics.worker_registry,
    )

log = logging.getLogger(__name__)
MAX_FAILED_KEYS = 256
MAX_SEEN_SHAPES = 4096
MAX_WARNED = 256


class PassModel(Protocol):
    """What the launcher needs from a runner."""

    config: ModelConfig
    device: torch.device
    gdn_layers: list[int]
    attn_layers: list[int]
    chunked_from: int | None  # the chunked GDN kernel's first position (None: the recurrence only)
    level_launches: bool  # whether the recurrence launches once a level (buckets.py)

    def forward_device(self, launch: Launch, io) -> torch.Tensor:
        """Capturable device work: hidden [R, D] bf16 of the head rows."""
        ...

    def states_of(self, plan: LaunchPlan, gdn: list, kv: list, blocks: tuple[list, list] | None = None) -> list:
        """Per caller's run its kept state or None, from per internal run gdn[i] (layer ->
        (window, state, tail)) and kv[i] (layer -> (keys, values)), None where absent; blocks:
        per internal run the stacked K/V and GDN tensors those are views of."""
        ...


SCRATCH = "chunk_"  # the chunked GDN kernel's held scratch among the static buffers: its names' prefix


class _Statics:
    """The static buffers every graph reads and writes, at the budget's size. idx, kv_rows int32;
    kv [La, 2, T_pad max + context, Hkv, 256] bf16; win_in [L, 1+S, 3, C] bf16, st_in [L, 1+S,
    Hv, 128, 128] fp32 and, where the chunked GDN kernel runs, tail_in [L, 1+S, 64, width] fp32
    (slot 0 stays zero; a slot whose parent has no tail keeps stale rows, which no run reads);
    win_out, st_out, tail_out [L, S, ...] (L: GDN layers, La: attention layers, S:
    MAX_STATE_SLOTS). Layer-major, so one layer's slots are one contiguous tensor."""

    def __init__(self, model: PassModel, bucketing: Bucketing):
        self.model, self.bucketing = model, bucketing
        self.buffers: dict[str, torch.Tensor] = {}

    def sizes(self) -> dict[str, tuple]:
        m, c, b = self.model, self.model.config, self.bucketing
        L, La, S = len(m.gdn_layers), len(m.attn_layers), MAX_STATE_SLOTS
        keys = b.keys()
        C, hv = c.linear_conv_dim, c.linear_num_value_heads
        tail = (K.GDN_CHUNK, KC.gdn_tail_width(c.linear_num_key_heads, hv))
        out = {
            "idx": ((max(k.index_size for k in keys),), torch.int32),
            "kv_rows": ((b.kv_rows,), torch.int32),
            "kv": ((La, 2, keys[-1].tokens + b.budget.context, c.num_key_value_heads, c.head_dim), torch.bfloat16),
            "win_in": ((L, S + 1, 3, C), torch.bfloat16),
            "st_in": ((L, S + 1, hv, 128, 128), torch.float32),
            "win_out": ((L, S, 3, C), torch.bfloat16),
            "st_out": ((L, S, hv, 128, 128), torch.float32),
        }
        if m.chunked_from is not None:
            out["tail_in"] = ((L, S + 1, *tail), torch.float32)
            out["tail_out"] = ((L, S, *tail), torch.float32)
            # the chunked kernel lists a caller's run at most once (a split run's second part),
            # and a key's callers are at most the budget's sequences (Bucketing.key)
            chunks = KC.scratch_chunks(max(k.tokens for k in keys), b.budget.segments)
            shapes = KC.ChunkScratch.shapes(chunks, hv, c.linear_num_key_heads)
            out.update({SCRATCH + name: (shape, torch.float32) for name, shape in shapes.items()})
        return out

    def ensure(self) -> dict[str, torch.Tensor]:
        if not self.buffers:
            for name, (shape, dtype) in self.sizes().items():
                self.buffers[name] = torch.zeros(shape, dtype=dtype, device=self.model.device)
        return self.buffers

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class GraphLauncher:
    """Runs forest passes through a GraphCache; `run` returns None where the caller must run the
    pass eagerly (no key fits, the key is not captured, or its capture failed)."""

    def __init__(self, model: PassModel, capacity: int, capture_after: int = 2, budget: PassBudget | None = None):
        if capture_after < 1:
            raise ValueError("capture_after must be at least 1")
        self.model, self.cache, self.capture_after = model, GraphCache(capacity), capture_after
        self.bucketing = Bucketing(budget or PassBudget(), model.chunked_from, model.level_launches)
        self.statics = _Statics(model, self.bucketing)
        self.hits = self.misses = self.failures = self.fallbacks = 0
        self.warmed = False
        self._failed: set = set()  # keys whose capture failed: not retried (a capture costs ~2 eager runs)
        self.first_failure = ""  # the first failed capture's key and error, for warm_up's report
        self._seen: OrderedDict[PassKey, int] = OrderedDict()  # sightings of keys not captured yet
        self._warned: set[str] = set()

    # ---- keys -------------------------------------------------------------------------------
    def key_of(self, plan: LaunchPlan) -> tuple[PassKey | None, str]:
        return self.bucketing.key(
            tokens=len(plan.ids),
            segments=len(plan.runs),
            callers=plan.callers,
            levels=plan.recurrent_levels,
            parents=len(plan.parents),
            kept=plan.num_kept,
            base=plan.base,
            kv_rows=plan.num_kv_rows,
            chunked_levels=plan.chunked_levels,
        )

    def warm_up(self) -> dict:
        """Capture every key of the budget; from then on no pass within it captures or runs
        eagerly. Returns {"graphs", "seconds", "device_bytes", "static_bytes", "failures"} (also
        logged), and "first_failure" (key and error) where a capture failed."""
        keys = self.bucketing.keys()
        if self.cache.capacity < len(keys):
            log.info("graph cache capacity %d < %d warm-up keys: raised", self.cache.capacity, len(keys))
            self.cache.capacity = len(keys)
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved(self.model.device)
        self.statics.ensure()
        warmed_rows: set[int] = set()  # token counts an eager pass has run at (cuBLAS's choices)
        for key in progress.track(keys, "CUDA graphs of the pass budget", log=log):
            if key not in self.cache:
                self._capture(key, self._dummy_plan(key), warm=key.tokens not in warmed_rows)
                warmed_rows.add(key.tokens)
        torch.cuda.synchronize(self.model.device)
        self.warmed = True
        out: dict = {
            "graphs": len(self.cache),
            "seconds": time.perf_counter() - t0,
            "device_bytes": torch.cuda.memory_reserved(self.model.device) - mem0,
            "static_bytes": self.statics.nbytes(),
            "failures": self.failures,
        }
        if self.failures:
            out["first_failure"] = self.first_failure
        log.info(
            "CUDA graphs warmed: %d graphs in %.1f s, %.2f GiB device memory (%.2f GiB static buffers), %d failures",
            out["graphs"],
            out["seconds"],
            out["device_bytes"] / 2**30,
            out["static_bytes"] / 2**30,
            out["failures"],
        )
        return out

    def _dummy_plan(self, key: PassKey) -> LaunchPlan:
        """A pass that maps into `key` (any valid indices do for a capture)."""
        from openjev.worker.cuda.launch import plan_launch
        from openjev.worker.runner_api import SegmentRun

        # a chain of `levels` runs, the last kept if the key keeps; at most a token a level (a
        # 16-token key of 32 levels takes 9 to 16-level passes: fewer levels fit it too); the
        # chunked kernel's where the key has them (it from position 0: any valid indices do)
        levels = min(key.chunked_levels or key.levels, key.tokens)
        n = key.tokens - levels + 1
        runs = []
        for d in range(levels):
            kept = key.kept and d == levels - 1
            parent = d - 1 if d else None
            runs.append(SegmentRun([0] * (n if d == 0 else 1), n + d - 1 if d else 0, None, kept, True, parent))
        return plan_launch(runs, self.model.config.vocab_size, chunked_from=0 if key.chunked_levels else None)

    # ---- one pass ---------------------------------------------------------------------------
    def _count(self, hit: bool) -> None:
        self.hits, self.misses = self.hits + hit, self.misses + (not hit)
        counter = cache_hits if hit else cache_misses
        if counter is not None:
            counter.inc()

    def _fallback(self, why: str) -> None:
        self.fallbacks += 1
        if eager_fallbacks is not None:
            eager_fallbacks.inc()
        if why not in self._warned and len(self._warned) < MAX_WARNED:
            self._warned.add(why)
            log.warning("pass runs eagerly (no captured CUDA graph): %s", why)

    def _due(self, key: PassKey) -> bool:
        """Count a sighting of an uncaptured key; True once it has been seen capture_after times."""
        seen = self._seen.pop(key, 0) + 1
        if seen >= self.capture_after:
            return True
        self._seen[key] = seen
        if len(self._seen) > MAX_SEEN_SHAPES:
            self._seen.popitem(last=False)
        return False

    def run(self, plan: LaunchPlan):
        """(hidden [R, D] bf16 of the head rows in the caller's order, per caller's run its state
        or None), or None."""
        key, why = self.key_of(plan)
        if key is None:
            self._count(False)
            self._fallback(why)
            return None
        entry = self.cache.get(key)
        self._count(entry is not None)
        if entry is None:
            if self.warmed or key in self._failed:
                self._fallback(f"{key} not captured" + (" (capture failed)" if key in self._failed else ""))
                return None
            if not self._due(key):
                return None
            entry = self._capture(key, plan)
            if entry is None:
                return None
        else:
            self._fill(plan, key)
        hidden = self.cache.replay(entry)
        return self._collect(hidden, plan, key)

    def _capture(self, key: PassKey, plan: LaunchPlan, warm: bool = True):
        """warm: an eager run before the capture (GraphCache.capture); warm_up skips it where a
        key of the same token count was captured already: the products, the only work whose
        kernels depend on the row count alone, have then run at that count."""
        try:  # static buffers too: out of memory for them is a failure to capture, not to run
            static = self.statics.ensure()
            self._fill(plan, key)
            return self.cache.capture(key, functools.partial(self._forward, key), dict(static), warm=warm)
        except Exception as error:  # any capture problem: this pass runs eagerly
            self.failures += 1
            if capture_failures is not None:
                capture_failures.inc()
            if len(self._failed) >= MAX_FAILED_KEYS:
                self._failed.clear()
            self._failed.add(key)
            self.first_failure = self.first_failure or f"{key}: {error!r}"
            log.warning("CUDA graph capture failed for %s, running eagerly: %r", key, error)
            return None

    def _fill(self, plan: LaunchPlan, key: PassKey) -> None:
        """Copy the pass's indices, parents' GDN states and ancestors' K/V into the static buffers."""
        m, s = self.model, self.statics.buffers
        T, N, pad = len(plan.ids), len(plan.runs), key.tokens - len(plan.ids)
        rows, cu_k = plan.kv_rows(key.tokens)
        pad_rows = np.arange(T, key.tokens, dtype=np.int32)  # the pad segment's own keys
        empty = key.segments - N - 1
        values = {
            "ids": plan.ids,
            "pos": plan.positions + list(range(pad)),
            "cu": plan.cu + [key.tokens] * (key.segments - N),
            "cu_k": list(cu_k) + [int(cu_k[-1]) + pad] * (key.segments - N),
            "heads": plan.heads,
            "gdn_init": plan.gdn_init + [-1] * (key.segments - N),
            "level_off": plan.level_off(key.levels, key.chunked_levels),  # the pad and empty segments in no range
            # the pad and empty segments read slot 0's zero window
            "win_src": plan.win_src + [-1 - m for _ in range(key.segments - N) for m in range(3)],
            "tail_src": plan.tail_src,  # the pad and empty segments have no tail rows
            "keep": [i for i, run in enumerate(plan.runs) if run.keep_state],
        }
        fill = {"keep": N}  # unused entries: the pad segment; others 0 (slot 0, row 0)
        host = np.zeros(key.index_size, dtype=np.int32)
        for name, (at, n) in key.layout().items():
            v = np.asarray(values[name], dtype=np.int32)
            host[at : at + len(v)] = v
            host[at + len(v) : at + n] = fill.get(name, 0)
        assert empty >= 0
        kv_rows = np.concatenate([rows, pad_rows])
        # pageable sources: the copies are staged before copy_ returns, so the arrays may be freed
        s["idx"][: key.index_size].copy_(torch.from_numpy(host))
        s["kv_rows"][: len(kv_rows)].copy_(torch.from_numpy(kv_rows))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        # a state or node a captured pass made is one stacked tensor: one copy, not one a layer
        for slot, p in enumerate(plan.parents, start=1):
            if p.gdn_block is not None:
                win, st, tail = p.gdn_block
                dst += [s["win_in"][:, slot], s["st_in"][:, slot]]
                src += [win, st]
                if tail is not None:
                    dst.append(s["tail_in"][:, slot])
                    src.append(tail)
                continue
            for g, j in enumerate(m.gdn_layers):
                win, st, tail = p.gdn[j]
                dst += [s["win_in"][g, slot], s["st_in"][g, slot]]
                src += [win, st]
                if tail is not None:
                    dst.append(s["tail_in"][g, slot])
                    src.append(tail)
        at = key.tokens
        for node in plan.nodes:  # ancestors' K/V rows, in the plan's pool order
            if node.block is not None:
                dst.append(s["kv"][:, :, at : at + node.num_rows])
                src.append(node.block)
            else:
                for a, j in enumerate(m.attn_layers):
                    for kv in (0, 1):
                        dst.append(s["kv"][a, kv, at : at + node.num_rows])
                        src.append(node.kv[j][kv])
            at += node.num_rows
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for d, t in zip(dst, src, strict=True):
            group = groups.setdefault(d.dtype, ([], []))
            group[0].append(d)
            group[1].append(t)
        for dsts, srcs in groups.values():  # one multi-tensor launch per dtype rather than one copy each
            torch._foreach_copy_(dsts, srcs)

    def _forward(self, key: PassKey, **s: torch.Tensor) -> torch.Tensor:
        """The captured work: hidden [N_pad, D] bf16 of the (padded) head rows."""
        m, c = self.model, self.model.config
        v = {name: s["idx"][at : at + n] for name, (at, n) in key.layout().items()}
        launch = Launch(
            ids=v["ids"],
            cu=v["cu"],
            pos=v["pos"],
            head_idx=v["heads"],
            rope=K.rotary_table(v["pos"], c.rotary_dim, c.rope_theta),
            kv_rows=s["kv_rows"],
            cu_k=v["cu_k"],
            max_q=key.max_q,
            gdn_init=v["gdn_init"],
            level_off=v["level_off"],
            num_levels=key.levels,
            win_src=v["win_src"],
            tail_src=v["tail_src"] if key.tail_rows else None,
            chunked_levels=key.chunked_levels,
        )
        return m.forward_device(launch, self.io(key, v["keep"]))

    def io(self, key: PassKey, keep) -> _StaticIO:
        """A captured pass's state in and out (keep: the kept runs' index buffer)."""
        return _StaticIO(self.model, self.statics.buffers, key, keep, self.bucketing.budget.segments)

    def _collect(self, hidden, plan: LaunchPlan, key: PassKey):
        """Copy the head rows, the kept runs' final states and materialised runs' K/V rows out
        of the graph's buffers."""
        m, s = self.model, self.statics.buffers
        N = len(plan.runs)
        # per internal run, None where it keeps no state / materialises no K/V
        gdn: list[GdnLayers | None] = [None] * N
        kv: list[KvLayers | None] = [None] * N
        gdn_blocks: list = [None] * N
        kv_blocks: list = [None] * N
        kept = [i for i, run in enumerate(plan.runs) if run.keep_state]
        for k, i in enumerate(kept):
            win, st = s["win_out"][:, k].clone(), s["st_out"][:, k].clone()  # [L, 3, C], [L, Hv, 128, 128]
            tail = s["tail_out"][:, k].clone() if plan.keeps_tail(i) else None
            gdn_blocks[i] = (win, st, tail)
            gdn[i] = {j: (win[g], st[g], None if tail is None else tail[g]) for g, j in enumerate(m.gdn_layers)}
        for i in plan.materialise:
            rows = s["kv"][:, :, plan.cu[i] : plan.cu[i + 1]].clone()  # [La, 2, t, Hkv, 256]
            kv_blocks[i] = rows
            kv[i] = {j: (rows[a, 0], rows[a, 1]) for a, j in enumerate(m.attn_layers)}
        hidden = hidden[: len(plan.heads)]
        if plan.head_order is not None:
            hidden = hidden[torch.as_tensor(plan.head_order, device=hidden.device)]
        return hidden.clone(), m.states_of(plan, gdn, kv, (kv_blocks, gdn_blocks))


class _StaticIO:
    """State in and out of a captured pass (the `io` of forward_device): parents' states from the
    static slots, kept runs' final states copied into the static outputs (keep: [K] int32
    internal run indices)."""

    def __init__(self, model: PassModel, s, key: PassKey, keep, listed: int):
        self.s, self.key, self.keep, self.listed = s, key, keep, listed
        self.g = {j: g for g, j in enumerate(model.gdn_layers)}
        self.a = {j: a for a, j in enumerate(model.attn_layers)}

    def gdn_in(self, index: int):
        """(windows [1+S, 3, C] bf16, states [1+S, Hv, 128, 128] fp32, tails [1+S, 64, width]
        fp32 or None): per state slot, slot 0 zeros."""
        g = self.g[index]
        return self.s["win_in"][g], self.s["st_in"][g], self.s["tail_in"][g] if "tail_in" in self.s else None

    def gdn_scratch(self) -> tuple[KC.ChunkScratch | None, int | None]:
        """The chunked kernel's held scratch and the most segments a pass lists (_Statics)."""
        if SCRATCH + "w" not in self.s:
            return None, None
        return KC.ChunkScratch.of(self.s, SCRATCH), self.listed

    def gdn_out(self, index: int, new_windows, final, tails) -> None:
        if self.key.kept:
            g, k = self.g[index], self.keep.numel()
            for name, t in (("win_out", new_windows), ("st_out", final), ("tail_out", tails)):
                if t is not None:  # straight into the slots: no temporary of 8 states a layer
                    torch.index_select(t, 0, self.keep, out=self.s[name][g, :k])

    def kv_pools(self, index: int, T: int):
        """(keys, values [rows, Hkv, 256] bf16, row of the first ancestor row): own rows from 0."""
        a = self.a[index]
        return self.s["kv"][a, 0], self.s["kv"][a, 1], self.key.tokens

    def kv_out(self, index: int, k_pool, v_pool) -> None:
        pass  # own rows stay in the static pools; _collect copies the materialised ones out

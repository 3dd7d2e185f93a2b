"""CudaRunner launches replayed from CUDA graphs, one graph per shape bucket.

Eagerly a launch costs Python plus ~20 kernel launches a layer; at short lengths that host time
exceeds the GPU time (27B, 512 tokens: 97-151 ms eager, 51.7 ms replayed). A graph fixes every
device-side shape, so each launch is padded to its bucket (`Shape`):
- tokens T -> fine_bucket(T); the T_pad - T pad tokens (id 0, positions 0..) form one extra
  segment after the real ones, with no parent, never kept, its outputs ignored; further empty
  segments fill the segment count up to its bucket. Pad rows can hold garbage (attention computes
  at most max_q rows of a segment) and stay harmless: conv, recurrence and attention mix rows
  only within a segment, GEMMs and norms not at all.
- distinct parents P -> slots 1..P of static per-layer GDN state buffers (slot 0 stays zero:
  segments without a parent); kept segments K -> static output slots 0..K-1.
- the attention pool of each layer is a static [base_pad + T_pad, Hkv, 256] buffer: ancestors'
  rows are copied into [0, base), the launch's own keys are written from row base_pad.
The static buffers are shared by every graph (each sees a leading slice of them, `_Statics`):
state slots are allocated at their bound (MAX_STATE_SLOTS) when first needed; index and K/V rows
double when a shape needs more, and graphs captured on the old ones keep them (and stay valid)
until they are evicted, so those stay under twice the largest. (Dropping those graphs
instead made every growth recapture the whole cache: on the 27B benchmark, the first timed block
after the warm-up was still capturing.)
Before a replay the launch's indices (one int32 buffer) and parents' states are copied in; after
it the kept segments' final states are copied out, so no real state lives in a graph's buffers.
Launches with more than MAX_STATE_SLOTS parents or kept segments, or MAX_TOKENS tokens, run
eagerly (GEMM-bound anyway, and their static buffers would be large).
A shape is captured on its `capture_after`-th sighting (default 2): a capture costs several eager
launches (0.4-0.8 s on the 27B shape), which a shape seen once never pays back.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from openjev.worker.cuda import kernels as K
from openjev.worker.cuda.graphs import GraphCache, bucket, fine_bucket
from openjev.worker.cuda.launch import CudaSegmentState, Launch, LaunchPlan

try:
    from prometheus_client import Counter

    from openjev import metrics

    capture_failures: Counter | None = Counter(
        "openjev_worker_graph_capture_failures",
        "CUDA graph captures that failed (the launch ran eagerly)",
        registry=metrics.worker_registry,
    )
except ImportError:  # the kernel benchmarks run on images without the server's packages
    metrics = None  # type: ignore[assignment]  # optional: the module is absent on those images
    capture_failures = None

log = logging.getLogger(__name__)
MAX_STATE_SLOTS = 8  # each slot is ~150 MB of GDN state per graph on the 27B shape
MAX_TOKENS = 16384
MAX_FAILED_KEYS = 256
MAX_SEEN_SHAPES = 4096


def _segments_bucket(n: int) -> int:
    return bucket(n, 2) if n <= 8 else -(-n // 8) * 8


def _slots_bucket(n: int) -> int:
    return 0 if n == 0 else bucket(n, 1)


@dataclass(frozen=True)
class Shape:
    """A launch's bucket: everything the graph's device-side shapes depend on."""

    tokens: int  # T_pad
    segments: int  # N_pad (real + the pad segment + empty ones)
    max_q: int  # attention grid rows (multiple of 64)
    base: int  # ancestor rows of the pool, padded
    parents: int  # P_pad parent state slots (0: no segment has a parent)
    kept: int  # K_pad kept-state output slots

    def layout(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, length) in the int32 index buffer."""
        T, N = self.tokens, self.segments
        sizes = [
            ("ids", T),
            ("pos", T),
            ("cu", N + 1),
            ("cu_k", N + 1),
            ("heads", N),
            ("slot", N),
            ("keep", max(self.kept, 1)),
            ("kv_rows", N * self.base + T),
        ]  # kv_rows: an upper bound
        out, at = {}, 0
        for name, n in sizes:
            out[name] = (at, n)
            at += n
        return out


def shape_of(plan: LaunchPlan) -> Shape | None:
    parents = len({id(run.parent_state) for run in plan.runs if run.parent_state is not None})
    kept = sum(run.keep_state for run in plan.runs)
    if len(plan.ids) > MAX_TOKENS or parents > MAX_STATE_SLOTS or kept > MAX_STATE_SLOTS:
        return None
    return Shape(
        fine_bucket(len(plan.ids)),
        _segments_bucket(len(plan.runs) + 1),
        64 * bucket(-(-plan.max_q // 64), 1),
        fine_bucket(plan.base) if plan.base else 0,
        _slots_bucket(parents),
        _slots_bucket(kept),
    )


class _Statics:
    """The static buffers every graph reads and writes, at the largest size seen so far; a shape
    gets leading slices of them (`views`). idx int32; win_in [1+P, L, 3, C] bf16, st_in [1+P,
    L, Hv, 128, 128] fp32 and, with the chunked GDN kernel, tail_in [1+P, L, 64, width] fp32
    (slot 0 stays zero: no parent); win_out, st_out, tail_out [K, L, ...]; kv [La, 2, rows, Hkv,
    256] bf16 (L: GDN layers, La: attention layers)."""

    def __init__(self, runner):
        self.runner = runner
        self.buffers: dict[str, torch.Tensor] = {}

    def _need(self, shape: Shape) -> dict[str, int]:
        """Leading size along the sliced dimension, per buffer."""
        need = {"idx": sum(n for _, n in shape.layout().values()), "kv": shape.base + shape.tokens}
        if shape.parents:
            need["win_in"] = need["st_in"] = shape.parents + 1
        if shape.kept:
            need["win_out"] = need["st_out"] = shape.kept
        if self.runner.chunked_gdn:  # the kept states' unfinished chunks
            need.update({f"tail_{io}": need[f"st_{io}"] for io in ("in", "out") if f"st_{io}" in need})
        return need

    def ensure(self, shape: Shape) -> None:
        """Make the buffers large enough for shape (graphs captured on replaced ones keep them)."""
        r, c = self.runner, self.runner.config
        L, La, dev = len(r.gdn_layers), len(r.attn_layers), r.device
        C, hv = c.linear_conv_dim, c.linear_num_value_heads
        tail = (K.GDN_CHUNK, K.gdn_tail_width(c.linear_num_key_heads, hv))
        make = {
            "idx": lambda n: torch.zeros(n, dtype=torch.int32, device=dev),
            "kv": lambda n: torch.empty(La, 2, n, c.num_key_value_heads, c.head_dim, dtype=torch.bfloat16, device=dev),
            "win_in": lambda n: torch.zeros(n, L, 3, C, dtype=torch.bfloat16, device=dev),
            "st_in": lambda n: torch.zeros(n, L, hv, 128, 128, dtype=torch.float32, device=dev),
            "win_out": lambda n: torch.empty(n, L, 3, C, dtype=torch.bfloat16, device=dev),
            "st_out": lambda n: torch.empty(n, L, hv, 128, 128, dtype=torch.float32, device=dev),
            "tail_in": lambda n: torch.zeros(n, L, *tail, dtype=torch.float32, device=dev),
            "tail_out": lambda n: torch.empty(n, L, *tail, dtype=torch.float32, device=dev),
        }
        slots = {
            "win_in": MAX_STATE_SLOTS + 1,
            "st_in": MAX_STATE_SLOTS + 1,
            "tail_in": MAX_STATE_SLOTS + 1,
            "win_out": MAX_STATE_SLOTS,
            "st_out": MAX_STATE_SLOTS,
            "tail_out": MAX_STATE_SLOTS,
        }
        for name, n in self._need(shape).items():
            have = self.buffers.get(name)
            if have is None or self._size(name, have) < n:
                # state slots (150 MB each on the 27B shape) at their bound at once: they never grow;
                # rows double, so graphs holding old buffers keep less than the current ones
                size = slots.get(name) or (bucket(n, 1) if have is None else max(n, 2 * self._size(name, have)))
                self.buffers[name] = make[name](size)

    @staticmethod
    def _size(name: str, t: torch.Tensor) -> int:
        return t.shape[2] if name == "kv" else t.shape[0]

    def views(self, shape: Shape) -> dict[str, torch.Tensor]:
        out = {}
        for name, n in self._need(shape).items():
            t = self.buffers[name]
            out[name] = t[:, :, :n] if name == "kv" else t[:n]
        return out


class GraphLauncher:
    """Runs CudaRunner launches through a GraphCache; `run` returns None where the caller must
    run the launch eagerly (no bucket fits, the shape is not seen often enough yet, or its
    capture failed)."""

    def __init__(self, runner, capacity: int, capture_after: int = 2):
        if capture_after < 1:
            raise ValueError("capture_after must be at least 1")
        self.runner, self.cache, self.capture_after = runner, GraphCache(capacity), capture_after
        self.statics = _Statics(runner)
        self.hits = self.misses = self.failures = 0
        self._failed: set = set()  # keys whose capture failed: not retried (a capture costs ~2 eager runs)
        self._seen: OrderedDict[Shape, int] = OrderedDict()  # sightings of shapes not captured yet

    def _count(self, hit: bool) -> None:
        self.hits, self.misses = self.hits + hit, self.misses + (not hit)
        if metrics is not None:
            (metrics.graph_cache_hits if hit else metrics.graph_cache_misses).inc()

    def _due(self, shape: Shape) -> bool:
        """Count a sighting of an uncaptured shape; True once it has been seen capture_after times."""
        seen = self._seen.pop(shape, 0) + 1
        if seen >= self.capture_after:
            return True
        self._seen[shape] = seen
        if len(self._seen) > MAX_SEEN_SHAPES:
            self._seen.popitem(last=False)
        return False

    def run(self, plan: LaunchPlan):
        """(hidden [R, D] bf16 of the head rows, per run its state or None), or None."""
        shape = shape_of(plan)
        entry = None if shape is None else self.cache.get(shape)
        self._count(entry is not None)
        if entry is None:
            if shape is None or shape in self._failed or not self._due(shape):
                return None
            try:  # static buffers too: out of memory for them is a failure to capture, not to run
                self.statics.ensure(shape)
                static = self.statics.views(shape)
                self._fill(static, plan, shape)
                entry = self.cache.capture(shape, functools.partial(self._forward, shape), static)
            except Exception as error:  # any capture problem: this launch runs eagerly
                self.failures += 1
                if capture_failures is not None:
                    capture_failures.inc()
                if len(self._failed) >= MAX_FAILED_KEYS:
                    self._failed.clear()
                self._failed.add(shape)
                log.warning("CUDA graph capture failed for %s, running eagerly: %r", shape, error)
                return None
        else:
            assert shape is not None  # a cache entry exists only for a shape
            self._fill(entry.inputs, plan, shape)
        hidden = self.cache.replay(entry)
        return self._collect(hidden, entry.inputs, plan, shape)

    def _fill(self, s: dict[str, torch.Tensor], plan: LaunchPlan, shape: Shape) -> None:
        """Copy the launch's indices, parents' GDN states and ancestors' K/V into the static buffers."""
        r = self.runner
        T, N, pad = len(plan.ids), len(plan.runs), shape.tokens - len(plan.ids)
        rows, cu_k = plan.kv_rows(shape.base)
        parents: dict[int, tuple[int, CudaSegmentState]] = {}  # id -> (slot, state), slots 1.. in first-use order
        for run in plan.runs:
            if run.parent_state is not None:
                parents.setdefault(id(run.parent_state), (len(parents) + 1, run.parent_state))
        no_parent = 0  # the zero slot
        values = {
            "ids": plan.ids,
            "pos": plan.positions + list(range(pad)),
            "cu": plan.cu + [shape.tokens] * (shape.segments - N),
            "cu_k": list(cu_k) + [int(cu_k[-1]) + pad] * (shape.segments - N),
            "heads": plan.heads,
            "slot": [no_parent if run.parent_state is None else parents[id(run.parent_state)][0] for run in plan.runs],
            "keep": [i for i, run in enumerate(plan.runs) if run.keep_state],
            "kv_rows": np.concatenate([rows, np.arange(shape.base + T, shape.base + shape.tokens, dtype=np.int32)]),
        }
        fill = {"slot": no_parent, "keep": N}  # unused entries: zero slot, the pad segment; others 0
        host = np.zeros(s["idx"].numel(), dtype=np.int32)
        for name, (at, n) in shape.layout().items():
            v = np.asarray(values[name], dtype=np.int32)
            host[at : at + len(v)] = v
            host[at + len(v) : at + n] = fill.get(name, 0)
        # pageable source: the copy is staged before copy_ returns, so `host` may be freed at once
        s["idx"].copy_(torch.from_numpy(host))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for slot, p in parents.values():
            for g, j in enumerate(r.gdn_layers):
                dst += [s["win_in"][slot, g], s["st_in"][slot, g]]
                src += [p.gdn[j][0], p.gdn[j][1]]
                if r.chunked_gdn:
                    tail = p.gdn[j][2]
                    assert tail is not None  # chunked-kernel states always carry their tail
                    dst.append(s["tail_in"][slot, g])
                    src.append(tail)
        at = 0
        for node in plan.nodes:  # ancestors' K/V rows, in the plan's pool order
            for a, j in enumerate(r.attn_layers):
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

    def _forward(self, shape: Shape, **s: torch.Tensor) -> torch.Tensor:
        """The captured work: hidden [N_pad, D] bf16 of the (padded) head rows."""
        r, c = self.runner, self.runner.config
        v = {name: s["idx"][at : at + n] for name, (at, n) in shape.layout().items()}
        launch = Launch(
            ids=v["ids"],
            cu=v["cu"],
            pos=v["pos"],
            head_idx=v["heads"],
            rope=K.rotary_table(v["pos"], c.rotary_dim, c.rope_theta),
            kv_rows=v["kv_rows"],
            cu_k=v["cu_k"],
            max_q=shape.max_q,
        )
        return r._forward(launch, _StaticIO(r, s, shape, v["slot"], v["keep"][: shape.kept]))

    def _collect(self, hidden, s, plan: LaunchPlan, shape: Shape):
        """Copy the head rows and the kept segments' final states out of the graph's buffers."""
        r, k = self.runner, 0
        states: list[CudaSegmentState | None] = []
        for i, run in enumerate(plan.runs):
            if not run.keep_state:
                states.append(None)
                continue
            win, st = s["win_out"][k].clone(), s["st_out"][k].clone()  # [L, 3, C], [L, Hv, 128, 128]
            tail = s["tail_out"][k].clone() if r.chunked_gdn else [None] * len(r.gdn_layers)
            k += 1
            kv = s["kv"][:, :, shape.base + plan.cu[i] : shape.base + plan.cu[i + 1]].clone()  # [La, 2, t, Hkv, 256]
            states.append(
                r.state_of(
                    run,
                    {j: (win[g], st[g], tail[g]) for g, j in enumerate(r.gdn_layers)},
                    {j: (kv[a, 0], kv[a, 1]) for a, j in enumerate(r.attn_layers)},
                )
            )
        return hidden[: len(plan.heads)].clone(), states


class _StaticIO:
    """State in and out of a captured launch (the `io` of CudaRunner._forward): parents' states
    gathered per segment from the static slots (slot: [N_pad] int32), kept segments' final states
    gathered into the static outputs (keep: [K_pad] int32 segment indices)."""

    def __init__(self, runner, s, shape: Shape, slot, keep):
        self.s, self.shape, self.slot, self.keep = s, shape, slot, keep
        self.g = {j: g for g, j in enumerate(runner.gdn_layers)}
        self.a = {j: a for a, j in enumerate(runner.attn_layers)}
        c, self.device = runner.config, runner.device
        self.window_shape = (shape.segments, 3, c.linear_conv_dim)
        self.zeros: torch.Tensor | None = None

    def gdn_in(self, index: int):
        g = self.g[index]
        if not self.shape.parents:
            if self.zeros is None:  # one zero window buffer for every layer of the launch
                self.zeros = torch.zeros(self.window_shape, dtype=torch.bfloat16, device=self.device)
            return self.zeros, None, None
        return tuple(
            self.s[name][:, g].index_select(0, self.slot) if name in self.s else None
            for name in ("win_in", "st_in", "tail_in")
        )

    def gdn_out(self, index: int, new_windows, final, tails) -> None:
        if self.shape.kept:
            g = self.g[index]
            for name, t in (("win_out", new_windows), ("st_out", final), ("tail_out", tails)):
                if t is not None:
                    self.s[name][:, g].copy_(t.index_select(0, self.keep))

    def kv_pools(self, index: int, T: int):
        a = self.a[index]
        return self.s["kv"][a, 0], self.s["kv"][a, 1], self.shape.base

    def kv_out(self, index: int, k_pool, v_pool, base: int) -> None:
        pass  # own rows stay in the static pools; _collect copies the kept ones out

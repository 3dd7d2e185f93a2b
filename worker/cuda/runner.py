"""CudaRunner: the CUDA backend of ModelRunner (openjev/worker/runner_api.py).

One launch = one forward pass over all its segments packed back to back: cuBLAS GEMMs through
torch over all rows, the CUDA kernels of `cuda/*.cu` for everything else, each segment starting
from its parent's state. Only the rows the head reads go through the last MLP and final norm.

State (opaque to callers): per GDN layer the conv window [3, C] bf16 and the recurrent state
[Hv, 128, 128] fp32 (where the chunked GDN kernel made it: at the segment's last 64-token
boundary, plus the rows after it, see cuda/gdn_chunked.cu); per attention layer this segment's own keys/values
[t, Hkv, 256] bf16 plus a link to the parent state, so ancestors' keys are shared, never copied
into each child.

Launches are replayed from CUDA graphs by default (`graph_cache_size` graphs kept, one per shape
bucket; 0: eager): eagerly a 512-token launch of the 27B shape is host-bound (Python + kernel
launch overhead). See graph_launch.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from openjev.worker.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from openjev.worker.cuda import chunked_gdn as KC
from openjev.worker.cuda import gemm, traits
from openjev.worker.cuda import kernels as K
from openjev.worker.cuda.buckets import MAX_STATE_SLOTS, Bucketing, PassBudget
from openjev.worker.cuda.fused_weights import (
    FusedAttentionLayer,
    FusedGdnLayer,
    FusedLayer,
    fuse_layer,
    plain_weights,
    random_layers,
    shape_config,
)
from openjev.worker.cuda.launch import CudaSegmentState, GdnLayers, KvLayers, KvNode, Launch, LaunchPlan, plan_launch
from openjev.worker.geometry import DEFAULT_GDN_SPLIT_AT, GDN_CHUNK_TOKENS
from openjev.worker.runner_api import SegmentResult, SegmentRun

DEFAULT_GRAPH_CACHE_SIZE = 128
DEFAULT_GRAPH_CAPTURE_AFTER = 2
# "serial": the token recurrence (gated_delta.cu), the default; "chunked": the tensor-core WY
# form (gdn_chunked.cu), faster alone from ~256 tokens a segment; through the engine 5-7% faster
# from ~700 computed tokens and 3-8% slower on short requests (docs/cuda-kernels.md), which most
# of the traffic is; "split": the recurrence before position gdn_split_at, the chunked form from
# it on (a position's bits depend on its tokens alone, so policies and caches stay exact; at 512,
# 3-4% faster than "serial" from ~2,200 computed tokens, up to 2% slower below ~800). All take
# multi-level passes and agree exactly across policies.
GDN_KERNELS = ("serial", "chunked", "split")
DEFAULT_PASS_DEPTH = 8  # tree levels one pass holds
LT_ROWS = 1024  # graph passes up to this many tokens get products timed against cuBLASLt's at start


def pass_budget(
    tokens: int,
    segments: int,
    depth: int = DEFAULT_PASS_DEPTH,
    context: int = PassBudget.context,
    tile_from: int = PassBudget.tile_from,
) -> PassBudget:
    """What a CudaRunner is warmed for (a pass holds at least a segment a level)."""
    return PassBudget(tokens=tokens, segments=max(segments, depth), depth=depth, context=context, tile_from=tile_from)


def budget_problem(budget: PassBudget, chunked_from: int | None) -> str | None:
    """Why a pass within `budget` could not launch with the chunked GDN kernel from position
    chunked_from on (None: never), or None (checked before the weights load)."""
    bucketing = Bucketing(budget, chunked_from)
    if bucketing.tail_rows and bucketing.max_segments > traits.GDN_CHUNKED.max_segments:
        most = traits.GDN_CHUNKED.max_segments
        return f"a pass of the chunked GDN kernel plans at most {most} segments, not {bucketing.max_segments}"
    return bucketing.launch_problem()


def chunked_from(gdn_kernel: str, gdn_split_at: int) -> int | None:
    """The first position the chunked GDN kernel takes (None: none)."""
    if gdn_kernel not in GDN_KERNELS:
        raise ValueError(f"gdn_kernel must be one of {GDN_KERNELS}, not {gdn_kernel!r}")
    if gdn_kernel == "split" and (gdn_split_at <= 0 or gdn_split_at % GDN_CHUNK_TOKENS):
        raise ValueError(f"gdn_split_at must be a positive multiple of {GDN_CHUNK_TOKENS}, not {gdn_split_at}")
    return {"serial": None, "chunked": 0, "split": gdn_split_at}[gdn_kernel]


def product_weights(layers) -> list[torch.Tensor]:
    """Every layer's product weights, in order (what the product paths are chosen for at start)."""
    return [w for layer in layers for w in (layer.w_in, layer.w_out, layer.w_gate_up, layer.w_down)]


class CudaRunner:
    backend = "cuda"
    # every policy is bit-identical to `off` here (token-serial GDN, or chunks at absolute
    # positions with a tail; attention tiles aligned to the sequence start): any cut is exact
    state_cut_anywhere = True

    def __init__(
        self,
        config: ModelConfig,
        embed,
        layers: list[FusedLayer],
        final_norm,
        head_weight,
        head_bias: float,
        graph_cache_size: int = DEFAULT_GRAPH_CACHE_SIZE,
        gemm_min_rows: int | None = None,
        graph_capture_after: int = DEFAULT_GRAPH_CAPTURE_AFTER,
        gdn_kernel: str = "serial",
        gdn_split_at: int = DEFAULT_GDN_SPLIT_AT,
        max_pass_tokens: int = 4096,
        max_pass_segments: int = 64,
        max_pass_depth: int = DEFAULT_PASS_DEPTH,
        max_pass_context: int = 16384,
        graph_tile_from: int = PassBudget.tile_from,
        gdn_level_launches: bool = False,
    ):
        # positions from chunked_from on run the chunked kernel, and the GDN states it leaves carry
        # their unfinished chunk's rows (a tail)
        self.chunked_from = chunked_from(gdn_kernel, gdn_split_at)
        self.gdn_kernel, self.gdn_split_at = gdn_kernel, gdn_split_at
        # the recurrence launched once a level, as before it ran a forest in one launch (to compare)
        self.gdn_level_launches = gdn_level_launches
        # whether the recurrence's launches depend on a pass's levels, so its graphs keys need them
        self.level_launches = gdn_level_launches
        # a captured pass holds this many parents' states and kept states, and this many of
        # their ancestors' key rows (graph_launch's slots): the scheduler fills passes within them
        self.max_pass_states, self.max_pass_context = MAX_STATE_SLOTS, max_pass_context
        self.max_pass_depth = max_pass_depth
        self.budget = pass_budget(max_pass_tokens, max_pass_segments, max_pass_depth, max_pass_context, graph_tile_from)
        problem = budget_problem(self.budget, self.chunked_from)
        if problem:
            raise ValueError(problem)
        self.config, self.embed, self.layers, self.final_norm = config, embed, layers, final_norm
        # Split-K products must not sum their partial results in bf16 (the library's default)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        # rows to pad each weight shape's products to (gemm.py); None: probe them on this card
        weights = product_weights(layers)
        self.gemm_rows = (
            gemm.calibrate(weights) if gemm_min_rows is None else {tuple(w.shape): gemm_min_rows for w in weights}
        )
        # Products of few rows stream the weight through our kernel where it was measured faster
        # and gives cuBLAS's bits on this card (checked here); pinned padding (tests) keeps cuBLAS.
        self.stream_rows = gemm.stream_plan(weights) if gemm_min_rows is None else {tuple(w.shape): 0 for w in weights}
        # ...and, at the row counts of graph passes up to LT_ROWS, to cuBLASLt's fastest unsplit
        # algorithm where it has the bits and beat those (checked and timed here)
        self.lt = {}
        if gemm_min_rows is None:
            tuned = [t for t in Bucketing(self.budget).token_steps() if t <= LT_ROWS]
            self.lt = gemm.lt_plan(weights, self.gemm_rows, self.stream_rows, tuned)
        self.head_weight = head_weight.to(device=embed.device, dtype=torch.float64)
        self.head_bias = float(head_bias)
        self.device = embed.device
        K.gdn_schedule(self.device)  # made now, not while a pass is captured
        segments = Bucketing(self.budget, self.chunked_from).max_segments
        K.gdn_dependencies(self.device, segments + 1, config.linear_num_value_heads)
        self.gdn_layers = [j for j, layer in enumerate(layers) if layer.kind == LINEAR_ATTENTION]
        self.attn_layers = [j for j, layer in enumerate(layers) if layer.kind == FULL_ATTENTION]
        if graph_cache_size < 0:
            raise ValueError("graph_cache_size must be >= 0")
        self.graphs = None
        if graph_cache_size:
            from openjev.worker.cuda.graph_launch import GraphLauncher

            self.graphs = GraphLauncher(self, graph_cache_size, graph_capture_after, self.budget)

    @property
    def chunked_gdn(self) -> bool:
        """Whether the chunked GDN kernel runs at all (its states then may carry tails)."""
        return self.chunked_from is not None

    def device_lost(self) -> str | None:
        """Asked after a pass failed (ModelRunner): see device_fault."""
        return device_fault(self.device)

    def warm_up(self) -> dict | None:
        """Capture a graph for every pass shape within the budget (before SERVING); None when
        the graph cache is off. See GraphLauncher.warm_up."""
        return None if self.graphs is None else self.graphs.warm_up()

    @classmethod
    def synthetic(cls, shape: str = "small", seed: int = 0, num_layers: int | None = None, device="cuda", **options):
        """Seeded random weights of a named shape; options: the constructor's keyword arguments."""
        config = shape_config(shape, num_layers)
        embed, layers, final_norm = random_layers(config, seed, torch.device(device))
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        head = torch.randn(config.hidden_size, device=device, generator=gen) / config.hidden_size**0.5
        return cls(config, embed, layers, final_norm, head, 0.125, **options)

    @classmethod
    def on_weights_of(cls, other: CudaRunner, **options) -> CudaRunner:
        """Another runner over `other`'s weights (shared, not copied): a benchmark's arms, or
        graph-replayed against eager passes in tests; options: the constructor's keyword arguments
        (the GDN kernel and split position default to `other`'s)."""
        options = {"gdn_kernel": other.gdn_kernel, "gdn_split_at": other.gdn_split_at, **options}
        return cls(
            other.config, other.embed, other.layers, other.final_norm, other.head_weight, other.head_bias, **options
        )

    @classmethod
    def from_export(cls, model_dir: str | Path, device="cuda", **options):
        from openjev.export import load_export_meta
        from openjev.worker.backends import check_cuda_config
        from openjev.worker.checkpoint.config import load_model_config
        from openjev.worker.checkpoint.weights import load_weights

        meta, config = load_export_meta(model_dir), load_model_config(model_dir)
        check_cuda_config(config)  # the kernels' sizes, before the weights load (minutes at 27B)
        plain = load_weights(model_dir, config, torch.bfloat16)
        layers = [fuse_layer(layer, device) for layer in plain.layers]
        to = lambda t: t.to(device=device, dtype=torch.bfloat16).contiguous()  # noqa: E731
        head = torch.tensor(meta.head_weight, dtype=torch.float32)
        return cls(config, to(plain.embed_tokens), layers, to(plain.final_norm), head, meta.head_bias, **options)

    def reference_weights(self):
        """The torch reference's ModelWeights, as views of this runner's weights."""
        return plain_weights(self.config, self.embed, self.layers, self.final_norm)

    def cacheable_state(self, state: CudaSegmentState) -> tuple[CudaSegmentState, int]:
        """The state as the state cache keeps it (as is: its GDN tensors are per-run clones, its
        K/V rows per-node clones) and its bytes: the GDN tensors plus the K/V of its whole
        lineage, counted per entry even where entries share ancestors (so the budget is an
        upper bound of what the cache pins)."""
        tensors = [t for layer in state.gdn.values() for t in layer if t is not None]
        tensors += [t for node in state.kv.lineage() for kv in node.kv.values() for t in kv]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return state, sum(storages.values())

    # ---- one pass -------------------------------------------------------------------------
    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        hidden, states = self.final_hidden(runs)
        scores = iter(
            ((hidden.double() @ self.head_weight).float() + torch.tensor(self.head_bias)).tolist()
            if hidden.shape[0]
            else []
        )
        return [
            SegmentResult(state=state if run.keep_state else None, head_score=next(scores) if run.read_head else None)
            for run, state in zip(runs, states, strict=True)
        ]

    def final_hidden(self, runs: Sequence[SegmentRun]):
        """Final-normed hidden rows [R, D] bf16 of the reading runs and each run's state, both in
        the order of `runs`. Replayed from a CUDA graph when the cache is on and holds the pass's
        key, else eager."""
        plan = plan_launch(runs, self.config.vocab_size, chunked_from=self.chunked_from)
        if plan.num_levels > self.max_pass_depth:
            raise ValueError(f"a pass of {plan.num_levels} levels; this runner holds {self.max_pass_depth}")
        if self.graphs is not None:
            done = self.graphs.run(plan)
            if done is not None:
                return done
        return self._eager(plan)

    def _eager(self, plan: LaunchPlan):
        dev = self.device
        as_i32 = lambda xs: torch.as_tensor(np.asarray(xs, dtype=np.int32)).to(dev)  # noqa: E731
        T = len(plan.ids)
        rows, cu_k = plan.kv_rows(T)
        pos = as_i32(plan.positions)
        launch = Launch(
            ids=as_i32(plan.ids),
            cu=as_i32(plan.cu),
            pos=pos,
            head_idx=as_i32(plan.heads) if plan.heads else None,
            rope=K.rotary_table(pos, self.config.rotary_dim, self.config.rope_theta),
            kv_rows=as_i32(rows),
            cu_k=as_i32(cu_k),
            max_q=plan.max_q,
            gdn_init=as_i32(plan.gdn_init),
            level_off=as_i32(plan.level_off(plan.recurrent_levels, plan.chunked_levels)),
            num_levels=plan.recurrent_levels,
            win_src=as_i32(plan.win_src),
            tail_src=as_i32(plan.tail_src) if self.chunked_gdn else None,
            chunked_levels=plan.chunked_levels,
        )
        io = _EagerIO(self, plan)
        hidden = self.forward_device(launch, io)
        if plan.head_order is not None:
            hidden = hidden[torch.as_tensor(plan.head_order, device=dev)]
        return hidden, self.states_of(plan, io.gdn, io.kv)

    def states_of(self, plan: LaunchPlan, gdn: list, kv: list, blocks: tuple[list, list] | None = None) -> list:
        """Per run of the caller's order its kept state (CudaSegmentState) or None, from per
        internal run gdn[i] (GDN layer -> (window, state, tail)) and kv[i] (attention layer ->
        (keys, values)) of the kept runs, kv[i] also of their in-pass ancestors: those become
        KvNodes of the chain (their GDN states are not kept). blocks: per internal run the
        stacked tensors those are views of (KvNode.block, CudaSegmentState.gdn_block), if any."""
        kv_blocks, gdn_blocks = blocks or ([None] * len(plan.runs), [None] * len(plan.runs))
        nodes: dict[int, KvNode] = {}
        for i in plan.materialise:  # ascending: in-pass parents first
            run, p = plan.runs[i], plan.in_parent[i]
            parent = nodes[p] if p >= 0 else (None if run.parent_state is None else run.parent_state.kv)
            nodes[i] = KvNode(parent, len(run.token_ids), kv[i], kv_blocks[i])
        states: list[CudaSegmentState | None] = [None] * plan.callers
        for i, run in enumerate(plan.runs):
            if run.keep_state:
                end = run.start_position + len(run.token_ids)
                states[plan.order[i]] = CudaSegmentState(end, gdn[i], nodes[i], gdn_blocks[i])
        return states

    def forward_device(self, launch: Launch, io):
        """Device work only (capturable): hidden [R, D] bf16 of the head rows. `io` supplies each
        layer's input states and takes its final ones (_EagerIO here, graph_launch._StaticIO)."""
        eps = self.config.rms_norm_eps
        residual = self.embed.index_select(0, launch.ids)
        h, _ = K.add_rms_norm(residual, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        # the attention layers' blocks: each a query tile of a segment (the same for every layer)
        tiles = K.attention_tiles(
            launch.cu, h.shape[0], self.config.num_attention_heads // self.config.num_key_value_heads
        )
        for index, layer in enumerate(self.layers):
            if layer.kind == LINEAR_ATTENTION:
                mixed = self._gdn(layer, index, h, launch, io)
            elif layer.kind == FULL_ATTENTION:
                mixed = self._attention(layer, index, h, launch, io, tiles)
            else:
                raise ValueError(f"layer {index}: unknown layer type {layer.kind!r}")
            if index == last:
                if launch.head_idx is None:
                    residual = residual[:0]
                    break
                hn, residual = K.add_rms_norm(residual, layer.post_norm, eps, x_add=mixed, row_idx=launch.head_idx)
            else:
                hn, _ = K.add_rms_norm(residual, layer.post_norm, eps, x_add=mixed)
            mlp = self._linear(K.silu_mul(self._linear(hn, layer.w_gate_up)), layer.w_down)
            next_norm = self.final_norm if index == last else self.layers[index + 1].input_norm
            h, _ = K.add_rms_norm(residual, next_norm, eps, x_add=mlp)
        return h if launch.head_idx is not None else residual

    def _linear(self, x, w):
        shape = tuple(w.shape)
        return gemm.linear(x, w, self.gemm_rows[shape], self.stream_rows[shape], self.lt.get(shape))

    def _gdn(self, layer: FusedGdnLayer, index: int, h, launch: Launch, io):
        c = self.config
        C, vd, hv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        proj = self._linear(h, layer.w_in)  # [T, C + Hv*Dv + 2*Hv]
        x = proj[:, :C] if (proj.stride(0) * 2) % 16 == 0 else proj[:, :C].contiguous()
        slot_windows, slot_states, slot_tails = io.gdn_in(index)
        # each run's window is read where it lies: rows of x (in-pass ancestors) or a parent slot
        conv, new_windows = K.causal_conv1d(x, layer.conv_weight, slot_windows, launch.win_src, launch.cu)
        z, b, a = proj[:, C : C + vd], proj[:, C + vd : C + vd + hv], proj[:, C + vd + hv :]
        qn, kn, g, beta, kq = K.gdn_prepare(conv, a, b, layer.a_log, layer.dt_bias, c.linear_num_key_heads)
        v = conv[:, 2 * c.linear_key_dim :].unflatten(1, (hv, 128))
        # each kernel writes its own runs' rows of o and final: the recurrence's runs first, so a
        # chunked run can start from the final state of a recurrence run it continues
        T, N = h.shape[0], launch.cu.numel() - 1
        o = torch.empty(T, hv, 128, dtype=torch.bfloat16, device=h.device)
        final = torch.empty(N, hv, 128, 128, dtype=torch.float32, device=h.device)
        if launch.num_levels:  # one launch on a fixed grid: a child's items wait for their parent's (gated_delta.cu)
            step = 1 if self.gdn_level_launches else launch.num_levels
            for level in range(0, launch.num_levels, step):
                K.gdn_recurrent(
                    qn,
                    kn,
                    kq,
                    v,
                    g,
                    beta,
                    launch.cu,
                    slot_states,
                    out=o,
                    final=final,
                    init_idx=launch.gdn_init,
                    level_off=launch.level_off,
                    level=level,
                    levels=step,
                )
        new_tails = None
        if launch.chunked_levels:  # solve and output once, the state pass once per level
            assert launch.tail_src is not None, "a chunked runner's launches carry tail sources"
            width = KC.gdn_tail_width(c.linear_num_key_heads, hv)
            sources = KC.ChunkSources(
                init_slots=final if slot_states is None else slot_states,  # no slot is read without parents
                init_idx=launch.gdn_init,
                tails=final.view(-1)[:width].view(1, width) if slot_tails is None else slot_tails.flatten(0, 1),
                tail_src=launch.tail_src,
                level_off=launch.level_off[launch.num_levels :],
                num_levels=launch.chunked_levels,
            )
            scratch, listed = io.gdn_scratch()
            o, final, new_tails = KC.gdn_chunked(
                qn,
                kn,
                v,
                g,
                beta,
                launch.cu,
                launch.pos,
                launch.max_q,
                out=o,
                final=final,
                sources=sources,
                scratch=scratch,
                listed=listed,
            )
        io.gdn_out(index, new_windows, final, new_tails)
        return self._linear(K.gated_rms_norm(o, z, layer.norm_weight, c.rms_norm_eps), layer.w_out)

    def _attention(self, layer: FusedAttentionLayer, index: int, h, launch: Launch, io, tiles):
        c = self.config
        hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = self._linear(h, layer.w_in)  # [T, Hq*2*hd + 2*Hkv*hd]
        qd, kvd = 2 * hq * hd, hkv * hd
        qg = proj[:, :qd].unflatten(1, (hq, 2 * hd))
        cos, sin = launch.rope
        q = K.qk_norm_rope(qg[..., :hd], layer.q_norm, cos, sin, c.rms_norm_eps)
        k_pool, v_pool, _ = io.kv_pools(index, h.shape[0])  # own rows from 0, ancestors' rows after
        K.qk_norm_rope(
            proj[:, qd : qd + kvd].unflatten(1, (hkv, hd)),
            layer.k_norm,
            cos,
            sin,
            c.rms_norm_eps,
            dst=k_pool,
            dst_row0=0,
        )
        v_pool[: h.shape[0]].copy_(proj[:, qd + kvd :].unflatten(1, (hkv, hd)))
        o = K.tree_attention(
            q, k_pool, v_pool, launch.kv_rows, launch.cu, launch.cu_k, launch.max_q, gate=qg[..., hd:], tiles=tiles
        )
        io.kv_out(index, k_pool, v_pool)
        return self._linear(o.flatten(1), layer.w_out)


class _EagerIO:
    """State in and out of an eager pass: parents' tensors stacked per layer into state slots
    (slot 0 zeros), kept runs' final states and materialised runs' K/V rows cloned per layer
    (gdn[i], kv[i]: layer index -> tensors, per internal run, None where not needed)."""

    def __init__(self, runner: CudaRunner, plan: LaunchPlan):
        self.r, self.plan = runner, plan
        self.gdn: list[GdnLayers | None] = [{} if run.keep_state else None for run in plan.runs]
        self.kv: list[KvLayers | None] = [None] * len(plan.runs)
        for i in plan.materialise:
            self.kv[i] = {}

    def gdn_in(self, index: int):
        """(windows [1+P, 3, C] bf16, states [1+P, Hv, 128, 128] fp32 or None, tails [1+P, 64,
        width] fp32 or None): per parent slot, slot 0 zeros (tails: and a parent without one);
        None when the pass has no external parent (tails: or the chunked kernel never runs)."""
        c, dev, parents = self.r.config, self.r.device, self.plan.parents
        zero_window = torch.zeros(3, c.linear_conv_dim, dtype=torch.bfloat16, device=dev)
        windows = torch.stack([zero_window] + [p.gdn[index][0] for p in parents])
        if not parents:
            return windows, None, None
        hv, width = c.linear_num_value_heads, KC.gdn_tail_width(c.linear_num_key_heads, c.linear_num_value_heads)
        states = torch.stack([torch.zeros(hv, 128, 128, device=dev)] + [p.gdn[index][1] for p in parents])
        if not self.r.chunked_gdn:
            return windows, states, None
        zero_tail = torch.zeros(K.GDN_CHUNK, width, device=dev)
        kept = [p.gdn_tail(index) for p in parents]
        return windows, states, torch.stack([zero_tail] + [zero_tail if t is None else t for t in kept])

    def gdn_scratch(self) -> tuple[None, None]:
        return None, None  # an eager pass allocates the chunked kernel's scratch for its own size

    def gdn_out(self, index: int, new_windows, final, tails):
        # per-run clones so a kept state does not pin the whole pass's buffers
        for i, layers in enumerate(self.gdn):
            if layers is not None:  # a kept run
                tail = tails[i].clone() if self.plan.keeps_tail(i) else None
                layers[index] = (new_windows[i].clone(), final[i].clone(), tail)

    def kv_pools(self, index: int, T: int):
        """(keys, values [T + base, Hkv, 256] bf16, T): own rows from 0, ancestors' from T."""
        c, nodes, base = self.r.config, self.plan.nodes, self.plan.base
        k_pool = torch.empty(T + base, c.num_key_value_heads, c.head_dim, dtype=torch.bfloat16, device=self.r.device)
        v_pool = torch.empty_like(k_pool)
        if nodes:
            torch.cat([nd.kv[index][0] for nd in nodes], out=k_pool[T:])
            torch.cat([nd.kv[index][1] for nd in nodes], out=v_pool[T:])
        return k_pool, v_pool, T

    def kv_out(self, index: int, k_pool, v_pool):
        cu = self.plan.cu
        for i, layers in enumerate(self.kv):
            if layers is not None:  # a materialised run (plan.materialise, ascending)
                rows = slice(cu[i], cu[i + 1])
                layers[index] = (k_pool[rows].clone(), v_pool[rows].clone())


def device_fault(device) -> str | None:
    """The error a trivial computation on `device` raises, or None where it runs: a sticky CUDA
    error (an illegal address, a failed launch) leaves the context unable to run anything, and
    every later pass fails; an out-of-memory or a bad argument does not."""
    try:
        torch.cuda.synchronize(device)
        if (torch.ones(1, device=device) + 1).item() != 2.0:
            return "the device computed 1 + 1 wrong"
    except Exception as error:
        return repr(error)
    return None

"""CudaRunner: the CUDA backend of ModelRunner (openjev/worker/runner_api.py).

One launch = one forward pass over all its segments packed back to back: cuBLAS GEMMs through
torch over all rows, the CUDA kernels of `cuda/*.cu` for everything else, each segment starting
from its parent's state. Only the rows the head reads go through the last MLP and final norm.

State (opaque to callers): per GDN layer the conv window [3, C] bf16 and the recurrent state
[Hv, 128, 128] fp32; per attention layer this segment's own keys/values [t, Hkv, 256] bf16 plus
a link to the parent state, so ancestors' keys are shared, never copied into each child.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from openjev.worker.cuda import kernels as K
from openjev.worker.cuda.synthetic import FusedLayer, fuse_layer, plain_weights, random_layers, shape_config
from openjev.worker.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from openjev.worker.runner_api import SegmentResult, SegmentRun


@dataclass(frozen=True)
class KvNode:
    """One segment's own attention keys/values, linked to its parent's: the chain root-to-self
    is every position the segment's children attend to. kv: per attention layer index,
    (keys, values) [t, Hkv, 256] bf16."""

    parent: "KvNode | None"
    num_rows: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def lineage(self) -> list["KvNode"]:
        """Root first, self last."""
        chain, node = [], self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]


@dataclass(frozen=True)
class CudaSegmentState:
    """num_tokens: the segment's end position; gdn: per GDN layer index, (conv_window [3, C] bf16,
    recurrent [Hv, 128, 128] fp32); kv: the attention chain (ancestors' GDN states are not kept
    alive by it)."""

    num_tokens: int
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]]
    kv: KvNode


class CudaRunner:
    backend = "cuda"

    def __init__(self, config: ModelConfig, embed, layers: list[FusedLayer], final_norm, head_weight, head_bias: float):
        self.config, self.embed, self.layers, self.final_norm = config, embed, layers, final_norm
        self.head_weight = head_weight.to(device=embed.device, dtype=torch.float64)
        self.head_bias = float(head_bias)
        self.device = embed.device

    @classmethod
    def synthetic(cls, shape: str = "small", seed: int = 0, num_layers: int | None = None, device="cuda"):
        config = shape_config(shape, num_layers)
        embed, layers, final_norm = random_layers(config, seed, torch.device(device))
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        head = torch.randn(config.hidden_size, device=device, generator=gen) / config.hidden_size**0.5
        return cls(config, embed, layers, final_norm, head, 0.125)

    @classmethod
    def from_export(cls, model_dir: str | Path, device="cuda"):
        from openjev.export import load_export_meta
        from openjev.worker.model.checkpoint import load_weights
        from openjev.worker.model.config import load_model_config

        meta, config = load_export_meta(model_dir), load_model_config(model_dir)
        plain = load_weights(model_dir, config, torch.bfloat16)
        layers = [fuse_layer(layer, device) for layer in plain.layers]
        to = lambda t: t.to(device=device, dtype=torch.bfloat16).contiguous()  # noqa: E731
        head = torch.tensor(meta.head_weight, dtype=torch.float32)
        return cls(config, to(plain.embed_tokens), layers, to(plain.final_norm), head, meta.head_bias)

    def reference_weights(self):
        """The torch reference's ModelWeights, as views of this runner's weights."""
        return plain_weights(self.config, self.embed, self.layers, self.final_norm)

    # ---- one launch -------------------------------------------------------------------------
    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        hidden, states = self.final_hidden(runs)
        scores = iter(((hidden.double() @ self.head_weight).float() + torch.tensor(self.head_bias)).tolist()
                      if hidden.shape[0] else [])
        return [
            SegmentResult(state=state if run.keep_state else None, head_score=next(scores) if run.read_head else None)
            for run, state in zip(runs, states, strict=True)
        ]

    def _pack(self, runs: Sequence[SegmentRun]) -> "_Launch":
        """Every host-derived index of a launch, moved to the device once, so `_forward` does
        device work only (and can be captured in a CUDA graph)."""
        ids, positions, cu, heads = [], [], [0], []
        for run in runs:
            parent = run.parent_state
            if len(run.token_ids) == 0:
                raise ValueError("SegmentRun.token_ids must not be empty")
            if parent is not None and not isinstance(parent, CudaSegmentState):
                raise TypeError(f"parent_state is a {type(parent).__name__}, not a CudaRunner state")
            if run.start_position != (0 if parent is None else parent.num_tokens):
                raise ValueError("start_position must equal the parent's end position")
            ids.extend(run.token_ids)
            positions.extend(range(run.start_position, run.start_position + len(run.token_ids)))
            cu.append(len(ids))
            if run.read_head:
                heads.append(len(ids) - 1)
        if max(ids) >= self.config.vocab_size or min(ids) < 0:
            raise ValueError("token id outside the vocabulary")
        # attention pool layout (the same for every attention layer): each distinct ancestor
        # node's rows once, then this launch's own rows; logical key j of segment i -> pool row
        parents = [run.parent_state for run in runs]
        lineages = [[] if p is None else p.kv.lineage() for p in parents]
        nodes, offsets = [], {}
        for lineage in lineages:
            for node in lineage:
                if id(node) not in offsets:
                    offsets[id(node)] = sum(nd.num_rows for nd in nodes)
                    nodes.append(node)
        base = sum(nd.num_rows for nd in nodes)
        ranges = [[(offsets[id(nd)], nd.num_rows) for nd in lineage] + [(base + cu[i], cu[i + 1] - cu[i])]
                  for i, lineage in enumerate(lineages)]
        rows = np.concatenate([np.arange(a, a + n, dtype=np.int32) for r in ranges for a, n in r])
        cu_k = np.cumsum([0] + [sum(n for _, n in r) for r in ranges])
        dev = self.device
        as_i32 = lambda xs: torch.as_tensor(np.asarray(xs, dtype=np.int32)).to(dev)  # noqa: E731
        pos = as_i32(positions)
        return _Launch(
            ids=as_i32(ids), cu=as_i32(cu), cu_host=cu, head_idx=as_i32(heads), n_heads=len(heads),
            rope=K.rotary_table(pos, self.config.rotary_dim, self.config.rope_theta),
            parents=parents, keep=[run.keep_state for run in runs], nodes=nodes, base=base,
            kv_rows=as_i32(rows), cu_k=as_i32(cu_k), max_q=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        )

    def final_hidden(self, runs: Sequence[SegmentRun]):
        """Final-normed hidden rows [R, D] bf16 of the reading runs (in order) and each run's state."""
        launch = self._pack(runs)
        hidden, per_layer = self._forward(launch)
        states = []
        for i, run in enumerate(runs):
            if not run.keep_state:
                states.append(None)
                continue
            gdn = {j: st[i] for j, st in enumerate(per_layer) if self.layers[j].kind == LINEAR_ATTENTION}
            kv = {j: st[i] for j, st in enumerate(per_layer) if self.layers[j].kind == FULL_ATTENTION}
            parent_kv = None if run.parent_state is None else run.parent_state.kv
            node = KvNode(parent_kv, len(run.token_ids), kv)
            states.append(CudaSegmentState(run.start_position + len(run.token_ids), gdn, node))
        return hidden, states

    def _forward(self, launch: "_Launch"):
        """Device work only: (hidden [R, D] bf16, per layer the per-segment states)."""
        c, eps = self.config, self.config.rms_norm_eps
        cu, head_idx, n_heads = launch.cu, launch.head_idx, launch.n_heads
        parents, keep = launch.parents, launch.keep
        residual = self.embed.index_select(0, launch.ids)
        h, _ = K.add_rms_norm(residual, self.layers[0].input_norm, eps)
        per_layer = []
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            if layer.kind == LINEAR_ATTENTION:
                mixed, st = self._gdn(layer, index, h, cu, parents, keep)
            elif layer.kind == FULL_ATTENTION:
                mixed, st = self._attention(layer, index, h, launch)
            else:
                raise ValueError(f"layer {index}: unknown layer type {layer.kind!r}")
            per_layer.append(st)
            if index == last:
                if n_heads == 0:
                    residual = residual[:0]
                    break
                hn, residual = K.add_rms_norm(residual, layer.post_norm, eps, x_add=mixed, row_idx=head_idx)
            else:
                hn, _ = K.add_rms_norm(residual, layer.post_norm, eps, x_add=mixed)
            mlp = F.linear(K.silu_mul(F.linear(hn, layer.w_gate_up)), layer.w_down)
            next_norm = self.final_norm if index == last else self.layers[index + 1].input_norm
            h, _ = K.add_rms_norm(residual, next_norm, eps, x_add=mlp)
        return (h if n_heads else residual), per_layer

    def _gdn(self, layer: FusedLayer, index: int, h, cu, parents, keep):
        c = self.config
        C, vd, hv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        proj = F.linear(h, layer.w_in)  # [T, C + Hv*Dv + 2*Hv]
        x = proj[:, :C] if (proj.stride(0) * 2) % 16 == 0 else proj[:, :C].contiguous()
        windows = torch.stack([
            p.gdn[index][0] if p is not None else torch.zeros(3, C, dtype=torch.bfloat16, device=self.device)
            for p in parents
        ])
        init = None
        if any(p is not None for p in parents):
            init = torch.stack([
                p.gdn[index][1] if p is not None else torch.zeros(hv, 128, 128, device=self.device)
                for p in parents
            ])
        conv, new_windows = K.causal_conv1d(x, layer.conv_weight, windows, cu)
        z, b, a = proj[:, C : C + vd], proj[:, C + vd : C + vd + hv], proj[:, C + vd + hv :]
        qn, kn, g, beta, kq = K.gdn_prepare(conv, a, b, layer.a_log, layer.dt_bias, c.linear_num_key_heads)
        v = conv[:, 2 * c.linear_key_dim :].unflatten(1, (hv, 128))
        o, final = K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init)
        out = F.linear(K.gated_rms_norm(o, z, layer.norm_weight, c.rms_norm_eps), layer.w_out)
        # per-segment clones so a kept state does not pin the whole launch's buffers
        return out, [(new_windows[i].clone(), final[i].clone()) if keep[i] else None for i in range(len(parents))]

    def _attention(self, layer: FusedLayer, index: int, h, launch: "_Launch"):
        c = self.config
        hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = F.linear(h, layer.w_in)  # [T, Hq*2*hd + 2*Hkv*hd]
        qd, kvd = 2 * hq * hd, hkv * hd
        qg = proj[:, :qd].unflatten(1, (hq, 2 * hd))
        cos, sin = launch.rope
        q = K.qk_norm_rope(qg[..., :hd], layer.q_norm, cos, sin, c.rms_norm_eps)
        base, T, cu_host = launch.base, h.shape[0], launch.cu_host
        k_pool = torch.empty(base + T, hkv, hd, dtype=torch.bfloat16, device=self.device)
        v_pool = torch.empty_like(k_pool)
        if launch.nodes:
            torch.cat([nd.kv[index][0] for nd in launch.nodes], out=k_pool[:base])
            torch.cat([nd.kv[index][1] for nd in launch.nodes], out=v_pool[:base])
        K.qk_norm_rope(proj[:, qd : qd + kvd].unflatten(1, (hkv, hd)), layer.k_norm, cos, sin, c.rms_norm_eps,
                       dst=k_pool, dst_row0=base)
        v_pool[base:].copy_(proj[:, qd + kvd :].unflatten(1, (hkv, hd)))
        o = K.tree_attention(q, k_pool, v_pool, launch.kv_rows, launch.cu, launch.cu_k, launch.max_q,
                             gate=qg[..., hd:])
        out = F.linear(o.flatten(1), layer.w_out)
        own = [(k_pool[base + cu_host[i] : base + cu_host[i + 1]].clone(),
                v_pool[base + cu_host[i] : base + cu_host[i + 1]].clone()) if launch.keep[i] else None
               for i in range(len(launch.parents))]
        return out, own


@dataclass
class _Launch:
    """A launch's device-side indices. ids: [T] int32; cu: [N+1] int32 (cu_host: the same as
    ints); head_idx: [R] int32 rows the head reads; rope: (cos, sin) [T, rotary_dim/2] fp32;
    nodes: distinct ancestor KvNodes in pool order, `base` rows in all; kv_rows: [sum S_n] int32
    pool row of each segment's logical keys; cu_k: [N+1] int32; max_q: longest segment."""

    ids: torch.Tensor
    cu: torch.Tensor
    cu_host: list[int]
    head_idx: torch.Tensor
    n_heads: int
    rope: tuple[torch.Tensor, torch.Tensor]
    parents: list
    keep: list[bool]
    nodes: list[KvNode]
    base: int
    kv_rows: torch.Tensor
    cu_k: torch.Tensor
    max_q: int

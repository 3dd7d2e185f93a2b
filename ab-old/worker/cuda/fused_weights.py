"""Layer shapes of the Qwen3.5 judges and the CUDA runner's fused weights, seeded random on the
GPU (no disk), or fused from loaded export weights.

The runner multiplies by fused matrices (one GEMM per input projection group); the plain
`ModelWeights` of `openjev.worker.model` are views into them, so the torch reference runs on
exactly the same numbers without a second copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from openjev.worker.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, LayerKind, ModelConfig
from openjev.worker.checkpoint.weights import (
    AttentionLayerWeights,
    AttentionWeights,
    GdnLayerWeights,
    GdnWeights,
    LayerWeights,
    ModelWeights,
)

# (hidden, intermediate, layers, heads, kv heads, linear key heads, linear value heads)
SHAPES = {
    "27b": (5120, 17408, 64, 24, 4, 16, 48),
    "9b": (4096, 12288, 32, 16, 4, 16, 32),
    "small": (256, 512, 4, 2, 1, 2, 4),
}
VOCAB = {"27b": 248320, "9b": 248320, "small": 4096}


def shape_config(shape: str, num_layers: int | None = None) -> ModelConfig:
    hidden, inter, layers, heads, kv, lk, lv = SHAPES[shape]
    layers = layers if num_layers is None else num_layers
    kinds: tuple[LayerKind, ...] = tuple(
        FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(layers)
    )
    return ModelConfig(
        vocab_size=VOCAB[shape],
        hidden_size=hidden,
        intermediate_size=inter,
        layer_types=kinds,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=256,
        linear_num_key_heads=lk,
        linear_num_value_heads=lv,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
    )


@dataclass
class _FusedLayer:
    """w_in: the layer's input projections stacked; w_out: out_proj / o_proj; norms [D];
    w_gate_up [2I, D]; w_down [D, I]. All bf16 unless said."""

    w_in: Tensor
    w_out: Tensor
    input_norm: Tensor
    post_norm: Tensor
    w_gate_up: Tensor
    w_down: Tensor


@dataclass
class FusedGdnLayer(_FusedLayer):
    """w_in = [qkv; z; b; a]; conv_weight [C, 4]; a_log, dt_bias [Hv] fp32; norm_weight [Dv]."""

    kind: ClassVar[Literal["linear_attention"]] = LINEAR_ATTENTION
    conv_weight: Tensor
    a_log: Tensor
    dt_bias: Tensor
    norm_weight: Tensor


@dataclass
class FusedAttentionLayer(_FusedLayer):
    """w_in = [q_proj; k_proj; v_proj]; q_norm, k_norm [head_dim]."""

    kind: ClassVar[Literal["full_attention"]] = FULL_ATTENTION
    q_norm: Tensor
    k_norm: Tensor


FusedLayer = FusedGdnLayer | FusedAttentionLayer


def fuse_layer(layer: LayerWeights, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> FusedLayer:
    def to(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    rest = dict(
        input_norm=to(layer.input_norm),
        post_norm=to(layer.post_attention_norm),
        w_gate_up=to(torch.cat([layer.mlp_gate, layer.mlp_up])),
        w_down=to(layer.mlp_down),
    )
    if isinstance(layer, GdnLayerWeights):
        g = layer.mixer
        return FusedGdnLayer(
            w_in=to(torch.cat([g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a])),
            w_out=to(g.out_proj),
            conv_weight=to(g.conv_weight.reshape(g.conv_weight.shape[0], -1)),
            a_log=g.a_log.to(device=device, dtype=torch.float32),
            dt_bias=g.dt_bias.to(device=device, dtype=torch.float32),
            norm_weight=to(g.norm_weight),
            **rest,
        )
    a = layer.mixer
    return FusedAttentionLayer(
        w_in=to(torch.cat([a.q_proj, a.k_proj, a.v_proj])),
        w_out=to(a.o_proj),
        q_norm=to(a.q_norm),
        k_norm=to(a.k_norm),
        **rest,
    )


def plain_layer(f: FusedLayer, config: ModelConfig) -> LayerWeights:
    """The reference's LayerWeights as views into a FusedLayer."""
    inter = config.intermediate_size
    rest = dict(
        input_norm=f.input_norm,
        post_attention_norm=f.post_norm,
        mlp_gate=f.w_gate_up[:inter],
        mlp_up=f.w_gate_up[inter:],
        mlp_down=f.w_down,
    )
    if isinstance(f, FusedGdnLayer):
        c, vd, hv = config.linear_conv_dim, config.linear_value_dim, config.linear_num_value_heads
        gdn = GdnWeights(
            in_proj_qkv=f.w_in[:c],
            in_proj_z=f.w_in[c : c + vd],
            in_proj_b=f.w_in[c + vd : c + vd + hv],
            in_proj_a=f.w_in[c + vd + hv :],
            conv_weight=f.conv_weight,
            dt_bias=f.dt_bias,
            a_log=f.a_log,
            norm_weight=f.norm_weight,
            out_proj=f.w_out,
        )
        return GdnLayerWeights(mixer=gdn, **rest)
    qd = 2 * config.num_attention_heads * config.head_dim
    kvd = config.num_key_value_heads * config.head_dim
    attention = AttentionWeights(
        q_proj=f.w_in[:qd],
        k_proj=f.w_in[qd : qd + kvd],
        v_proj=f.w_in[qd + kvd :],
        o_proj=f.w_out,
        q_norm=f.q_norm,
        k_norm=f.k_norm,
    )
    return AttentionLayerWeights(mixer=attention, **rest)


def random_layers(config: ModelConfig, seed: int, device) -> tuple[Tensor, list[FusedLayer], Tensor]:
    """(embed [V, D], layers, final_norm [D]) with healthy activations: projections ~
    N(0, 1/fan_in) so outputs keep unit scale, residual writers further scaled by
    1/sqrt(2 * layers) so the residual stream stays O(1), norm weights near 0 (applied as 1 + w)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bf = torch.bfloat16
    d, inter = config.hidden_size, config.intermediate_size
    out_scale = 1.0 / math.sqrt(2 * config.num_layers)

    def mat(rows: int, cols: int, scale: float = 1.0) -> Tensor:
        w = torch.empty(rows, cols, device=device, dtype=bf)
        return w.normal_(0.0, scale / math.sqrt(cols), generator=gen)

    def vec(n: int, mean: float, std: float, dtype=bf) -> Tensor:
        return torch.empty(n, device=device, dtype=dtype).normal_(mean, std, generator=gen)

    layers: list[FusedLayer] = []
    for kind in config.layer_types:
        rest = dict(
            input_norm=vec(d, 0.0, 0.1),
            post_norm=vec(d, 0.0, 0.1),
            w_gate_up=mat(2 * inter, d),
            w_down=mat(d, inter, out_scale),
        )
        if kind == LINEAR_ATTENTION:
            hv, vd, c = config.linear_num_value_heads, config.linear_value_dim, config.linear_conv_dim
            a_log = torch.empty(hv, device=device).uniform_(0.0, math.log(16.0), generator=gen)
            layers.append(
                FusedGdnLayer(
                    w_in=mat(c + vd + 2 * hv, d),
                    w_out=mat(d, vd, out_scale),
                    conv_weight=mat(c, 4, 1.0),
                    a_log=a_log,
                    dt_bias=vec(hv, 1.0, 0.5, torch.float32),
                    norm_weight=vec(config.linear_value_head_dim, 1.0, 0.1),
                    **rest,
                )
            )
        else:
            hq, hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            layers.append(
                FusedAttentionLayer(
                    w_in=mat(2 * hq * hd + 2 * hkv * hd, d),
                    w_out=mat(d, hq * hd, out_scale),
                    q_norm=vec(hd, 0.0, 0.1),
                    k_norm=vec(hd, 0.0, 0.1),
                    **rest,
                )
            )
    embed = torch.empty(config.vocab_size, d, device=device, dtype=bf).normal_(0.0, 1.0, generator=gen)
    return embed, layers, vec(d, 0.0, 0.1)


def plain_weights(config: ModelConfig, embed: Tensor, layers: list[FusedLayer], final_norm: Tensor) -> ModelWeights:
    return ModelWeights(embed_tokens=embed, layers=tuple(plain_layer(f, config) for f in layers), final_norm=final_norm)

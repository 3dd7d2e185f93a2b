"""The benchmark's baseline arm: what a user would otherwise run. transformers'
`Qwen3_5TextModel` scores each candidate's full prompt, one forward pass per candidate (it uses
flash-linear-attention's kernels for the Gated DeltaNet layers where that package is installed).

It holds the same weights as our runners (loaded from the export, or shared without a copy with
a CUDA runner's seeded synthetic weights), so arms differ only in how they execute. It cannot
start from a parent's state: the worker forces policy `off` for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import AttentionLayerWeights, ModelWeights
from openjev.worker.model.ops import head_score
from openjev.worker.runner_api import SegmentResult, SegmentRun


def hf_config(config: ModelConfig):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        layer_types=list(config.layer_types),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
    )


def hf_state_dict(weights: ModelWeights) -> dict[str, Tensor]:
    """transformers' tensor names for our weights (views, no copies)."""
    state = {"embed_tokens.weight": weights.embed_tokens, "norm.weight": weights.final_norm}
    for i, layer in enumerate(weights.layers):
        p = f"layers.{i}."
        state |= {
            p + "input_layernorm.weight": layer.input_norm,
            p + "post_attention_layernorm.weight": layer.post_attention_norm,
            p + "mlp.gate_proj.weight": layer.mlp_gate,
            p + "mlp.up_proj.weight": layer.mlp_up,
            p + "mlp.down_proj.weight": layer.mlp_down,
        }
        if isinstance(layer, AttentionLayerWeights):
            m = layer.mixer
            state |= {
                p + "self_attn.q_proj.weight": m.q_proj,
                p + "self_attn.k_proj.weight": m.k_proj,
                p + "self_attn.v_proj.weight": m.v_proj,
                p + "self_attn.o_proj.weight": m.o_proj,
                p + "self_attn.q_norm.weight": m.q_norm,
                p + "self_attn.k_norm.weight": m.k_norm,
            }
        else:
            g = layer.mixer
            state |= {
                p + "linear_attn.in_proj_qkv.weight": g.in_proj_qkv,
                p + "linear_attn.in_proj_z.weight": g.in_proj_z,
                p + "linear_attn.in_proj_b.weight": g.in_proj_b,
                p + "linear_attn.in_proj_a.weight": g.in_proj_a,
                p + "linear_attn.conv1d.weight": g.conv_weight.unsqueeze(1),
                p + "linear_attn.dt_bias": g.dt_bias,
                p + "linear_attn.A_log": g.a_log,
                p + "linear_attn.norm.weight": g.norm_weight,
                p + "linear_attn.out_proj.weight": g.out_proj,
            }
    return state


class TransformersRunner:
    backend = "transformers"
    max_pass_depth = 1  # full prompts only (policy off)

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        head_weight: Sequence[float],
        head_bias: float,
        *,
        device: torch.device,
        meta=None,
    ):
        from transformers import Qwen3_5TextModel
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        self.config, self.meta, self.device = config, meta, device
        hf = hf_config(config)
        with torch.device("meta"):  # no allocation: the weights are assigned below
            model = Qwen3_5TextModel(hf)
        model.load_state_dict(hf_state_dict(weights), strict=True, assign=True)
        with torch.device(device):  # its buffers made there (the `device` argument is deprecated)
            model.rotary_emb = Qwen3_5TextRotaryEmbedding(hf)
        self.model = model.eval()
        self.head_weight = torch.tensor(list(head_weight), dtype=torch.float32, device=device)
        self.head_bias = float(head_bias)

    @classmethod
    def from_export(
        cls, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> TransformersRunner:
        from openjev.export import load_export_meta
        from openjev.worker.checkpoint.config import load_model_config
        from openjev.worker.checkpoint.weights import load_weights

        meta, config = load_export_meta(model_dir), load_model_config(model_dir)
        weights = load_weights(model_dir, config, dtype)
        if device != "cpu":
            weights = to_device(weights, torch.device(device))
        return cls(config, weights, meta.head_weight, meta.head_bias, device=torch.device(device), meta=meta)

    @torch.no_grad()
    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        results = []
        for run in runs:
            if run.parent_state is not None or run.keep_state or run.start_position:
                raise ValueError("the transformers arm scores full prompts only (policy off)")
            ids = torch.tensor([list(run.token_ids)], device=self.device)
            hidden = self.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1].float()
            score = head_score(hidden.cpu(), self.head_weight.cpu(), self.head_bias) if run.read_head else None
            results.append(SegmentResult(state=None, head_score=score))
        return results


def to_device(weights: ModelWeights, device: torch.device, dtype: torch.dtype | None = None) -> ModelWeights:
    """A copy of weights on device (floating tensors cast to dtype when given)."""
    import dataclasses

    def move(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return obj.to(device, dtype=dtype if dtype is not None and obj.is_floating_point() else obj.dtype)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
        if isinstance(obj, tuple):
            return tuple(move(x) for x in obj)
        return obj

    return move(weights)

"""Load the backbone weights of an export (Hugging Face Qwen3.5 tensor names, bf16 safetensors).

Tensors may sit under `model.language_model.`, `model.` or no prefix; anything else in the
files (vision tower, lm_head, mtp) is ignored, but a backbone layer tensor config.json has no
place for (more layers, another layer type) or a second backbone is refused: the config and the
weights disagree. Every tensor we need is checked for presence,
shape against config.json and finite values, and a problem raises ExportError naming the file
and tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from safetensors import safe_open
from torch import Tensor

from openjev.export import ExportError, check_safetensors_file, safetensors_files
from openjev.worker.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, LayerKind, ModelConfig

PREFIXES = ("model.language_model.", "model.", "")
_EMBED = "embed_tokens.weight"


@dataclass(frozen=True)
class GdnWeights:
    in_proj_qkv: Tensor  # [2*Hk*Dk + Hv*Dv, D]
    in_proj_z: Tensor  # [Hv*Dv, D]
    in_proj_b: Tensor  # [Hv, D]
    in_proj_a: Tensor  # [Hv, D]
    conv_weight: Tensor  # [C, K] (stored as [C, 1, K])
    dt_bias: Tensor  # [Hv]
    a_log: Tensor  # [Hv]
    norm_weight: Tensor  # [Dv], applied as w (not 1 + w)
    out_proj: Tensor  # [D, Hv*Dv]


@dataclass(frozen=True)
class AttentionWeights:
    q_proj: Tensor  # [Hq*2*Dh, D]: per head, Dh query rows then Dh gate rows
    k_proj: Tensor  # [Hkv*Dh, D]
    v_proj: Tensor  # [Hkv*Dh, D]
    o_proj: Tensor  # [D, Hq*Dh]
    q_norm: Tensor  # [Dh]
    k_norm: Tensor  # [Dh]


@dataclass(frozen=True)
class _LayerWeights:
    """What every layer has besides its mixer: the two norms and the SiLU-gated MLP."""

    input_norm: Tensor  # [D]
    post_attention_norm: Tensor  # [D]
    mlp_gate: Tensor  # [I, D]
    mlp_up: Tensor  # [I, D]
    mlp_down: Tensor  # [D, I]


@dataclass(frozen=True)
class GdnLayerWeights(_LayerWeights):
    kind: ClassVar[Literal["linear_attention"]] = LINEAR_ATTENTION
    mixer: GdnWeights


@dataclass(frozen=True)
class AttentionLayerWeights(_LayerWeights):
    kind: ClassVar[Literal["full_attention"]] = FULL_ATTENTION
    mixer: AttentionWeights


# The layer class is the mixer's type: code dispatches with isinstance (or on the literal `kind`).
LayerWeights = GdnLayerWeights | AttentionLayerWeights


@dataclass(frozen=True)
class ModelWeights:
    embed_tokens: Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor  # [D]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Unprefixed tensor name -> shape for every tensor the backbone needs."""
    d, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {_EMBED: (config.vocab_size, d), "norm.weight": (d,)}
    for i, kind in enumerate(config.layer_types):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
        }
        if kind == LINEAR_ATTENTION:
            hv, vdim = config.linear_num_value_heads, config.linear_value_dim
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": (config.linear_conv_dim, d),
                p + "linear_attn.in_proj_z.weight": (vdim, d),
                p + "linear_attn.in_proj_b.weight": (hv, d),
                p + "linear_attn.in_proj_a.weight": (hv, d),
                p + "linear_attn.conv1d.weight": (config.linear_conv_dim, 1, config.linear_conv_kernel_dim),
                p + "linear_attn.dt_bias": (hv,),
                p + "linear_attn.A_log": (hv,),
                p + "linear_attn.norm.weight": (config.linear_value_head_dim,),
                p + "linear_attn.out_proj.weight": (d, vdim),
            }
        elif kind == FULL_ATTENTION:
            hq, hkv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            shapes |= {
                p + "self_attn.q_proj.weight": (hq * dh * 2, d),
                p + "self_attn.k_proj.weight": (hkv * dh, d),
                p + "self_attn.v_proj.weight": (hkv * dh, d),
                p + "self_attn.o_proj.weight": (d, hq * dh),
                p + "self_attn.q_norm.weight": (dh,),
                p + "self_attn.k_norm.weight": (dh,),
            }
        else:
            raise ExportError(f"config.json: layer {i} has unknown layer type {kind!r}")
    return shapes


def _tensor_index(directory: Path) -> dict[str, Path]:
    """Full tensor name -> the safetensors file holding it (headers checked for truncation)."""
    index: dict[str, Path] = {}
    for path in safetensors_files(directory):
        for name in check_safetensors_file(path):
            if name in index:  # a stale shard beside the export would win by its file name's order
                raise ExportError(f"{path.name}: tensor {name!r} is also in {index[name].name}")
            index[name] = path
    return index


def _prefix(index: dict[str, Path], directory: Path) -> str:
    found = [prefix for prefix in PREFIXES if prefix + _EMBED in index]
    if not found:
        raise ExportError(f"*.safetensors: no tensor {_EMBED} under any of the prefixes {PREFIXES} in {directory}")
    if len(found) > 1:  # two backbones: which one the config describes is anybody's guess
        names = " and ".join(f"{prefix + _EMBED} ({index[prefix + _EMBED].name})" for prefix in found)
        raise ExportError(f"*.safetensors: two backbones, {names}")
    return found[0]


def _refuse_unused_layers(index: dict[str, Path], prefix: str, shapes: dict, config: ModelConfig) -> None:
    """A backbone layer tensor config.json has no place for means the config and the weights
    disagree (fewer layers, another layer type): served, it would give other answers silently."""
    for name, path in sorted(index.items()):
        short = name[len(prefix) :] if name.startswith(prefix) else ""
        if short.startswith("layers.") and short not in shapes:
            layer = short.split(".")[1]
            # ASCII digits of a layer index only: str.isdigit() takes "²", int() takes no such
            # number, nor thousands of digits
            known = layer.isascii() and layer.isdigit() and len(layer) < 10 and int(layer) < len(config.layer_types)
            where = (
                f"layer {layer} is {config.layer_types[int(layer)]}"
                if known
                else f"num_hidden_layers is {len(config.layer_types)}"
            )
            raise ExportError(f"{path.name}: tensor {name!r} is not used by config.json ({where})")


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _finite(tensor: Tensor) -> bool:
    """min and max in one pass: NaN propagates, an inf is one of them, no overflow (~16 GB/s a
    core here; isfinite().all() on bf16 took 0.4 GB/s)."""
    return not tensor.numel() or all(bool(torch.isfinite(x)) for x in torch.aminmax(tensor))


# The decay parameters: g = -exp(A_log) softplus(a + dt_bias) is computed in fp32 on every path,
# so an export that stores them in F32 keeps its bits (rounded to a bf16 compute dtype, they were
# cast back to fp32 with the bits lost).
_FP32_TENSORS = ("linear_attn.dt_bias", "linear_attn.A_log")


def _compute_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(_FP32_TENSORS) else dtype


def load_tensors(
    directory: str | Path, config: ModelConfig, dtype: torch.dtype, *, own: bool = False
) -> dict[str, Tensor]:
    """Unprefixed name -> tensor upcast to dtype (the decay parameters to fp32), for exactly the
    tensors expected_shapes lists.
    own: every tensor in memory of its own; otherwise one already in `dtype` may be a view of the
    file's memory map (what a runner that copies to the GPU wants: no second copy in RAM)."""
    directory = Path(directory)
    index = _tensor_index(directory)
    prefix = _prefix(index, directory)
    shapes = expected_shapes(config)
    _refuse_unused_layers(index, prefix, shapes, config)
    for name in shapes:
        if prefix + name not in index:
            files = ", ".join(sorted({path.name for path in index.values()}))
            raise ExportError(f"{files}: missing tensor {prefix + name} (needed by config.json)")
    tensors: dict[str, Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(index[prefix + name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    tensor = f.get_tensor(prefix + name)
                    if tuple(tensor.shape) != shapes[name]:
                        raise ExportError(
                            f"{path.name}: tensor {prefix + name} has shape {tuple(tensor.shape)}, "
                            f"expected {shapes[name]} from config.json"
                        )
                    if tensor.dtype not in _SAFETENSORS_DTYPES:  # integers, and F8 (no finiteness check)
                        raise ExportError(f"{path.name}: tensor {prefix + name} has dtype {tensor.dtype}")
                    # a NaN or inf weight would fail every request it reaches (a non-finite score),
                    # and so would a finite F64/F32 weight that overflows the compute dtype
                    if not _finite(tensor):
                        raise ExportError(f"{path.name}: tensor {prefix + name} has NaN or infinite values")
                    target = _compute_dtype(name, dtype)
                    converted = tensor.to(target, copy=own)
                    if converted is not tensor and not _finite(converted):
                        stored = _SAFETENSORS_DTYPES.get(tensor.dtype, tensor.dtype)
                        raise ExportError(
                            f"{path.name}: tensor {prefix + name} ({stored}) has values beyond {target}'s range"
                        )
                    tensors[name] = converted
        except ExportError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ExportError(f"{path.name}: cannot read tensors ({exc})") from exc
    return tensors


def _gdn(t: dict[str, Tensor], p: str) -> GdnWeights:
    return GdnWeights(
        in_proj_qkv=t[p + "in_proj_qkv.weight"],
        in_proj_z=t[p + "in_proj_z.weight"],
        in_proj_b=t[p + "in_proj_b.weight"],
        in_proj_a=t[p + "in_proj_a.weight"],
        conv_weight=t[p + "conv1d.weight"][:, 0, :].contiguous(),
        dt_bias=t[p + "dt_bias"],  # fp32 whatever the compute dtype (_FP32_TENSORS)
        a_log=t[p + "A_log"],
        norm_weight=t[p + "norm.weight"],
        out_proj=t[p + "out_proj.weight"],
    )


def _attention(t: dict[str, Tensor], p: str) -> AttentionWeights:
    return AttentionWeights(
        q_proj=t[p + "q_proj.weight"],
        k_proj=t[p + "k_proj.weight"],
        v_proj=t[p + "v_proj.weight"],
        o_proj=t[p + "o_proj.weight"],
        q_norm=t[p + "q_norm.weight"],
        k_norm=t[p + "k_norm.weight"],
    )


def _layer(t: dict[str, Tensor], p: str, kind: LayerKind) -> LayerWeights:
    rest = dict(
        input_norm=t[p + "input_layernorm.weight"],
        post_attention_norm=t[p + "post_attention_layernorm.weight"],
        mlp_gate=t[p + "mlp.gate_proj.weight"],
        mlp_up=t[p + "mlp.up_proj.weight"],
        mlp_down=t[p + "mlp.down_proj.weight"],
    )
    if kind == LINEAR_ATTENTION:
        return GdnLayerWeights(mixer=_gdn(t, p + "linear_attn."), **rest)
    return AttentionLayerWeights(mixer=_attention(t, p + "self_attn."), **rest)


def load_weights(
    directory: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32, *, own: bool = False
) -> ModelWeights:
    """All backbone weights of an export, upcast (bf16 -> dtype) on CPU (own: load_tensors')."""
    t = load_tensors(directory, config, dtype, own=own)
    layers = [_layer(t, f"layers.{i}.", kind) for i, kind in enumerate(config.layer_types)]
    return ModelWeights(embed_tokens=t[_EMBED], layers=tuple(layers), final_norm=t["norm.weight"])

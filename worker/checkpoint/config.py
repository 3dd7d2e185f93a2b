"""The backbone shape, read from an export's config.json (nested Qwen3.5 or flat text config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from openjev.export import CONFIG_FILE, MODEL_TYPES, ExportError, finite, text_config_of

LayerKind = Literal["linear_attention", "full_attention"]
LINEAR_ATTENTION: Final = "linear_attention"
FULL_ATTENTION: Final = "full_attention"
LAYER_KINDS: tuple[LayerKind, ...] = (LINEAR_ATTENTION, FULL_ATTENTION)
# Older Qwen-Next style names that transformers also maps onto the two kinds.
_LEGACY_LAYER_KINDS: dict[str, LayerKind] = {"mamba": LINEAR_ATTENTION, "attention": FULL_ATTENTION}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[LayerKind, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    eos_token_ids: tuple[int, ...] = ()  # config.json's eos_token_id (one or a list; none: unchecked)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        # Same rounding as transformers: int(head_dim * factor).
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN conv: q and k (key_dim each) then v (value_dim)."""
        return 2 * self.linear_key_dim + self.linear_value_dim


MAX_LAYERS = 4096  # far beyond any Qwen3.5 model


def _fail(problem: str) -> ExportError:
    return ExportError(f"{CONFIG_FILE}: {problem}")


def _positive_int(text: dict[str, Any], key: str) -> int:
    value = text.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(f"{key} must be a positive integer, got {value!r}")
    if value >= 2**31:  # no size is near it; far above, float products of it overflow
        raise _fail(f"{key} must be below 2**31, got {value}")
    return value


def _eos_token_ids(text: dict[str, Any], raw: dict[str, Any]) -> tuple[int, ...]:
    """The text config's eos_token_id, else the top level's (a nested config.json may keep it
    only there): without either, config.json's end tokens are not compared with the tokenizer's."""
    value = text.get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _fail(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _positive_float(source: dict[str, Any], key: str, most: float | None = None) -> float:
    value = source.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) or not value > 0:
        raise _fail(f"{key} must be a positive finite number, got {value!r}")
    if most is not None and value > most:
        raise _fail(f"{key} must be at most {most}, got {value!r}")
    return float(value)


# Qwen3.5 uses 1e-6; an epsilon near the activations' mean square (order 1) flattens every norm's
# output and with it every answer, so a larger one is a broken config, not a model
MAX_RMS_NORM_EPS = 0.1


def _layer_kind(index: int, name: object) -> LayerKind:
    if name == LINEAR_ATTENTION or name == FULL_ATTENTION:
        return name
    if isinstance(name, str) and name in _LEGACY_LAYER_KINDS:
        return _LEGACY_LAYER_KINDS[name]
    raise _fail(f"layer {index} has unknown layer type {name!r} (known: {', '.join(LAYER_KINDS)})")


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    names = text.get("layer_types")
    if names is None:
        # transformers' default: every `full_attention_interval`-th layer is full attention.
        interval = text.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise _fail(f"full_attention_interval must be a positive integer, got {interval!r}")
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if not isinstance(names, list) or len(names) != num_layers:
        raise _fail(f"layer_types must list num_hidden_layers={num_layers} kinds")
    return tuple(_layer_kind(i, name) for i, name in enumerate(names))


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor). Text-only Qwen3.5 feeds the same 1-D position to all
    three mrope sections, so mrope collapses to ordinary rotary and mrope_section is irrelevant."""
    given, legacy = text.get("rope_parameters"), text.get("rope_scaling")
    # each checked as given: an empty string, list or false was taken for "absent" and served
    for name, value in (("rope_parameters", given), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise _fail(f"{name} must be an object, got {value!r}")
    # transformers reads rope_scaling where both are given: serving the other would differ from it
    if given and legacy and given != legacy:
        raise _fail("rope_parameters and rope_scaling are both given and differ: give one of them")
    rope = given or legacy or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _fail(f"rope_type {rope_type!r} is not supported (only 'default')")
    source = rope if "rope_theta" in rope else text
    theta = _positive_float(source, "rope_theta")
    if theta < 1:  # the rotary base: below 1 the frequencies grow, and 1e-300 made every score NaN
        raise _fail(f"rope_theta must be at least 1 (the rotary base; Qwen3.5 uses 1e7), got {theta!r}")
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise _fail(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    return theta, float(factor)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """ModelConfig from the parsed config.json; raises ExportError naming config.json."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail(f"model_type is {model_type!r}, expected one of {MODEL_TYPES}")
    text = text_config_of(raw)
    if not isinstance(text, dict):
        raise _fail("text_config must be an object")
    if text.get("hidden_act", "silu") != "silu":
        raise _fail(f"hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
    if (bias := text.get("attention_bias", False)) is not False:
        raise _fail(f"attention_bias must be false (biases are not supported), got {bias!r}")
    num_layers = _positive_int(text, "num_hidden_layers")
    if num_layers > MAX_LAYERS:  # a per-layer table of 10^9 entries is built before any weight is read
        raise _fail(f"num_hidden_layers={num_layers} is more than {MAX_LAYERS}")
    theta, factor = _rope(text)
    config = ModelConfig(
        vocab_size=_positive_int(text, "vocab_size"),
        hidden_size=_positive_int(text, "hidden_size"),
        intermediate_size=_positive_int(text, "intermediate_size"),
        layer_types=_layer_types(text, num_layers),
        num_attention_heads=_positive_int(text, "num_attention_heads"),
        num_key_value_heads=_positive_int(text, "num_key_value_heads"),
        head_dim=_positive_int(text, "head_dim"),
        linear_num_key_heads=_positive_int(text, "linear_num_key_heads"),
        linear_num_value_heads=_positive_int(text, "linear_num_value_heads"),
        linear_key_head_dim=_positive_int(text, "linear_key_head_dim"),
        linear_value_head_dim=_positive_int(text, "linear_value_head_dim"),
        linear_conv_kernel_dim=_positive_int(text, "linear_conv_kernel_dim"),
        rms_norm_eps=_positive_float(text, "rms_norm_eps", MAX_RMS_NORM_EPS),
        rope_theta=theta,
        partial_rotary_factor=factor,
        eos_token_ids=_eos_token_ids(text, raw),
    )
    if config.num_attention_heads % config.num_key_value_heads:
        raise _fail("num_attention_heads must be a multiple of num_key_value_heads")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise _fail("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if config.rotary_dim % 2:
        raise _fail(f"rotary dim {config.rotary_dim} (head_dim * partial_rotary_factor) must be even")
    return config


def load_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise _fail(f"missing from export directory {path.parent}") from exc
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, 5,000-digit ints
        raise _fail(f"not readable JSON ({type(exc).__name__})") from exc
    if not isinstance(raw, dict):
        raise _fail("top level must be a JSON object")
    return parse_model_config(raw)

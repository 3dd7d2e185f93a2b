"""config.json's parsing at its edges (found untested by a mutation run of
worker/checkpoint/config.py): each bound, values of the wrong JSON type (a bool is an int in
Python), defaults taken when a field is absent, and where a field is read from when config.json
gives it twice. The export directory's own edges are in test_export.py."""

from __future__ import annotations

import pytest

from openjev.export import ExportError
from openjev.tools.demo_model import TEXT_CONFIG
from openjev.worker.checkpoint.config import MAX_LAYERS, MAX_RMS_NORM_EPS, parse_model_config


def _parse(**changes) -> object:
    return parse_model_config({"model_type": "qwen3_5", "text_config": {**TEXT_CONFIG, **changes}})


INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@pytest.mark.parametrize("value", [0, True])
@pytest.mark.parametrize("field", INT_FIELDS)
def test_a_size_of_zero_or_true_is_named(field, value):
    with pytest.raises(ExportError, match=rf"^config\.json: {field} must be a positive integer, got {value}$"):
        _parse(**{field: value})


def test_a_size_of_2_to_the_31_is_refused_and_one_less_parses():
    assert _parse(vocab_size=2**31 - 1).vocab_size == 2**31 - 1
    with pytest.raises(ExportError, match=rf"^config\.json: vocab_size must be below 2\*\*31, got {2**31}$"):
        _parse(vocab_size=2**31)


def test_max_layers_is_the_most_accepted():
    without_kinds = {k: v for k, v in TEXT_CONFIG.items() if k != "layer_types"}
    config = parse_model_config({**without_kinds, "num_hidden_layers": MAX_LAYERS})
    assert config.num_layers == MAX_LAYERS
    with pytest.raises(ExportError, match=rf"^config\.json: num_hidden_layers={MAX_LAYERS + 1} is more than"):
        parse_model_config({**without_kinds, "num_hidden_layers": MAX_LAYERS + 1})


def test_end_token_ids():
    """Id 0 is a token id; a list is kept whole, in order; text_config's wins over the top level's."""
    assert _parse(eos_token_id=0).eos_token_ids == (0,)
    assert _parse(eos_token_id=[248046, 248044]).eos_token_ids == (248046, 248044)
    nested = {"model_type": "qwen3_5", "text_config": {**TEXT_CONFIG, "eos_token_id": 248046}, "eos_token_id": 7}
    assert parse_model_config(nested).eos_token_ids == (248046,)


def test_rms_norm_eps_edges():
    assert _parse(rms_norm_eps=MAX_RMS_NORM_EPS).rms_norm_eps == MAX_RMS_NORM_EPS
    for bad, problem in ((0, "must be a positive finite number"), (0.11, "must be at most 0.1")):
        with pytest.raises(ExportError, match=rf"^config\.json: rms_norm_eps {problem}, got {bad}$"):
            _parse(rms_norm_eps=bad)


def test_legacy_layer_names_map_onto_the_two_kinds():
    config = _parse(layer_types=["mamba", "mamba", "mamba", "attention"] * 2)
    assert config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2


def test_layer_types_default_to_one_full_attention_layer_in_four():
    """transformers' default full_attention_interval is 4 (Qwen3.5's)."""
    without = {k: v for k, v in TEXT_CONFIG.items() if k not in ("layer_types", "full_attention_interval")}
    config = parse_model_config(without)
    assert config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    without_kinds = {k: v for k, v in TEXT_CONFIG.items() if k != "layer_types"}
    with pytest.raises(ExportError, match=r"^config\.json: full_attention_interval must be a positive integer"):
        parse_model_config({**without_kinds, "full_attention_interval": True})


def _rope(**rope) -> dict:
    return {k: v for k, v in {**TEXT_CONFIG["rope_parameters"], **rope}.items() if v is not None}


def test_partial_rotary_factor_default_and_where_it_is_read():
    """Absent everywhere: 0.25 (Qwen3.5's); given only beside rope_parameters (a flat older
    layout): that one; given in both: rope_parameters'."""
    assert _parse(rope_parameters=_rope(partial_rotary_factor=None)).partial_rotary_factor == 0.25
    assert _parse(rope_parameters=_rope(partial_rotary_factor=None), partial_rotary_factor=0.5).rotary_dim == 32
    assert _parse(rope_parameters=_rope(partial_rotary_factor=1)).partial_rotary_factor == 1.0
    assert _parse(partial_rotary_factor=0.5).partial_rotary_factor == 0.25


def test_rope_theta_edges_and_where_it_is_read():
    assert _parse(rope_parameters=_rope(rope_theta=1)).rope_theta == 1.0
    with pytest.raises(ExportError, match=r"^config\.json: rope_theta must be at least 1 .*got 0\.5$"):
        _parse(rope_parameters=_rope(rope_theta=0.5))
    # beside rope_parameters' theta, a top-level one is not the model's
    assert _parse(rope_theta=10000).rope_theta == 1e7
    assert _parse(rope_parameters=_rope(rope_theta=None), rope_theta=10000).rope_theta == 10000.0


def test_absent_activation_and_bias_take_qwen_defaults_and_a_null_bias_is_refused():
    without = {k: v for k, v in TEXT_CONFIG.items() if k not in ("hidden_act", "attention_bias")}
    assert parse_model_config(without).hidden_size == TEXT_CONFIG["hidden_size"]
    with pytest.raises(ExportError, match=r"^config\.json: attention_bias must be false .*got None$"):
        _parse(attention_bias=None)

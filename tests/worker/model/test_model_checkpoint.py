"""Checkpoint loading: the accepted layouts load the same model; broken ones are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from openjev.export import ExportError
from openjev.worker.checkpoint.config import load_model_config, parse_model_config
from openjev.worker.checkpoint.weights import load_weights
from openjev.worker.model.runner import TorchRunner
from openjev.worker.runner_api import SegmentRun

PREFIX = "model.language_model."
SMALL_VOCAB = 1000  # the demo's embedding cut down, so each variant writes and loads quickly


@pytest.fixture(scope="module")
def small(model_export):
    """(tensors without prefix, text_config) of the demo with a 1000-token vocabulary."""
    tensors = {name.removeprefix(PREFIX): t for name, t in load_file(model_export / "model.safetensors").items()}
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"][:SMALL_VOCAB].clone()
    text_config = json.loads((model_export / "config.json").read_text())["text_config"]
    return tensors, {**text_config, "vocab_size": SMALL_VOCAB}


def write_export(src: Path, dst: Path, tensors: dict, config: dict, prefix: str = PREFIX) -> Path:
    dst.mkdir()
    for name in ("open_jev_export.json", "tokenizer.json"):
        shutil.copy(src / name, dst / name)
    save_file({prefix + name: t for name, t in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def nested(text_config: dict) -> dict:
    return {"model_type": "qwen3_5", "text_config": text_config}


def score(export_dir: Path, ids: list[int]) -> float:
    [result] = TorchRunner(export_dir).run_launch([SegmentRun(ids, 0, None, keep_state=False, read_head=True)])
    return result.head_score


def test_prefixes_and_flat_config_load_the_same_model(model_export, small, tmp_path):
    tensors, text_config = small
    ids = torch.randint(0, SMALL_VOCAB, (23,)).tolist()
    scores = [
        score(write_export(model_export, tmp_path / "lm", tensors, nested(text_config)), ids),
        score(write_export(model_export, tmp_path / "model", tensors, nested(text_config), "model."), ids),
        score(write_export(model_export, tmp_path / "bare", tensors, text_config, ""), ids),
    ]
    assert scores[0] == scores[1] == scores[2]
    # The cut vocabulary changes nothing for ids inside it.
    assert abs(scores[0] - score(model_export, ids)) < 1e-5


def test_missing_tensor_is_named(model_export, small, tmp_path):
    tensors, text_config = small
    tensors = {k: v for k, v in tensors.items() if k != "layers.3.self_attn.k_norm.weight"}
    export = write_export(model_export, tmp_path / "x", tensors, nested(text_config))
    with pytest.raises(
        ExportError, match=r"model\.safetensors: missing tensor model\.language_model\.layers\.3\.self_attn\.k_norm"
    ):
        TorchRunner(export)


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "fewer layers in the config",
            r"layers\.4\.input_layernorm\.weight' is not used by config\.json \(num_hidden_layers is 4\)",
        ),
        (
            "a layer more in the weights",
            r"layers\.8\.input_layernorm\.weight' is not used by config\.json \(num_hidden_layers is 8\)",
        ),
        (
            "attention tensors in a linear layer",
            r"layers\.0\.self_attn\.q_norm\.weight' is not used .*layer 0 is linear_attention",
        ),
        (
            "a second backbone",
            r"two backbones, model\.language_model\.embed_tokens\.weight \(model\.safetensors\) and ",
        ),
    ],
)
def test_weights_the_config_has_no_place_for_are_refused(model_export, small, tmp_path, case, expected):
    """A config and weights that disagree were served as the config said (a 4-layer config on
    8 layers of weights answered 0.9406 where the export answers 0.9354), extra tensors ignored."""
    tensors, text_config = small
    tensors, config = dict(tensors), dict(text_config)
    if case == "fewer layers in the config":
        config |= {"num_hidden_layers": 4, "layer_types": config["layer_types"][:4]}
    elif case == "a layer more in the weights":
        tensors |= {
            k.replace("layers.7.", "layers.8."): v.clone() for k, v in tensors.items() if k.startswith("layers.7.")
        }
    elif case == "attention tensors in a linear layer":
        tensors["layers.0.self_attn.q_norm.weight"] = tensors["layers.3.self_attn.q_norm.weight"].clone()
    export = write_export(model_export, tmp_path / "x", tensors, nested(config))
    if case == "a second backbone":
        save_file({"model." + k: v for k, v in tensors.items()}, str(export / "old.safetensors"))
    with pytest.raises(ExportError, match=expected):
        TorchRunner(export)


def test_wrong_shape_is_named(model_export, small, tmp_path):
    tensors, text_config = small
    tensors = {**tensors, "layers.0.linear_attn.in_proj_a.weight": torch.zeros(3, 128, dtype=torch.bfloat16)}
    export = write_export(model_export, tmp_path / "x", tensors, nested(text_config))
    with pytest.raises(
        ExportError,
        match=r"model\.safetensors: tensor .*layers\.0\.linear_attn\.in_proj_a\.weight has shape \(3, 128\)",
    ):
        TorchRunner(export)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_is_named(model_export, small, tmp_path, bad):
    tensors, text_config = small
    weight = tensors["layers.1.mlp.up_proj.weight"].clone()
    weight[7, 3] = bad
    export = write_export(
        model_export, tmp_path / "x", {**tensors, "layers.1.mlp.up_proj.weight": weight}, nested(text_config)
    )
    with pytest.raises(
        ExportError, match=r"model\.safetensors: tensor .*layers\.1\.mlp\.up_proj\.weight has NaN or infinite values"
    ):
        TorchRunner(export)


@pytest.mark.parametrize(
    ("stored", "value", "dtype"), [(torch.float64, 1e300, torch.float32), (torch.float32, 3.4e38, torch.bfloat16)]
)
def test_a_weight_past_the_compute_dtype_is_named(model_export, small, tmp_path, stored, value, dtype):
    """A finite F64 or F32 weight that overflows the compute dtype (the CPU runner's fp32, the GPU
    runner's bf16) is refused by name, not turned into inf that fails the warm-up."""
    from openjev.worker.checkpoint.config import load_model_config
    from openjev.worker.checkpoint.weights import load_tensors

    tensors, text_config = small
    weight = tensors["layers.1.mlp.up_proj.weight"].to(stored)
    weight[7, 3] = value
    assert torch.isfinite(weight).all() and not torch.isfinite(weight.to(dtype)).all()
    export = write_export(
        model_export, tmp_path / "x", {**tensors, "layers.1.mlp.up_proj.weight": weight}, nested(text_config)
    )
    with pytest.raises(ExportError, match=rf"up_proj\.weight \(F\d\d\) has values beyond {dtype}'s range"):
        load_tensors(export, load_model_config(export), dtype)


def test_weights_stored_in_the_compute_dtype_do_not_follow_the_file(model_export, small, tmp_path):
    """An F32 export on the CPU runner (fp32): its weights were views of the file's memory map, so
    the file rewritten in place (same inode, as `cp` over it does) changed the answers of a
    running worker, and truncating it killed the worker (a review helper's finding)."""
    tensors, text_config = small
    export = write_export(
        model_export, tmp_path / "f32", {k: v.float() for k, v in tensors.items()}, nested(text_config)
    )
    runner = TorchRunner(export)
    ids = list(range(3, 40))
    [before] = runner.run_launch([SegmentRun(ids, 0, None, keep_state=False, read_head=True)])
    path = export / "model.safetensors"
    with open(path, "r+b") as f:  # every tensor byte zeroed in place
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        f.write(bytes(path.stat().st_size - 8 - header))
    [after] = runner.run_launch([SegmentRun(ids, 0, None, keep_state=False, read_head=True)])
    assert after.head_score == before.head_score
    assert runner.weights.embed_tokens.abs().sum() > 0


def test_an_f8_weight_is_refused_by_name(model_export, small, tmp_path):
    """An F8 weight is refused by its dtype and name (torch's finiteness check fails on it, which
    named only the file)."""
    tensors, text_config = small
    weight = tensors["layers.1.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    export = write_export(
        model_export, tmp_path / "x", {**tensors, "layers.1.mlp.up_proj.weight": weight}, nested(text_config)
    )
    with pytest.raises(
        ExportError,
        match=r"model\.safetensors: tensor .*layers\.1\.mlp\.up_proj\.weight has dtype torch\.float8_e4m3fn",
    ):
        TorchRunner(export)


def test_huge_finite_weights_load(model_export, small, tmp_path):
    """The finiteness check refuses NaN and inf only: weights near bf16's largest value (whose sum
    would overflow) load."""
    tensors, text_config = small
    weight = torch.full_like(tensors["layers.1.mlp.up_proj.weight"], 3e38)
    assert torch.isfinite(weight).all() and not torch.isfinite(weight.sum(dtype=torch.float32))
    export = write_export(
        model_export, tmp_path / "x", {**tensors, "layers.1.mlp.up_proj.weight": weight}, nested(text_config)
    )
    TorchRunner(export)


def test_unknown_layer_type_is_refused(model_export, small, tmp_path):
    tensors, text_config = small
    kinds = list(text_config["layer_types"])
    kinds[2] = "sliding_attention"
    export = write_export(model_export, tmp_path / "x", tensors, nested({**text_config, "layer_types": kinds}))
    with pytest.raises(ExportError, match=r"config\.json: layer 2 has unknown layer type 'sliding_attention'"):
        TorchRunner(export)


def test_no_embedding_under_known_prefixes_is_refused(model_export, small, tmp_path):
    tensors, text_config = small
    export = write_export(model_export, tmp_path / "x", tensors, nested(text_config), prefix="backbone.")
    with pytest.raises(ExportError, match="embed_tokens.weight"):
        TorchRunner(export)


def test_real_27b_config_shape_parses():
    """The nested config of the real 27B shape (docs/architecture.md): defaults fill layer_types, mrope
    collapses to 64 rotary dims."""
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    config = parse_model_config({"model_type": "qwen3_5", "text_config": text, "vision_config": {}})
    assert config.rotary_dim == 64 and config.num_layers == 64
    assert config.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert config.layer_types.count("full_attention") == 16
    assert config.linear_conv_dim == 2 * 16 * 128 + 48 * 128
    with pytest.raises(ExportError, match="config.json: model_type"):
        parse_model_config({**text, "model_type": "llama"})
    # rope_scaling beside rope_parameters: the same is fine, another (transformers would read it,
    # yarn or another theta, where the worker served rope_parameters: a review helper's finding) refused
    same = {**text, "rope_scaling": dict(text["rope_parameters"])}
    assert parse_model_config({"model_type": "qwen3_5", "text_config": same}).rope_theta == 1e7
    for other in ({"rope_type": "yarn", "factor": 4.0}, {"rope_type": "default", "rope_theta": 10000}):
        with pytest.raises(ExportError, match="rope_parameters and rope_scaling are both given and differ"):
            parse_model_config({"model_type": "qwen3_5", "text_config": {**text, "rope_scaling": other}})


@pytest.fixture(scope="module")
def demo_text_config(model_export) -> dict:
    return json.loads((model_export / "config.json").read_text())["text_config"]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(only 'silu'\)"),
        ({"num_key_value_heads": 3}, "num_attention_heads must be a multiple of num_key_value_heads"),
        ({"linear_num_key_heads": 3}, "linear_num_value_heads must be a multiple of linear_num_key_heads"),
        ({"layer_types": ["linear_attention"] * 7}, "layer_types must list num_hidden_layers=8 kinds"),
        ({"layer_types": "full_attention"}, "layer_types must list num_hidden_layers=8 kinds"),
        ({"eos_token_id": -1}, "eos_token_id must be a token id or a list of them, got -1"),
        ({"eos_token_id": [248046, True]}, r"eos_token_id must be a token id or a list of them, got \[248046, True\]"),
        ({"rope_parameters": "default"}, "rope_parameters must be an object, got 'default'"),
        # falsy ones were taken for "absent" and served as default rope
        ({"rope_parameters": [], "rope_theta": 1e7}, r"rope_parameters must be an object, got \[\]"),
        ({"rope_parameters": False, "rope_theta": 1e7}, "rope_parameters must be an object, got False"),
        ({"rope_parameters": None, "rope_scaling": "yarn"}, "rope_scaling must be an object, got 'yarn'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7}}, "rope_type 'yarn' is not supported"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "rope_type 'linear' is not supported"),
        ({"head_dim": 28}, r"rotary dim 7 \(head_dim \* partial_rotary_factor\) must be even"),
    ],
)
def test_bad_text_config_is_named(demo_text_config, changes, expected):
    """Each refusal on the demo's otherwise valid text config (parsed only, no weights)."""
    with pytest.raises(ExportError, match=rf"^config\.json: {expected}"):
        parse_model_config(nested({**demo_text_config, **changes}))


# 0 and 1.5 give even rotary dims of head_dim 64 (0 and 96): only the range check refuses them
@pytest.mark.parametrize("factor", [0, 1.5, True, "0.25"])
def test_bad_partial_rotary_factor_is_refused(demo_text_config, factor):
    rope = {**demo_text_config["rope_parameters"], "partial_rotary_factor": factor}
    with pytest.raises(
        ExportError, match=rf"^config\.json: partial_rotary_factor must be in \(0, 1\], got {factor!r}$"
    ):
        parse_model_config(nested({**demo_text_config, "rope_parameters": rope}))


def test_text_config_not_an_object_is_refused(demo_text_config):
    with pytest.raises(ExportError, match=r"^config\.json: text_config must be an object"):
        parse_model_config(nested([demo_text_config]))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "missing from export directory"),
        ("{not json", r"not readable JSON \(JSONDecodeError\)"),
        ("[]", "top level must be a JSON object"),
    ],
)
def test_unreadable_config_file_is_named(tmp_path, content, expected):
    """load_model_config on its own (the worker checks the export first, but its callers need not)."""
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ExportError, match=rf"^config\.json: {expected}"):
        load_model_config(tmp_path)


def test_decay_parameters_stored_in_f32_keep_their_bits_under_a_bf16_compute_dtype(model_export, small, tmp_path):
    """g = -exp(A_log) softplus(a + dt_bias) runs in fp32 on every path, but the CUDA runner loads
    in bf16: F32-stored decay parameters were rounded to bf16 first, then cast back to fp32."""
    tensors, text_config = small
    layer = next(i for i, kind in enumerate(load_model_config(model_export).layer_types) if kind == "linear_attention")
    names = [f"layers.{layer}.linear_attn.{name}" for name in ("dt_bias", "A_log")]
    exact = {name: tensors[name].float() + 1e-3 * torch.arange(tensors[name].numel()) for name in names}
    assert all((t.to(torch.bfloat16).float() != t).any() for t in exact.values())  # bits bf16 lacks
    export = write_export(model_export, tmp_path / "f32-decay", {**tensors, **exact}, nested(text_config))
    mixer = load_weights(export, load_model_config(export), torch.bfloat16).layers[layer].mixer
    assert mixer.dt_bias.dtype == mixer.a_log.dtype == torch.float32
    assert torch.equal(mixer.dt_bias, exact[names[0]]) and torch.equal(mixer.a_log, exact[names[1]])
    assert mixer.in_proj_a.dtype == torch.bfloat16

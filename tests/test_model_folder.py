"""The model folder as docs/model-folder.md describes it (and the page against the code): the
weight dtypes it accepts besides bf16, the bounds of open_jev_export.json's
temperature and head_bias at their edges (1e308 or 1e-300 and a bias of 3e38 were served, every
answer uniform or saturated), and the sizes the CUDA backend's kernels are compiled for, compared
with config.json before any weight loads (on a GPU host a model of other sizes loaded for minutes
and then failed its warm-up with an unflatten error). Both found by a review of 2026-12-04."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from other_export import copied_export

from openjev.export import MAX_ABS_HEAD_BIAS, MAX_TEMPERATURE, MIN_TEMPERATURE, ExportError, load_export_meta
from openjev.tools.demo_model import TEXT_CONFIG
from openjev.worker import backends, geometry
from openjev.worker.checkpoint.config import load_model_config, parse_model_config
from openjev.worker.cuda.fused_weights import shape_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "model-folder.md"

# config.json of the 27B shape (docs/model-folder.md; DESIGN's real shapes), in the demo's layout
CONFIG_27B = {
    **TEXT_CONFIG,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}


def _export(demo_model: Path, into: Path, **fields) -> Path:
    """The demo export's small files copied, the weights linked, open_jev_export.json with fields."""
    copied_export(demo_model, into)
    meta = json.loads((into / "open_jev_export.json").read_text())
    (into / "open_jev_export.json").write_text(json.dumps({**meta, **fields}))
    return into


@pytest.mark.parametrize(
    "fields",
    [{"temperature": MIN_TEMPERATURE}, {"temperature": MAX_TEMPERATURE}, {"head_bias": MAX_ABS_HEAD_BIAS}],
    ids=str,
)
def test_the_bounds_themselves_are_accepted(demo_model, tmp_path, fields):
    meta = load_export_meta(_export(demo_model, tmp_path / "export", **fields))
    assert {key: getattr(meta, key) for key in fields} == fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": MIN_TEMPERATURE * 0.999}, "temperature must be between 0.001 and 1000"),
        ({"temperature": MAX_TEMPERATURE * 1.001}, "temperature must be between 0.001 and 1000"),
        ({"head_bias": -MAX_ABS_HEAD_BIAS * 1.001}, "head_bias must be within -10000..10000"),
    ],
    ids=str,
)
def test_just_past_the_bounds_is_refused(demo_model, tmp_path, fields, message):
    with pytest.raises(ExportError, match=f"^open_jev_export.json: {message}"):
        load_export_meta(_export(demo_model, tmp_path / "export", **fields))


def test_the_cuda_backend_takes_the_real_shapes():
    from_json = parse_model_config({"model_type": "qwen3_5_text", **CONFIG_27B})
    assert from_json == dataclasses.replace(shape_config("27b"), eos_token_ids=(248046,))  # the shape meant
    for config in (shape_config("27b"), shape_config("9b"), from_json):
        assert backends.cuda_config_problems(config) == []
        backends.check_cuda_config(config)


def test_the_cuda_backend_refuses_the_demo_models_sizes(demo_model):
    message = (
        "config.json: the cuda backend's kernels are compiled for other sizes: head_dim 64 (supported: 256); "
        "linear_key_head_dim 32 (supported: 128); linear_value_head_dim 32 (supported: 128); "
        "run this model with --backend torch"
    )
    with pytest.raises(ExportError, match=f"^{re.escape(message)}$"):
        backends.check_cuda_config(load_model_config(demo_model))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"head_dim": 128}, "head_dim 128 (supported: 256)"),
        ({"linear_key_head_dim": 64}, "linear_key_head_dim 64 (supported: 128)"),
        ({"linear_value_head_dim": 256}, "linear_value_head_dim 256 (supported: 128)"),
        ({"linear_conv_kernel_dim": 3}, "linear_conv_kernel_dim 3 (supported: 4)"),
        ({"partial_rotary_factor": 0.15625}, "partial_rotary_factor 0.15625 (supported: a rotary dim,"),
        ({"partial_rotary_factor": 0.15625}, "head_dim * factor = 40 here, that is a multiple of 16)"),
        ({"hidden_size": 8200}, "hidden_size 8200 (supported: multiples of 8 up to 8192)"),
        ({"hidden_size": 5124}, "hidden_size 5124 (supported: multiples of 8 up to 8192)"),
        ({"intermediate_size": 17404}, "intermediate_size 17404 (supported: multiples of 8)"),
    ],
    ids=str,
)
def test_each_size_the_kernels_are_compiled_for_is_checked(change, problem):
    config = dataclasses.replace(shape_config("27b"), **change)
    problems = backends.cuda_config_problems(config)
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_cuda_worker_refuses_before_the_weights_load(demo_model):
    """build_runner (CudaRunner.from_export) checks config.json first. Without the check, this CPU-only machine read the
    demo's weights and then failed moving them to the GPU (a GPU host: loaded them and failed the
    warm-up minutes later)."""
    with pytest.raises(ExportError, match="^config.json: the cuda backend's kernels are compiled for other sizes"):
        backends.build_runner("cuda", demo_model, synthetic=None, seed=0, threads=None)


def test_the_page_states_the_bounds_and_sizes_the_code_applies():
    text = DOC.read_text(encoding="utf-8")
    assert f"| `temperature` | a number from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} (inclusive) |" in text
    assert f"| `head_bias` | a number from -{MAX_ABS_HEAD_BIAS:g} to {MAX_ABS_HEAD_BIAS:g} (inclusive) |" in text
    rows = {
        "head_dim": f"{geometry.ATTN_HEAD_DIM}",
        "linear_key_head_dim": f"{geometry.GDN_HEAD_DIM}",
        "linear_value_head_dim": f"{geometry.GDN_HEAD_DIM}",
        "linear_conv_kernel_dim": f"{geometry.CONV_KERNEL_SIZE}",
        "partial_rotary_factor": "a rotary dim (`head_dim * factor`) that is a multiple of "
        f"{geometry.ROTARY_DIM_MULTIPLE}",
        "hidden_size": f"a multiple of {geometry.VECTOR_ELEMENTS}, at most {geometry.MAX_NORM_WIDTH}",
        "intermediate_size": f"a multiple of {geometry.VECTOR_ELEMENTS}",
    }
    for field, supported in rows.items():
        assert f"| `{field}` | {supported} |" in text, field


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_weights_of_other_float_dtypes_load_converted_and_integers_are_refused(demo_model, tmp_path, dtype):
    import torch
    from safetensors.torch import load_file, save_file

    from openjev.worker.checkpoint.weights import load_tensors

    config = load_model_config(demo_model)
    stored = load_file(demo_model / "model.safetensors")
    export = _export(demo_model, tmp_path / "export")
    (export / "model.safetensors").unlink()
    save_file({name: t.to(getattr(torch, dtype)) for name, t in stored.items()}, export / "model.safetensors")
    if dtype == "int32":
        with pytest.raises(ExportError, match="^model.safetensors: tensor .* has dtype torch.int32$"):
            load_tensors(export, config, torch.float32)
        return
    got, want = load_tensors(export, config, torch.float32), load_tensors(demo_model, config, torch.float32)
    assert got.keys() == want.keys() and all(t.dtype == torch.float32 for t in got.values())
    if dtype != "float16":  # bf16 values are exact in fp32 and fp64; fp16 has fewer exponent bits
        assert all(torch.equal(got[name], want[name]) for name in want)

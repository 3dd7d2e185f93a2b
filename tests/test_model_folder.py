"""The model folder as docs/model-folder.md describes it: the bounds of open_jev_export.json's
temperature and head_bias at their edges (1e308 or 1e-300 and a bias of 3e38 were served, every
answer uniform or saturated; found by a review of 2026-12-04)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openjev.export import MAX_ABS_HEAD_BIAS, MAX_TEMPERATURE, MIN_TEMPERATURE, ExportError, load_export_meta


def _export(demo_model: Path, into: Path, **fields) -> Path:
    """The demo export's small files copied, the weights linked, open_jev_export.json with fields."""
    shutil.copytree(demo_model, into, ignore=shutil.ignore_patterns("model.safetensors", ".*"))
    (into / "model.safetensors").symlink_to(demo_model / "model.safetensors")
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

"""The demo model builder: deterministic from the seed, real export format, atomic, skips an
identical build."""

from __future__ import annotations

import hashlib
import json

import pytest

from openjev.export import load_export_meta
from openjev.tools.demo_model import STAMP_FILE, build_demo_model


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_files_other_seed_differs(model_export, tmp_path):
    again = build_demo_model(tmp_path / "again", seed=0, with_tokenizer=False)
    other = build_demo_model(tmp_path / "other", seed=1, with_tokenizer=False)
    for name in ("model.safetensors", "open_jev_export.json", "config.json"):
        assert digest(again / name) == digest(model_export / name)
    assert digest(other / "model.safetensors") != digest(again / "model.safetensors")
    assert json.loads((other / "open_jev_export.json").read_text())["checkpoint_revision"].find("seed-1") >= 0


def test_identical_build_is_skipped_and_a_different_one_replaces(tmp_path):
    out = tmp_path / "demo"
    build_demo_model(out, seed=3, with_tokenizer=False)
    weights = out / "model.safetensors"
    first_inode = weights.stat().st_ino
    build_demo_model(out, seed=3, with_tokenizer=False)
    assert weights.stat().st_ino == first_inode  # not rewritten
    build_demo_model(out, seed=4, with_tokenizer=False)
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 4
    # Nothing but the build itself is left next to it (temp and stale dirs are cleaned up).
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_export_metadata_is_the_documented_demo(model_export):
    raw = json.loads((model_export / "open_jev_export.json").read_text())
    meta = load_export_meta(model_export)
    assert raw["format"] == "open-jev-text-merged/1"
    assert meta.model_id == "open-jev-demo" and meta.max_length == 16384
    assert meta.temperature == 2.5343690298472983
    assert meta.chat_suffix == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    config = json.loads((model_export / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["vocab_size"] == 248320


def test_default_build_writes_the_tokenizer(tmp_path):
    pytest.importorskip("openjev.tokenizer")
    out = build_demo_model(tmp_path / "demo", seed=0)
    assert (out / "tokenizer.json").stat().st_size > 1_000_000
    load_export_meta(out)

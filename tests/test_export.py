"""Export directory validation: a good export loads; each kind of broken one is refused with a
message naming the file. Uses a tiny synthetic export (the check never loads weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from openjev.export import ExportError, load_export_meta

HIDDEN = 16


def meta_dict(**changes) -> dict:
    meta = {
        "format": "open-jev-text-merged/1",
        "model_id": "judge-test",
        "base_revision": "base-rev",
        "checkpoint_revision": "ckpt-rev",
        "temperature": 2.5,
        "max_length": 4096,
        "chat_prefix": "<|im_start|>user\n",
        "chat_suffix": "<|im_end|>\n<|im_start|>assistant\n",
        "head_weight": np.random.default_rng().standard_normal(HIDDEN).tolist(),
        "head_bias": 0.25,
    }
    meta.update(changes)
    return meta


@pytest.fixture
def export(tmp_path) -> Path:
    d = tmp_path / "export"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {"hidden_size": HIDDEN}}))
    (d / "tokenizer.json").write_text("{}")
    save_file(
        {"model.language_model.embed_tokens.weight": np.ones((4, HIDDEN), np.float32)}, str(d / "model.safetensors")
    )
    (d / "open_jev_export.json").write_text(json.dumps(meta_dict()))
    return d


def rewrite_meta(export: Path, **changes) -> None:
    (export / "open_jev_export.json").write_text(json.dumps(meta_dict(**changes)))


def test_good_export_loads(export):
    # every entry different, so a head read in any other order (reversed, shifted) is not equal
    head = [i / 4 - 2.0 for i in range(HIDDEN)]
    rewrite_meta(export, alias="judge-alias", head_weight=head)
    meta = load_export_meta(export)
    assert meta.model_id == "judge-test" and meta.temperature == 2.5 and meta.max_length == 4096
    assert meta.head_weight == tuple(head) and meta.head_bias == 0.25
    assert meta.accepted_model_names == {"judge-test", "open-jev", "jev-latest", "judge-alias"}
    rewrite_meta(export)
    assert load_export_meta(export).accepted_model_names == {"judge-test", "open-jev", "jev-latest"}


def test_export_check_imports_no_torch():
    """The frontend validates exports too and must not pay for importing torch."""
    import subprocess

    code = "import sys, openjev.export; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "open_jev_export.json"])
def test_missing_file_is_named(export, name):
    (export / name).unlink()
    with pytest.raises(ExportError, match=f"^{name}: missing"):
        load_export_meta(export)


def test_no_safetensors_is_refused(export):
    (export / "model.safetensors").unlink()
    with pytest.raises(ExportError, match=r"\*\.safetensors: no weight files"):
        load_export_meta(export)


def test_truncated_safetensors_is_named(export):
    path = export / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ExportError, match=r"^model\.safetensors: truncated"):
        load_export_meta(export)
    path.write_bytes(b"\x05")
    with pytest.raises(ExportError, match=r"^model\.safetensors: truncated"):
        load_export_meta(export)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "open-jev-text-merged/2"}, "format is 'open-jev-text-merged/2'"),
        ({"head_weight": [0.1] * (HIDDEN - 1)}, f"head_weight has {HIDDEN - 1} entries, expected hidden_size={HIDDEN}"),
        ({"head_weight": [0.1] * (HIDDEN - 1) + [None]}, "head_weight\\[15\\] must be a finite number"),
        ({"max_length": 0}, "max_length must be an integer in 1..16384"),
        ({"max_length": 16385}, "max_length must be an integer in 1..16384"),
        ({"temperature": -1.0}, "temperature must be positive"),
        ({"model_id": ""}, "model_id must be a nonempty string"),
        ({"head_bias": "0.1"}, "head_bias must be a finite number"),
    ],
)
def test_bad_metadata_is_named(export, changes, message):
    rewrite_meta(export, **changes)
    with pytest.raises(ExportError, match=f"^open_jev_export.json: {message}"):
        load_export_meta(export)


def test_unparseable_metadata_is_named(export):
    (export / "open_jev_export.json").write_text("{not json")
    with pytest.raises(ExportError, match="^open_jev_export.json: not readable JSON"):
        load_export_meta(export)

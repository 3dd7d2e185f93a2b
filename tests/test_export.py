"""Export directory validation: a good export loads; each kind of broken one is refused with a
message naming the file. Uses a tiny synthetic export (the check never loads weights)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from openjev.export import ExportError, check_file, check_safetensors_file, load_export_meta
from openjev.tools.demo_model import TEXT_CONFIG
from openjev.worker.checkpoint.config import parse_model_config

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
        # a string of hidden_size characters: without the list check each character is a "weight"
        ({"head_weight": "0" * HIDDEN}, "head_weight must be a list of numbers"),
        ({"chat_prefix": None}, "chat_prefix must be a string, got None"),
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


@pytest.mark.parametrize("name", ["open_jev_export.json", "config.json"])
def test_json_that_is_not_an_object_is_named(export, name):
    (export / name).write_text("[]")
    with pytest.raises(ExportError, match=f"^{name}: top level must be a JSON object"):
        load_export_meta(export)


@pytest.mark.parametrize(
    ("config", "got"),
    [
        ({"model_type": "qwen3_5", "text_config": {"hidden_size": 0}}, "0"),
        ({"model_type": "qwen3_5", "text_config": {"hidden_size": True}}, "True"),
        ({"model_type": "qwen3_5", "text_config": "16"}, "None"),
        ({"model_type": "qwen3_5_text"}, "None"),
    ],
)
def test_bad_hidden_size_is_named(export, config, got):
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=f"^config.json: hidden_size must be a positive integer, got {got}$"):
        load_export_meta(export)


def test_missing_export_directory_is_named(tmp_path):
    with pytest.raises(ExportError, match="nowhere: export directory does not exist$"):
        load_export_meta(tmp_path / "nowhere")


def write_safetensors(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_safetensors_header_over_100_mb_is_refused(export):
    # The file must really be that long (sparse, so nothing is written): a header past the end
    # is refused as truncated before the size limit is looked at.
    header_bytes = 100_000_001
    with (export / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", header_bytes))
        f.truncate(8 + header_bytes)
    with pytest.raises(
        ExportError, match=r"^model\.safetensors: safetensors header of 100000001 bytes \(at most 100 MB\)"
    ):
        load_export_meta(export)


def test_safetensors_header_not_an_object_is_named(export):
    write_safetensors(export / "model.safetensors", b"[]")
    with pytest.raises(ExportError, match=r"^model\.safetensors: safetensors header is not an object"):
        load_export_meta(export)


@pytest.mark.parametrize("offsets", [[4, 0], [-4, 0], [0, 4.0]])
def test_bad_data_offsets_are_named(export, offsets):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}).encode()
    write_safetensors(export / "model.safetensors", header, bytes(4))
    with pytest.raises(ExportError, match=r"^model\.safetensors: tensor 'w' has data_offsets .*start <= end"):
        load_export_meta(export)


def test_unreadable_safetensors_is_named(export):
    (export / "model.safetensors").unlink()
    (export / "model.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(ExportError, match=r"^model\.safetensors: not readable \(\[Errno 2\]"):
        load_export_meta(export)


def test_a_file_of_exactly_the_limit_is_accepted_and_one_byte_more_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b" " * 10)
    check_file(path, 10, "the test's limit")
    path.write_bytes(b" " * 11)
    with pytest.raises(ExportError, match=r"^config\.json: 11 bytes, more than the test's limit \(10\)$"):
        check_file(path, 10, "the test's limit")


def test_an_empty_chat_template_loads(export):
    """chat_prefix and chat_suffix may be empty (a model prompted with the bare text); model ids may not."""
    rewrite_meta(export, chat_prefix="", chat_suffix="")
    meta = load_export_meta(export)
    assert (meta.chat_prefix, meta.chat_suffix) == ("", "")


@pytest.mark.parametrize(("alias", "shown"), [("", "''"), (5, "5"), (["a"], r"\['a'\]")])
def test_a_bad_alias_is_named(export, alias, shown):
    """The alias is a model name the servers answer to: a number or an empty one is refused, not served."""
    rewrite_meta(export, alias=alias)
    with pytest.raises(ExportError, match=rf"^open_jev_export\.json: alias must be a nonempty string, got {shown}$"):
        load_export_meta(export)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # JSON true is an int in Python: each was read as 1 (or 0)
        ({"temperature": True}, "temperature must be a finite number, got True"),
        ({"head_bias": False}, "head_bias must be a finite number within float32's range, got False"),
        (
            {"head_weight": [True] + [0.5] * (HIDDEN - 1)},
            r"head_weight\[0\] must be a finite number within float32's range, got True",
        ),
        ({"max_length": True}, r"max_length must be an integer in 1\.\.16384, got True"),
        ({"max_length": 4096.0}, r"max_length must be an integer in 1\.\.16384, got 4096\.0"),
    ],
    ids=["temperature", "head_bias", "head_weight", "max_length-bool", "max_length-float"],
)
def test_a_number_of_the_wrong_json_type_is_named(export, changes, message):
    rewrite_meta(export, **changes)
    with pytest.raises(ExportError, match=f"^open_jev_export\\.json: {message}$"):
        load_export_meta(export)


def test_a_flat_config_reads_its_own_fields_not_a_stray_text_config(export):
    """Only a nested (`qwen3_5`) config.json keeps its text model under text_config."""
    flat = {**TEXT_CONFIG, "hidden_size": HIDDEN, "text_config": {**TEXT_CONFIG, "hidden_size": 8}}
    (export / "config.json").write_text(json.dumps(flat))
    assert len(load_export_meta(export).head_weight) == HIDDEN
    assert parse_model_config(flat).hidden_size == HIDDEN


def _shard(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_an_empty_tensor_and_a_tensor_ending_at_the_last_byte_are_accepted(tmp_path):
    """Offsets start <= end: an empty tensor ([0, 0]) is valid safetensors; the last tensor ends at
    the data section's end."""
    path = tmp_path / "model.safetensors"
    header = {
        "__metadata__": {"format": "pt"},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    _shard(path, header, bytes(8))
    assert check_safetensors_file(path) == ["empty", "w"]
    _shard(path, header, bytes(7))
    with pytest.raises(
        ExportError, match=r"^model\.safetensors: truncated safetensors file: tensor 'w' ends at byte 8 of a 7-byte"
    ):
        check_safetensors_file(path)


def test_a_shard_of_no_tensors_and_no_data_is_accepted(tmp_path):
    """A header that ends at the end of the file is not truncated."""
    path = tmp_path / "model.safetensors"
    _shard(path, {"__metadata__": {"format": "pt"}}, b"")
    assert check_safetensors_file(path) == []

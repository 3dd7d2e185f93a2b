"""A malformed or hostile export is refused at start by the real programs with one line naming
the file, exit non-zero, no traceback, no hang (a review of 2026-12-02 found each case below
ending in a traceback, a hang or a runaway allocation)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from other_export import copied_export

from openjev.tools import launch

WORKER, FRONTEND = launch.WORKER_MODULE, launch.FRONTEND_MODULE


def _edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(export: Path) -> None:
        document = json.loads((export / name).read_text())
        change(document)
        (export / name).write_text(json.dumps(document))

    return edit


def _text(config: dict) -> dict:
    return config["text_config"]


def _offsets_as_strings(export: Path) -> None:
    data = (export / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [str(o) for o in header[name]["data_offsets"]]
    raw = json.dumps(header).encode()
    (export / "model.safetensors").unlink()
    (export / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


def _nan_weight(export: Path) -> None:
    """One NaN in one projection of the weights (a copy replaces the link)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(export / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("mlp.down_proj.weight"))
    tensors[name][3, 5] = float("nan")
    (export / "model.safetensors").unlink()
    save_file(tensors, export / "model.safetensors")


def _overflowing_weights(export: Path) -> None:
    """Finite weights (so they load) whose first product overflows: every answer non-finite."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(export / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("mlp.down_proj.weight"))
    tensors[name].fill_(3e38)
    (export / "model.safetensors").unlink()
    save_file(tensors, export / "model.safetensors")


def _tokenizer_json(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """tokenizer.json changed by `change` (written as the builder writes it: UTF-8, not ASCII)."""

    def edit(export: Path) -> None:
        document = json.loads((export / "tokenizer.json").read_bytes())
        change(document)
        (export / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")

    return edit


def _extra_tensor(name: str) -> Callable[[Path], None]:
    """A shard beside the weights holding one tensor of that name."""

    def add(export: Path) -> None:
        import torch
        from safetensors.torch import save_file

        save_file({name: torch.zeros(4)}, export / "extra.safetensors")

    return add


def _raw_shard(header: dict) -> Callable[[Path], None]:
    """A shard beside the weights with this safetensors header and no data."""

    def add(export: Path) -> None:
        raw = json.dumps(header).encode()
        (export / "extra.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)

    return add


def _fifo(export: Path) -> None:
    (export / "model.safetensors").unlink()
    os.mkfifo(export / "model.safetensors")


WORD_LEVEL = {"model": {"type": "WordLevel", "vocab": {"yes": 0, "no": 1, "?": 2}, "unk_token": "?"}}

CASES = {
    # name: (how to damage the export, the line expected, the programs that check it)
    "config field missing": (
        _edit_json("config.json", lambda c: _text(c).pop("intermediate_size")),
        "config.json: intermediate_size must be a positive integer",
        (WORKER,),
    ),
    "layer kinds not the weights'": (
        _edit_json("config.json", lambda c: _text(c)["layer_types"].reverse()),
        "is not used by config.json (layer 0 is full_attention)",
        (WORKER,),
    ),
    "infinite norm epsilon": (
        _edit_json("config.json", lambda c: _text(c).update(rms_norm_eps=float("inf"))),
        "config.json: rms_norm_eps must be a positive finite number",
        (WORKER,),
    ),
    "a norm epsilon that flattens every norm": (
        _edit_json("config.json", lambda c: _text(c).update(rms_norm_eps=1e30)),
        "config.json: rms_norm_eps must be at most 0.1, got 1e+30",
        (WORKER,),
    ),
    "a rotary base below 1": (
        _edit_json("config.json", lambda c: _text(c)["rope_parameters"].update(rope_theta=1e-300)),
        "config.json: rope_theta must be at least 1 (the rotary base; Qwen3.5 uses 1e7), got 1e-300",
        (WORKER,),
    ),
    "attention biases as a string": (
        _edit_json("config.json", lambda c: _text(c).update(attention_bias="false")),
        "config.json: attention_bias must be false (biases are not supported), got 'false'",
        (WORKER,),
    ),
    "a vocabulary smaller than the tokenizer's": (
        _edit_json("config.json", lambda c: _text(c).update(vocab_size=1000)),
        "config.json's vocab_size 1000 is smaller than tokenizer.json's",
        (WORKER,),
    ),
    "attention interval 0": (
        _edit_json("config.json", lambda c: [_text(c).pop("layer_types"), _text(c).update(full_attention_interval=0)]),
        "config.json: full_attention_interval must be a positive integer",
        (WORKER,),
    ),
    "a head dimension of 401 digits": (
        _edit_json("config.json", lambda c: _text(c).update(head_dim=10**400)),
        "config.json: head_dim must be below 2**31, got 1000",
        (WORKER,),
    ),
    "a billion layers": (
        _edit_json("config.json", lambda c: [_text(c).pop("layer_types"), _text(c).update(num_hidden_layers=10**9)]),
        "config.json: num_hidden_layers=1000000000 is more than",
        (WORKER,),
    ),
    "temperature past float": (
        _edit_json("open_jev_export.json", lambda m: m.update(temperature=10**400)),
        "open_jev_export.json: temperature must be a finite number",
        (WORKER, FRONTEND),
    ),
    "a temperature that makes every answer uniform": (
        _edit_json("open_jev_export.json", lambda m: m.update(temperature=1e308)),
        "open_jev_export.json: temperature must be between 0.001 and 1000 (a calibrated head's is near 1), got 1e+308",
        (WORKER, FRONTEND),
    ),
    "a temperature that saturates every answer": (
        _edit_json("open_jev_export.json", lambda m: m.update(temperature=1e-300)),
        "open_jev_export.json: temperature must be between 0.001 and 1000 (a calibrated head's is near 1), got 1e-300",
        (WORKER, FRONTEND),
    ),
    "deeply nested config": (
        lambda e: (e / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "config.json: not readable JSON (RecursionError)",
        (WORKER, FRONTEND),
    ),
    "offsets that are strings": (
        _offsets_as_strings,
        "has data_offsets ['0',",
        (WORKER, FRONTEND),
    ),
    "weights a FIFO": (_fifo, "model.safetensors: not a regular file", (WORKER, FRONTEND)),
    "a NaN weight": (_nan_weight, "mlp.down_proj.weight has NaN or infinite values", (WORKER,)),
    "weights that load but overflow": (
        _overflowing_weights,
        "openjev-worker: the warm-up request failed: non-finite head score",
        (WORKER,),
    ),
    "tokenizer truncated": (
        lambda e: (e / "tokenizer.json").write_text((e / "tokenizer.json").read_text()[:1000]),
        "tokenizer.json: not a usable tokenizer",
        (WORKER, FRONTEND),
    ),
    "a head weight past float32": (
        _edit_json("open_jev_export.json", lambda m: m["head_weight"].__setitem__(0, 1e300)),
        "open_jev_export.json: head_weight[0] must be a finite number within float32's range, got 1e+300",
        (WORKER, FRONTEND),
    ),
    "a head bias past float32": (
        _edit_json("open_jev_export.json", lambda m: m.update(head_bias=1e39)),
        "open_jev_export.json: head_bias must be a finite number within float32's range, got 1e+39",
        (WORKER, FRONTEND),
    ),
    "a head bias that saturates every noul answer": (
        _edit_json("open_jev_export.json", lambda m: m.update(head_bias=-3e38)),
        "open_jev_export.json: head_bias must be within -10000..10000 (past it every noul answer is 0 or 1), "
        "got -3e+38",
        (WORKER, FRONTEND),
    ),
    "an end token the tokenizer does not have there": (
        _edit_json("config.json", lambda c: _text(c).update(eos_token_id=248045)),
        "config.json's eos_token_id 248045 is '<|im_start|>' in tokenizer.json, not one of <|im_end|>, "
        "<|endoftext|>: the tokenizer is not this model's",
        (WORKER,),
    ),
    "an end token not the tokenizer's, and weights that would be refused later": (
        lambda e: [_nan_weight(e), _edit_json("config.json", lambda c: _text(c).update(eos_token_id=248045))(e)],
        "the tokenizer is not this model's",  # config.json against tokenizer.json before the weights load
        (WORKER,),
    ),
    "an end token only at the top level, not the tokenizer's": (
        _edit_json("config.json", lambda c: [_text(c).pop("eos_token_id"), c.update(eos_token_id=248045)]),
        "config.json's eos_token_id 248045 is '<|im_start|>' in tokenizer.json",  # text_config's was the only one read
        (WORKER,),
    ),
    "a word-level tokenizer of three tokens, no end token to compare": (
        lambda e: [
            _edit_json("config.json", lambda c: _text(c).pop("eos_token_id"))(e),
            (e / "tokenizer.json").write_text(json.dumps(WORD_LEVEL)),
        ],
        "tokenizer.json: <|im_start|>, in the chat template of open_jev_export.json, is not one of its added tokens",
        (WORKER,),
    ),
    "another model type": (
        _edit_json("config.json", lambda c: c.update(model_type="llama")),
        "config.json: model_type is 'llama', expected one of ('qwen3_5', 'qwen3_5_text')",
        (WORKER, FRONTEND),
    ),
    "a config of gigabytes": (
        lambda e: [(e / "config.json").unlink(), (e / "config.json").write_bytes(b" " * (17 << 20) + b"{}")],
        "config.json: 17825794 bytes, more than an export's JSON files may have (16777216)",
        (WORKER, FRONTEND),
    ),
    "a tokenizer of hundreds of MB": (
        lambda e: [(e / "tokenizer.json").unlink(), (e / "tokenizer.json").write_bytes(b" " * (65 << 20))],
        "tokenizer.json: 68157440 bytes, more than a tokenizer may have (67108864)",
        (WORKER, FRONTEND),
    ),
    "a token id past the tokenizer's count": (
        _tokenizer_json(lambda t: t["model"]["vocab"].update(a=300000)),
        "tokenizer.json: token 'a' has id 300000; the ids of its 248077 tokens must be exactly 0..248076 (no gap)",
        (WORKER,),
    ),
    "two tokens of one id": (
        _tokenizer_json(lambda t: t["model"]["vocab"].update(b=t["model"]["vocab"]["a"])),
        "tokenizer.json: id 64 is given to both 'a' and 'b'",
        (WORKER,),
    ),
    "BPE dropout, which tokenizes at random": (
        _tokenizer_json(lambda t: t["model"].update(dropout=0.5)),
        "tokenizer.json: model.dropout is 0.5; it must be null (tokenizing is exact)",
        (WORKER, FRONTEND),
    ),
    "a layer index that is a superscript digit": (
        _extra_tensor("model.language_model.layers.\u00b2.input_layernorm.weight"),
        "is not used by config.json (num_hidden_layers is 8)",
        (WORKER,),
    ),
    "a layer index of 5,000 digits": (
        _extra_tensor("model.language_model.layers." + "9" * 5000 + ".input_layernorm.weight"),
        "is not used by config.json (num_hidden_layers is 8)",
        (WORKER,),
    ),
    "a tensor name with a line feed": (
        _extra_tensor("model.language_model.layers.99.input_layernorm.weight\nopenjev-worker: SERVING"),
        "input_layernorm.weight\\nopenjev-worker: SERVING' is not used by config.json",
        (WORKER,),
    ),
    "tokenizer a FIFO": (
        lambda e: [(e / "tokenizer.json").unlink(), os.mkfifo(e / "tokenizer.json")],
        "tokenizer.json: not a regular file",
        (WORKER, FRONTEND),
    ),
    "metadata a FIFO": (
        lambda e: [(e / "open_jev_export.json").unlink(), os.mkfifo(e / "open_jev_export.json")],
        "open_jev_export.json: not a regular file",
        (WORKER, FRONTEND),
    ),
    "config a symbolic link to itself": (
        lambda e: [(e / "config.json").unlink(), (e / "config.json").symlink_to("config.json")],
        "config.json: a symbolic link to no file (dangling, or a loop)",
        (WORKER, FRONTEND),
    ),
    "tokenizer a dangling symbolic link": (
        lambda e: [(e / "tokenizer.json").unlink(), (e / "tokenizer.json").symlink_to("gone.json")],
        "tokenizer.json: a symbolic link to no file (dangling, or a loop)",
        (WORKER, FRONTEND),
    ),
    "a tensor name with a line feed and no offsets": (
        _raw_shard({"w\nopenjev-worker: SERVING": {"dtype": "F32", "shape": [1]}}),
        "extra.safetensors: tensor 'w\\nopenjev-worker: SERVING' has no data_offsets",
        (WORKER, FRONTEND),
    ),
    "a stale shard beside the weights": (
        lambda e: shutil.copyfile(e / "model.safetensors", e / "zz-old.safetensors"),
        "' is also in model.safetensors",
        (WORKER,),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_export_is_refused_in_one_line(demo_model, tmp_path, case):
    damage, line, programs = CASES[case]
    export = copied_export(demo_model, tmp_path / "export")
    damage(export)
    for module in programs:
        args = ["--model", str(export), "--listen", "127.0.0.1:0", "--plaintext"]
        if module == FRONTEND:
            args += ["--worker", "127.0.0.1:1"]
        out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0, (module, out.stderr[-2000:])
        assert line in out.stderr and "Traceback" not in out.stderr, (module, out.stderr[-2000:])


def _without_root_reads() -> list[str]:
    """The command prefix under which a mode's read bits bind this process: as root, setpriv
    drops the capabilities that bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "running as root: setpriv (util-linux) is needed to drop the read-bypass capabilities"
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("mode", [0o000, 0o111], ids=["mode-000", "mode-0111"])
def test_an_export_the_process_may_not_read_is_refused_in_one_line(demo_model, tmp_path, mode):
    """Mode 000 raised PermissionError (a traceback); 0111 (enter, not list) reported "no weight
    files" where the files are there."""
    export = copied_export(demo_model, tmp_path / "export")
    export.chmod(mode)
    try:
        for module in (WORKER, FRONTEND):
            args = ["--model", str(export), "--listen", "127.0.0.1:0", "--plaintext"]
            if module == FRONTEND:
                args += ["--worker", "127.0.0.1:1"]
            command = [*_without_root_reads(), sys.executable, "-m", module, *args]
            out = subprocess.run(command, capture_output=True, text=True, timeout=60)
            assert out.returncode != 0, (module, out.stderr[-2000:])
            assert "cannot read the export: [Errno 13] Permission denied" in out.stderr, (module, out.stderr[-2000:])
            assert "Traceback" not in out.stderr, (module, out.stderr[-2000:])
    finally:
        export.chmod(0o755)

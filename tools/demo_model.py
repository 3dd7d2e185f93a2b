"""The embedded demo model: a small Qwen3.5-shaped backbone with seeded random weights, written in
the real export format (nested config.json, bf16 safetensors under `model.language_model.`,
tokenizer.json, open_jev_export.json). Its answers are meaningless; every mechanism is real.

    python -m openjev.tools.demo_model --out .openjev/demo-model [--seed 0]

An existing --out folder is replaced only when it is empty or an earlier demo build (it holds
the build's stamp file); any other folder is left alone and the build exits 1 naming it. A build
of the same seed is kept while each file the stamp lists is there at its size; one missing or
cut short is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from openjev import progress
from openjev.tools.stop_signals import exit_on_stop_signals, stops_deferred

# Bump when the weights or files a given seed produces change: a stale build is then rebuilt.
BUILDER_VERSION = 2
STAMP_FILE = ".demo_build.json"
TENSOR_PREFIX = "model.language_model."
WEIGHTS_FILE = "model.safetensors"

NUM_LINEAR_THEN_FULL = (["linear_attention"] * 3 + ["full_attention"]) * 2
TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,  # the real Qwen3.5 vocabulary size, so real token ids work
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": len(NUM_LINEAR_THEN_FULL),
    "layer_types": NUM_LINEAR_THEN_FULL,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    # 1-D text positions: the three mrope sections see the same position, i.e. plain rotary.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "eos_token_id": 248046,
}
EXPORT_META = {
    "format": "open-jev-text-merged/1",
    "model_id": "open-jev-demo",
    "temperature": 2.5343690298472983,
    "max_length": 16384,
    "chat_prefix": "<|im_start|>user\n",
    "chat_suffix": "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
}


def _random_tensors(seed: int) -> tuple[dict, list[float], float]:
    """(tensors by unprefixed name as fp32, head_weight, head_bias), all from one generator.
    Scales keep the residual stream O(1) and let the mixers move it visibly, so candidates that
    share the chat suffix still get different last-token states and spread-out scores."""
    import torch

    from openjev.worker.checkpoint.config import parse_model_config
    from openjev.worker.checkpoint.weights import expected_shapes

    config = parse_model_config(TEXT_CONFIG)
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    def uniform(shape, low, high):
        return torch.rand(shape, generator=gen) * (high - low) + low

    tensors = {}
    for name, shape in progress.track(list(expected_shapes(config).items()), "demo model: random weights"):
        fan_in = shape[-1]
        if name == "embed_tokens.weight":
            t = normal(shape, 1.0)
        elif name.endswith("A_log"):
            # Decay rates e^{A_log} in [0.05, 1]: with dt_bias below, memories of ~10-1000 tokens.
            t = uniform(shape, 0.05, 1.0).log()
        elif name.endswith("dt_bias"):
            t = uniform(shape, -4.0, -1.0)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + normal(shape, 0.1)  # applied as w: centred on 1
        elif name.endswith("norm.weight"):
            t = normal(shape, 0.1)  # zero-centred RMSNorm, applied as 1 + w
        elif name.endswith("conv1d.weight"):
            t = normal(shape, fan_in**-0.5)
        elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t = normal(shape, 0.7 * fan_in**-0.5)
        else:
            t = normal(shape, fan_in**-0.5)
        tensors[name] = t
    head_weight = (normal((config.hidden_size,), 3.0 * config.hidden_size**-0.5)).tolist()
    head_bias = float(normal((), 0.5))
    return tensors, head_weight, head_bias


def _stamp(seed: int, with_tokenizer: bool) -> dict:
    return {"seed": seed, "builder_version": BUILDER_VERSION, "tokenizer": with_tokenizer}


def _is_current(out_dir: Path, stamp: dict) -> bool:
    """The same build, each of its files still there at the size it was written with."""
    try:
        found = json.loads((out_dir / STAMP_FILE).read_text())
        files = found.pop("files")
        return found == stamp and all((out_dir / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write(tmp: Path, seed: int, with_tokenizer: bool) -> None:
    import torch
    from safetensors.torch import save_file

    tensors, head_weight, head_bias = _random_tensors(seed)
    bf16 = {TENSOR_PREFIX + name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}
    save_file(bf16, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": TEXT_CONFIG,
        "tie_word_embeddings": False,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    revision = f"demo-seed-{seed}-builder-{BUILDER_VERSION}"
    meta = {
        **EXPORT_META,
        "base_revision": f"{revision} (random weights, no base model)",
        "checkpoint_revision": revision,
        "head_weight": head_weight,
        "head_bias": head_bias,
    }
    assert all(math.isfinite(w) for w in head_weight)
    (tmp / "open_jev_export.json").write_text(json.dumps(meta, indent=1) + "\n")
    if with_tokenizer:
        from openjev.tokenizer import write_tokenizer_json

        write_tokenizer_json(tmp / "tokenizer.json")
    for path in tmp.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; the export is read by other users' services


class NotADemoBuild(Exception):
    """out_dir holds something other than a demo build: it is never replaced."""


def _check_replaceable(out_dir: Path) -> None:
    """A build replaces only an empty folder or an earlier build (one with the stamp file): --out
    pointed at a user's folder would otherwise rename it away and delete it."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        what = "a symbolic link" if out_dir.is_symlink() else "not a folder"
        raise NotADemoBuild(f"{out_dir} is {what}; not replacing it with the demo model")
    if (out_dir / STAMP_FILE).is_file() or not any(out_dir.iterdir()):
        return
    raise NotADemoBuild(
        f"{out_dir} is not empty and holds no demo build ({STAMP_FILE}); not replacing it: "
        "choose an empty or new folder"
    )


def _swap(tmp: Path, out_dir: Path, stamp: dict) -> None:
    stale = None
    if out_dir.exists():
        _check_replaceable(out_dir)  # again: the build took seconds, the folder may have changed
        # Move the stale build aside first: a rename cannot replace a nonempty directory.
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, stale / "old")
    try:
        os.replace(tmp, out_dir)
    except OSError:
        # Another process finished the same build between our check and our rename.
        if not _is_current(out_dir, stamp):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)


def build_demo_model(out_dir: str | Path, seed: int = 0, *, with_tokenizer: bool = True) -> Path:
    """Build the demo export into out_dir (atomically; skipped when an identical build is there).
    with_tokenizer=False leaves tokenizer.json out (model-only tests; not a loadable export).
    An existing out_dir is replaced only when empty or an earlier build, else NotADemoBuild."""
    out_dir = Path(out_dir)
    stamp = _stamp(seed, with_tokenizer)
    if _is_current(out_dir, stamp):
        return out_dir
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with stops_deferred():  # a stop (main's SIGTERM/SIGHUP exit) waits until the except below knows tmp
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        _write(tmp, seed, with_tokenizer)
        files = {path.name: path.stat().st_size for path in tmp.iterdir()}
        (tmp / STAMP_FILE).write_text(json.dumps({**stamp, "files": files}) + "\n")
        os.chmod(tmp, 0o755)
        # A stop waits for the swap's end: between its renames it would leave the old build beside
        # --out (~65 MB), or no build at all.
        with stops_deferred():
            _swap(tmp, out_dir, stamp)
    except BaseException:
        with stops_deferred():  # a second stop must not cut the removal short
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # the build's half-written temporary folder beside --out is removed (it left ~65 MB there)
    exit_on_stop_signals()
    try:
        print(build_demo_model(args.out, args.seed))
    except NotADemoBuild as error:
        raise SystemExit(f"demo_model: {error}") from None


if __name__ == "__main__":
    main()

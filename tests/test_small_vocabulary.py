"""A model of fewer token ids than the worker's warm-up request once used (ids 1-5) starts. The
least a model can have is 5 (a word, the chat template's 4 specials); such a worker failed its
warm-up with "token id 5 outside the vocabulary (size 5)", naming no file (a model-folder review)."""

from __future__ import annotations

import json
from pathlib import Path

from other_export import copied_export

from openjev.tools import launch

# the least a model can have: one word (also the unknown token), then the chat template's
# specials as added tokens, the last eos (a Qwen3.5 end token)
WORDS = ("?", "<think>", "</think>", "<|im_start|>", "<|im_end|>")


def _small_export(demo_model: Path, into: Path) -> Path:
    from safetensors.torch import load_file, save_file

    copied_export(demo_model, into)
    tensors = load_file(demo_model / "model.safetensors")
    embed = "model.language_model.embed_tokens.weight"
    tensors[embed] = tensors[embed][: len(WORDS)].clone()
    (into / "model.safetensors").unlink()  # a link to the demo's weights
    save_file(tensors, into / "model.safetensors")
    config = json.loads((into / "config.json").read_text())
    config["text_config"].update(vocab_size=len(WORDS), eos_token_id=len(WORDS) - 1)
    (into / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((into / "tokenizer.json").read_bytes())
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    tokenizer.update(
        added_tokens=[{"id": i, "content": w, **special} for i, w in enumerate(WORDS) if i],
        normalizer=None,
        pre_tokenizer={"type": "Whitespace"},
        post_processor=None,
        decoder=None,
        model={"type": "WordLevel", "vocab": {"?": 0}, "unk_token": "?"},
    )
    (into / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    return into


def test_a_worker_of_five_token_ids_starts_serving(demo_model, tmp_path):
    export = _small_export(demo_model, tmp_path / "export")
    worker = launch.start_worker(export, tmp_path)  # raises unless health says SERVING
    assert worker.stop() == 0, worker.log_text()[-2000:]

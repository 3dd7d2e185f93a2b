"""TorchRunner against transformers' Qwen3_5TextModel on the same demo export (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from export_head import reference_head_score

from openjev.worker.runner_api import SegmentRun

VOCAB = 248320
TOLERANCE = 1e-4
# One score of the seed-0 demo export, pinned: the oracle test below derives its expected score
# from the export's files, this one pins the export and the whole path from the ids to the score
# (the demo builder, the weights' load, the backbone, the head). Regenerate it (and say why in the
# commit) only when the demo builder's recipe changes on purpose.
GOLDEN_IDS = [(1000 + 7919 * i) % VOCAB for i in range(48)]
GOLDEN_SCORE = 9.318274


def random_ids(length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,)).tolist()


def whole(ids: list[int]) -> SegmentRun:
    return SegmentRun(token_ids=ids, start_position=0, parent_state=None, keep_state=False, read_head=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("length", [1, 7, 64, 130])
def test_last_hidden_and_score_match_transformers(runner, oracle_last_hidden, model_export, length):
    ids = random_ids(length)
    want = oracle_last_hidden(ids)
    hidden, _ = runner.final_hidden([whole(ids)])
    assert hidden.shape == (1, runner.config.hidden_size)
    assert rel_err(hidden[0], want) < TOLERANCE

    [result] = runner.run_launch([whole(ids)])
    # the head as the export on disk holds it, not as the runner loaded it
    want_score = reference_head_score(model_export, want)
    assert result.state is None
    assert abs(result.head_score - want_score) <= TOLERANCE * max(1.0, abs(want_score))


def test_packed_launch_of_different_lengths_matches_transformers(runner, oracle_last_hidden):
    prompts = [random_ids(n) for n in (5, 70, 1, 33, 129)]
    hidden, _ = runner.final_hidden([whole(ids) for ids in prompts])
    for row, ids in zip(hidden, prompts, strict=True):
        assert rel_err(row, oracle_last_hidden(ids)) < TOLERANCE


def test_scores_differ_across_prompts(runner):
    """The demo head must spread: identical scores would hide a head that ignores its input."""
    results = runner.run_launch([whole(random_ids(20)) for _ in range(4)])
    scores = [r.head_score for r in results]
    assert max(scores) - min(scores) > 0.1


def test_golden_demo_score(runner, oracle_last_hidden, model_export):
    """The served score, and transformers' hidden state through the export's head, equal the pinned value."""
    [result] = runner.run_launch([whole(GOLDEN_IDS)])
    from_oracle = reference_head_score(model_export, oracle_last_hidden(GOLDEN_IDS))
    for score in (result.head_score, from_oracle):
        assert abs(score - GOLDEN_SCORE) <= TOLERANCE * abs(GOLDEN_SCORE), (score, GOLDEN_SCORE)


@pytest.mark.parametrize("taps", [1, 2])
def test_conv_kernels_other_than_four_match_transformers(model_export, tmp_path, taps):
    """config.json may give any positive linear_conv_kernel_dim (the torch backend runs it; the
    cuda backend refuses all but 4). With 1 a window of K-1 = 0 inputs was sliced as [-0:], all of
    them: every request failed and the worker did not start."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from openjev.worker.model.runner import TorchRunner

    export = tmp_path / "export"
    export.mkdir()
    for name in ("open_jev_export.json", "tokenizer.json"):
        (export / name).write_bytes((model_export / name).read_bytes())
    config = json.loads((model_export / "config.json").read_text())
    config["text_config"]["linear_conv_kernel_dim"] = taps
    (export / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_export / "model.safetensors")
    tensors = {n: t[..., -taps:].contiguous() if n.endswith("conv1d.weight") else t for n, t in tensors.items()}
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})

    oracle = Qwen3_5TextModel(Qwen3_5TextConfig(**config["text_config"])).float().eval()
    oracle.load_state_dict({n.removeprefix("model.language_model."): t.float() for n, t in tensors.items()})
    ids = random_ids(9)
    with torch.no_grad():
        want = oracle(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    runner = TorchRunner(export, num_threads=2)
    hidden, _ = runner.final_hidden([whole(ids)])
    assert rel_err(hidden[0], want) < TOLERANCE
    # the same prompt as a chain of segments, each continuing the one before's kept state
    state = None
    for start, end in ((0, 1), (1, 3), (3, 9)):
        run = SegmentRun(ids[start:end], start, state, keep_state=True, read_head=end == 9)
        [result] = runner.run_launch([run])
        state = result.state
    [alone] = runner.run_launch([whole(ids)])
    assert abs(result.head_score - alone.head_score) <= TOLERANCE * max(1.0, abs(alone.head_score))

"""CudaRunner against the torch reference backbone (fp32, CPU, same weights), per segment,
across tree splits: a child launched from its parent's state must match its whole prompt run
alone. Skipped without a GPU."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
TOL = 3e-2  # bf16 weights and activations through 4 layers vs an fp32 reference


@pytest.fixture(scope="module", params=["serial", "chunked", "split"])
def runner(request):  # split: the chunked kernel from position 128, which the prompts here cross
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from openjev.worker.cuda.runner import CudaRunner

    return CudaRunner.synthetic("small", seed=0, gdn_kernel=request.param, gdn_split_at=128)


def _cpu32(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", torch.float32)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _cpu32(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, tuple):
        return tuple(_cpu32(x) for x in obj)
    return obj


def reference_hidden(runner, weights, tokens):
    from openjev.worker.model.backbone import forward, pack

    with torch.inference_mode():
        hidden, _ = forward(weights, runner.config, pack([tokens], [0], [None], [True]))
    return hidden[0]


def test_runner_matches_reference_across_tree_splits(runner):
    from openjev.worker.model import ops
    from openjev.worker.runner_api import SegmentRun

    rng = random.Random(0)
    vocab = runner.config.vocab_size
    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    weights = _cpu32(runner.reference_weights())
    head_w = runner.head_weight.float().cpu()

    root = toks(150)
    r1 = runner.run_launch([SegmentRun(root, 0, None, keep_state=True, read_head=True)])
    tails = [toks(40), toks(1), toks(70)]
    r2 = runner.run_launch(
        [SegmentRun(t, 150, r1[0].state, keep_state=(i == 0), read_head=True) for i, t in enumerate(tails)]
    )
    grand, fresh = toks(20), toks(90)
    r3 = runner.run_launch(
        [
            SegmentRun(grand, 190, r2[0].state, keep_state=False, read_head=True),
            SegmentRun(fresh, 0, None, keep_state=False, read_head=True),
        ]
    )
    cases = [
        (root, r1[0]),
        *[(root + t, r) for t, r in zip(tails, r2, strict=True)],
        (root + tails[0] + grand, r3[0]),
        (fresh, r3[1]),
    ]
    assert r2[1].state is None and r2[0].state is not None
    for i, (prompt, result) in enumerate(cases):
        expected = reference_hidden(runner, weights, prompt)
        exp_score = ops.head_score(expected, head_w, runner.head_bias)
        # the runner's head row, recomputed through final_hidden for the hidden-state check
        assert result.head_score is not None and torch.isfinite(torch.tensor(result.head_score))
        scale = (expected.double().abs() @ head_w.double().abs()).item()
        assert abs(result.head_score - exp_score) <= TOL * scale, (i, result.head_score, exp_score)


def test_runner_hidden_rows(runner):
    """The head rows' hidden states themselves, relative error per segment."""
    from openjev.worker.runner_api import SegmentRun

    rng = random.Random(1)
    vocab = runner.config.vocab_size
    weights = _cpu32(runner.reference_weights())
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 64, 129)]
    hidden, _ = runner.final_hidden([SegmentRun(p, 0, None, False, True) for p in prompts])
    for i, p in enumerate(prompts):
        expected = reference_hidden(runner, weights, p)
        err = ((hidden[i].float().cpu() - expected).norm() / expected.norm()).item()
        assert err < TOL, (i, err)

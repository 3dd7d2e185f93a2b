"""The bounded CUDA graph cache: replays match eager runs with changed inputs, also after the
entry was evicted and captured again. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_graph_cache_evicts_and_replays(K):
    from openjev.worker.cuda.graphs import GraphCache

    D, inter = 256, 512
    w_gu = (torch.randn(2 * inter, D, device="cuda") / D**0.5).bfloat16()
    w_n = (torch.randn(D, device="cuda") * 0.1).bfloat16()

    def fn(x):
        # a cuBLAS product through torch and two CuPy kernels, on one stream
        normed, _ = K.add_rms_norm(x.clone(), w_n, 1e-6)
        return K.silu_mul(torch.nn.functional.linear(normed, w_gu))

    cache = GraphCache(capacity=2)

    def run(key, x):  # the launcher's use: capture on a miss, else copy the inputs in; replay
        entry = cache.get(key)
        if entry is None:
            entry = cache.capture(key, fn, {"x": x.clone()})
        else:
            entry.inputs["x"].copy_(x)
        return cache.replay(entry)

    for tokens in (16, 32, 64, 16, 32, 16):  # 64 evicts 16, the second 16 evicts 32 ...
        x = torch.randn(tokens, D, device="cuda").bfloat16()  # fresh inputs every call
        got = run(("mlp", tokens), x).clone()
        torch.cuda.synchronize()
        expected = fn(x)
        assert not torch.isnan(got).any()
        err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < 1e-6, (tokens, err)  # same kernels, same inputs: identical up to nothing
        assert len(cache) <= 2
    assert cache.num_captures == 5 and cache.num_replays == 6

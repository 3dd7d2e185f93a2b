"""The K-split product (worker/cuda/gemm.py split_linear) on the 27B MLP down shape, whose plain
cuBLAS products split K by row count: close to a float64 reference, and, where the start-up probe
(split_from) takes it, every row's bits equal at row counts and offsets the probe never tried.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DOWN = (5120, 17408)  # 27B: hidden x intermediate


@pytest.fixture(scope="module")
def down(K):  # K: the kernels module (conftest), which skips without CuPy or a GPU
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(*DOWN, device="cuda", generator=gen) * DOWN[1] ** -0.5).bfloat16()
    x = torch.randn(1500, DOWN[1], device="cuda", generator=gen).bfloat16()
    return x, w


@pytest.mark.parametrize("parts", [2, 4])
def test_split_product_matches_reference(down, parts):
    from openjev.worker.cuda import gemm

    x, w = down
    out = gemm.split_linear(x[:77], w, parts)
    ref = x[:77].double() @ w.double().T
    assert out.dtype == torch.bfloat16 and out.shape == (77, DOWN[0])
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_probed_split_keeps_row_bits_at_unprobed_counts(down):
    from openjev.worker.cuda import gemm

    x, w = down
    parts = gemm.split_from(w)
    if parts == 1:
        pytest.skip("this card's cuBLAS splits the slices too: the runner pads instead (logged)")
    full = gemm.split_linear(x, w, parts)
    for m, offset in [(5, 0), (75, 3), (333, 100), (517, 7), (1001, 250)]:
        assert torch.equal(gemm.split_linear(x[offset : offset + m], w, parts), full[offset : offset + m]), (m, offset)

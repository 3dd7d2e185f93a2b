"""cuBLASLt with an unsplit algorithm (cublaslt.py): on the card, the MLP down product's rows get
the bits cuBLAS gives them in a long (unsplit) product at every row count below the padding
threshold, and the product is right. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

N, K = 5120, 17408  # the 27B MLP down weight, which cuBLAS splits below ~352 rows


@pytest.fixture(scope="module")
def down():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(3)
    return (torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).bfloat16()


def test_unsplit_rows_keep_the_long_products_bits(down):
    from openjev.worker.cuda import cublaslt

    lt = cublaslt.UnsplitLinear(N, K)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, K, device="cuda", generator=gen).bfloat16()
    full = F.linear(x, down)
    for m in (1, 2, 17, 64, 81, 96, 128, 200, 255, 320, 351):
        assert lt.candidates(m), f"no unsplit algorithm at {m} rows"
        for a in lt.candidates(m):
            assert torch.equal(lt(x[:m], down, a), full[:m]), m
    x = torch.randn(96, K, device="cuda").bfloat16()
    exact = x.double() @ down.double().T
    assert ((lt(x, down).double() - exact).norm() / exact.norm()).item() < 1e-2


def test_unsplit_rejects_other_shapes(down):
    from openjev.worker.cuda import cublaslt

    lt = cublaslt.UnsplitLinear(N, K)
    with pytest.raises(ValueError):
        lt(torch.randn(8, K - 64, device="cuda").bfloat16(), down[:, : K - 64].contiguous())
    with pytest.raises(ValueError):
        lt(torch.randn(8, K, device="cuda"), down)


def test_lt_plan_keeps_the_padded_bits(down):
    """Whatever lt_plan picks per row count (by timing; possibly nothing), gemm.linear gives the
    padded product's bits at every row count; it picks only among the row counts it was given."""
    from openjev.worker.cuda import gemm

    pad, rows = gemm.invariant_from(down), [5, 80, 96, 128, 160, 256, 320]
    lt = gemm.lt_plan([down], {(N, K): pad}, {(N, K): 0}, rows).get((N, K))
    assert lt is None or lt.rows <= set(rows)
    for m in rows:
        x = torch.randn(m, K, device="cuda").bfloat16()
        assert torch.equal(gemm.linear(x, down, pad, 0, lt), gemm.linear(x, down, pad)), m


def test_linear_routes_rows_through_lt(down):
    """gemm.linear through an UnsplitLinear at its rows gives the padded product's bits."""
    from openjev.worker.cuda import cublaslt, gemm

    lt, pad = cublaslt.UnsplitLinear(N, K), gemm.invariant_from(down)
    for m in (5, 81, pad - 1):
        lt.chosen[m] = lt.candidates(m)[0]
    for m in (5, 81, pad - 1):
        x = torch.randn(m, K, device="cuda").bfloat16()
        assert torch.equal(gemm.linear(x, down, pad, 0, lt), gemm.linear(x, down, pad)), m
    assert torch.equal(F.linear(x, down)[:0], gemm.linear(x[:0], down, pad, 0, lt))

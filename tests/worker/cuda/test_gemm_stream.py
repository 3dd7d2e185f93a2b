"""gemm_stream (cuda/gemm_stream.cu): every variant against a float64 reference on fresh random
inputs, outputs NaN-poisoned first; and batch invariance: a row's bits equal across every row
count 1..256, every row offset tried and every variant. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def G(K):  # K: the kernels module (conftest), which skips without CuPy or a GPU
    from openjev.worker.cuda import gemm_stream

    return gemm_stream


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(torch.bfloat16)


def rel(out, ref):
    assert not torch.isnan(out).any(), "NaN: an output element was not written"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# (N, K): N not a multiple of any tile width (tail tiles), K of one and of many k-tiles
SHAPES = [(520, 256), (520, 1024), (1032, 2304)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_variant_matches_reference(G, n, k):
    gen = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    for code, v in G.VARIANTS.items():
        if k % v.block_k:
            continue
        for m in (1, 5, 16, 33, 80, 129, 256):
            x, w = rand(m, k, gen=gen), rand(n, k, gen=gen, scale=k**-0.5)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            G.linear(x, w, code=code, out=out)
            err = rel(out, x.double() @ w.double().T)
            assert err < BF16_TOL, f"variant {code}, M={m}, N={n}, K={k}: rel err {err:.2e}"


def test_strided_rows(G):
    """x as a column slice of a wider tensor (the runner's fused projections are sliced)."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    wide, w = rand(40, 1024 + 256, gen=gen), rand(264, 1024, gen=gen, scale=1024**-0.5)
    x = wide[:, 256:]
    assert not x.is_contiguous()
    torch.testing.assert_close(G.linear(x, w), G.linear(x.contiguous(), w), rtol=0, atol=0)
    assert rel(G.linear(x, w), x.double() @ w.double().T) < BF16_TOL


def test_rows_are_batch_invariant(G):
    """Row bits are the same whatever the row count, the row's offset in x and the variant."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    n, k, rows = 520, 1024, 256
    x, w = rand(rows + 40, k, gen=gen), rand(n, k, gen=gen, scale=k**-0.5)
    full = G.linear(x[:rows], w, code=next(iter(G.VARIANTS)))
    for code in G.VARIANTS:
        assert torch.equal(G.linear(x[:rows], w, code=code), full), f"variant {code} differs at M={rows}"
    for m in range(1, rows + 1):
        assert torch.equal(G.linear(x[:m], w), full[:m]), f"chosen variant, M={m}"
        for code in G.VARIANTS:
            if m % 17 == 0:  # every variant at a spread of row counts
                assert torch.equal(G.linear(x[:m], w, code=code), full[:m]), f"variant {code}, M={m}"
    for offset in (1, 7, 16, 40):
        for m in (1, 15, 74, rows - offset + 40):
            got = G.linear(x[offset : offset + m], w)
            assert torch.equal(got, G.linear(x, w)[offset : offset + m]), f"offset {offset}, M={m}"


def test_k_of_one_short_tile(G):
    """K = 64 (a single k-tile of the 64-column variants); the chosen variant falls back to them."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    x, w = rand(3, 64, gen=gen), rand(136, 64, gen=gen, scale=0.125)
    assert rel(G.linear(x, w), x.double() @ w.double().T) < BF16_TOL


def test_rejects_unsupported_shapes(G):
    gen = torch.Generator(device=DEV).manual_seed(5)
    with pytest.raises(ValueError, match="multiple of 64"):
        G.linear(rand(4, 96, gen=gen), rand(64, 96, gen=gen))
    with pytest.raises(ValueError, match="multiple of 64"):
        G.linear(rand(4, 128, gen=gen), rand(60, 128, gen=gen))
    with pytest.raises(ValueError, match="bf16"):
        G.linear(rand(4, 128, gen=gen).float(), rand(64, 128, gen=gen))
    with pytest.raises(ValueError, match="no gemm_stream variant"):
        G.linear(rand(4, 128, gen=gen), rand(64, 128, gen=gen), code=1)
    with pytest.raises(ValueError, match="multiples of 256"):
        G.linear(rand(4, 128, gen=gen), rand(64, 128, gen=gen), code=1211404)


@pytest.mark.parametrize("name", ["gdn_out", "down"])
def test_rows_keep_cublas_bits_across_the_switch(G, name):
    """gemm.linear with products of up to 128 rows on gemm_stream and cuBLAS above (padded where
    cuBLAS splits K): every row count gives each row the bits of the same row in a 2,048-row
    cuBLAS product, on 27B weight shapes (gdn_out: [5120, 6144]; down: [5120, 17408], where cuBLAS
    splits K below a few hundred rows). The premise of mixing the two in the runner."""
    from openjev.worker.cuda import gemm
    from openjev.worker.cuda.fused_weights import shape_config

    c = shape_config("27b")
    n, k = {"gdn_out": (c.hidden_size, c.linear_value_dim), "down": (c.hidden_size, c.intermediate_size)}[name]
    gen = torch.Generator(device=DEV).manual_seed(17)
    w = rand(n, k, gen=gen, scale=k**-0.5)
    assert gemm.stream_matches(w, 128), "gemm_stream does not sum in cuBLAS's order for this shape"
    x = rand(gemm.REFERENCE_ROWS, k, gen=gen)
    full = torch.nn.functional.linear(x, w)
    pad = gemm.invariant_from(w)
    for m in list(range(1, 140)) + [200, 255, 256, 300, 352, 400, 777]:
        got = gemm.linear(x[:m], w, pad, stream_rows=128)
        assert torch.equal(got, full[:m]), f"{name}: M={m} (pad {pad})"

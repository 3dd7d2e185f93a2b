"""The kernel geometry the host passes to NVRTC (CPU only: no compiler, no GPU)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from openjev.worker import geometry
from openjev.worker.cuda import kernels, traits

KERNELS = kernels.kernel_folder()


def _defined(flags: tuple[str, ...]) -> dict[str, int | str]:
    return {name: int(value) if value.isdigit() else value for name, value in (f[2:].split("=", 1) for f in flags)}


def test_every_size_a_kernel_requires_is_passed():
    """Each .cu stops with #error unless the host defines its sizes: they must all be there."""
    defined = _defined(traits.compile_definitions())
    for source in KERNELS.iterdir():
        if not source.name.endswith(".cu"):
            continue
        guard = re.search(r"#if (!defined\(.*?)\n#error", source.read_text(), re.S)
        assert guard, f"{source.name} does not check for its definitions"
        required = re.findall(r"!defined\((\w+)\)", guard.group(1))
        assert required and set(required) <= set(defined), (source.name, set(required) - set(defined))


def test_geometry_reaches_the_kernels_unchanged():
    defined = _defined(traits.compile_definitions())
    assert defined["GDN_CHUNK"] == geometry.GDN_CHUNK_TOKENS
    assert defined["GDN_DIM"] == geometry.GDN_HEAD_DIM
    assert defined["ATTN_HEAD_DIM"] == geometry.ATTN_HEAD_DIM
    assert defined["CONV_K"] == geometry.CONV_KERNEL_SIZE


def test_shared_memory_sizes_follow_the_strides():
    g = traits.GDN_CHUNKED
    c, d = g.chunk, g.head_dim
    lk, lc, lb = d + g.row_pad, c + g.row_pad, 2 * d + g.row_pad
    ls, lks = g.state_columns + g.b_pad, d + g.b_pad
    assert g.solve_smem_bytes == 4 * (c * lb + 2 * c * lc + 3 * 16 * (16 + g.row_pad) + 2 * c) == 105_728
    assert g.state_smem_bytes == 4 * (g.state_columns * lk + 2 * (c * lk + c * lks + c * ls + c)) == 208_384
    assert g.out_smem_bytes == 4 * (3 * c * lk + c * lc + 2 * c + (d + c) * lks) == 223_744
    a = traits.ATTENTION
    assert a.smem_bytes == 3 * 64 * 256 * 2 and a.pipelined_smem_bytes == 5 * 64 * 256 * 2
    # one block per SM must fit the H100/H200's 227 KiB of shared memory (attention: with the
    # bytes that align its tiles)
    assert (
        max(g.solve_smem_bytes, g.state_smem_bytes, g.out_smem_bytes, a.pipelined_smem_bytes + a.wgmma_align)
        <= 227 * 1024
    )
    # the single-buffered attention form runs two blocks an SM
    assert 2 * (a.smem_bytes + a.wgmma_align + 1024) <= 228 * 1024
    # two solve blocks an SM (1 KiB of each SM's shared memory is reserved per block)
    assert 2 * (g.solve_smem_bytes + 1024) <= 228 * 1024


def test_fragment_strides_are_free_of_bank_conflicts():
    """mma fragments read 8 rows x 4 columns (A) or 4 rows x 8 columns (B) of an fp32 tile; each
    stride of the state pass puts the 32 lanes of its tiles' loads in 32 different banks
    (gdn_chunked.cu's static_assert says the same; benchmarks/gdn_chunked_emulate.py counts the
    conflicts of every kernel)."""
    g = traits.GDN_CHUNKED

    def banks(stride, rows, cols):
        return {(r * stride + c) % 32 for r in range(rows) for c in range(cols)}

    for a_stride in (g.k_stride, g.chunk_stride):
        assert len(banks(a_stride, 8, 4)) == 32
    for b_stride in (g.state_stride, g.state_k_stride):
        assert len(banks(b_stride, 4, 8)) == 32


def test_gemm_variants_reach_the_kernel_by_code():
    """Each variant's code decodes to its numbers the way gemm_stream.cu's GS macro does, is
    listed once in the definition, and its stages fit the H200's shared memory per block."""
    listed = re.findall(r"GS\((\d+)\)", str(_defined(traits.compile_definitions())["GS_VARIANTS"]))
    assert sorted(map(int, listed)) == sorted(v.code for v in traits.GEMM_STREAM)
    assert len(set(listed)) == len(listed)
    for v in traits.GEMM_STREAM:
        c = v.code
        assert (c // 1000000, c // 100000 % 10, c // 10000 % 10, c // 1000 % 10) == (v.wm, v.wn, v.mi, v.ni)
        assert (64 * (c // 100 % 10), c % 100) == (v.block_k, v.stages)
        assert v.smem_bytes == v.stages * (v.block_m + v.block_n) * v.block_k * 2 <= 227 * 1024


def test_gemm_choice_divides_k():
    """The chosen variant's k-tile divides K for every K the kernel takes (multiples of 64)."""
    from openjev.worker.cuda import gemm_stream

    for k in (64, 128, 192, 256, 5120, 6144, 17408):
        for n in (8, 5120, 16480, 34816):
            for m in (1, 16, 17, 32, 33, 64, 74, 80, 81, 128, 129, 4096):
                assert k % gemm_stream.choose(m, n, k).block_k == 0, (m, n, k)


def test_headers_ship_beside_the_kernels_and_key_the_compile():
    """Every header a kernel includes is in the kernels' folder, and the compile options carry a
    digest of the headers (CuPy's cache keys on the source and the options only)."""
    included = {name for src in KERNELS.glob("*.cu*") for name in re.findall(r'#include "(\w+\.cuh)"', src.read_text())}
    assert included and all(KERNELS.joinpath(name).is_file() for name in included)
    assert any(option.startswith("-DOPENJEV_HEADERS=0x") for option in kernels._options())


def test_planner_geometry_needs_no_torch():
    code = "import sys, openjev.worker.planner; assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_traits_print_the_nvcc_flags():
    out = subprocess.run(
        [sys.executable, "-m", "openjev.worker.cuda.traits"], check=True, capture_output=True, text=True
    ).stdout.split()
    assert tuple(out) == traits.compile_definitions()


def test_modules_that_use_wgmma_compile_for_sm90a():
    """wgmma exists on sm_90a only: a module whose source uses it must be in ARCH_SPECIFIC (else
    NVRTC refuses it at the worker's start), and only those leave plain sm_90."""
    names = sorted(p.stem for p in kernels.kernel_folder().glob("*.cu"))
    assert {n for n in names if "wgmma" in kernels.kernel_source(n)} == kernels.ARCH_SPECIFIC == {"tree_attention"}
    assert {n: kernels.arch_of(n) for n in names} == {
        n: "sm_90a" if n in kernels.ARCH_SPECIFIC else "sm_90" for n in names
    }
    assert kernels.arch_of("conv1d", "sm_100") == "sm_100"
    with pytest.raises(ValueError, match="sm_90a only"):
        kernels.arch_of("tree_attention", "sm_100")


def test_the_chunked_kernels_segment_limit_is_its_plan_launchs():
    """gdn_chunk_plan plans a segment a thread. Pass budgets of up to max_segments have no key
    wider than its threads and one more has: the launch's assert fired at warm-up, on a GPU
    after the weights had loaded, for --max-launch-sequences 1024; now refused at start."""
    from openjev.worker.cuda.buckets import Bucketing, PassBudget

    def widest(segments: int) -> int:
        keys = Bucketing(PassBudget(tokens=4096, segments=segments, depth=8), chunked_from=0).keys()
        return max(key.segments for key in keys)

    limit = traits.GDN_CHUNKED.max_segments
    assert widest(limit) == traits.GDN_CHUNKED.plan_threads
    assert widest(limit + 1) > traits.GDN_CHUNKED.plan_threads


def test_a_pass_budget_whose_conv_grid_passes_cudas_limit_is_refused():
    """conv1d launches a grid row per 16 tokens and 3 a segment: a budget of ~21,400 tokens and
    segments has keys whose graphs could not be captured (their passes failed INTERNAL)."""
    from openjev.worker.cuda.buckets import Bucketing
    from openjev.worker.cuda.runner import budget_problem, pass_budget

    def widest_grid(budget) -> int:
        return max(traits.CONV.grid_rows(key.tokens, key.segments) for key in Bucketing(budget).keys())

    assert budget_problem(pass_budget(4096, 64), None) is None
    fits = pass_budget(20000, 20000)
    assert budget_problem(fits, None) is None
    assert widest_grid(fits) <= traits.MAX_GRID_Y
    over = pass_budget(21400, 21400)
    assert widest_grid(over) > traits.MAX_GRID_Y
    problem = budget_problem(over, None)
    assert problem is not None and "over CUDA's 65535" in problem and "--max-launch-tokens" in problem
    assert "plans at most 1023 segments" in str(budget_problem(pass_budget(4096, 1024), 0))
    # split: a sequence crossing the split position is two segments
    assert budget_problem(pass_budget(4096, 511), 512) is None
    assert "plans at most 1023 segments, not 1024" in str(budget_problem(pass_budget(4096, 512), 512))

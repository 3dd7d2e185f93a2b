"""Matrix products whose rows do not depend on how many rows share the launch.

Prefix reuse computes a token in launches of different sizes: with the whole prompt under
`off`, inside a short suffix launch under `shared`. cuBLAS picks its algorithm by row count, and
for some weight shapes picks split-K below a threshold, which sums each output in another order:
the token's bf16 result then changes with its launch, and policies drift apart (27B shape, 8
layers: 1.8e-3 in probability, 30 near-tie choice changes; docs/benchmarks/index.md). On the H200
only the MLP down product (K = 17,408) varies, at up to 128 rows; zero workspace stops it for all
shapes but makes every product slower (benchmarks/gemm_invariance.py; docs/cuda-kernels.md).

So each weight shape is probed once at start: the product of M random rows is compared bit for
bit with the same rows inside a 2,048-row product, for every M up to 320 and multiples of 32 up to
1,024; products of fewer rows than the smallest M above every mismatch are padded up to it.

Products of few rows can instead go to our weight-streaming kernel (gemm_stream.py), which sums
every output in one order at every row count. On the H200 that order is cuBLAS's unsplit one, bit
for bit (benchmarks/gemm_stream.py; docs/cuda-kernels.md), so rows then keep their bits when a
launch crosses from one to the other. `stream_plan` checks that per weight shape at start and
gives the runner each shape's `stream_rows` (0 where the bits differ or it was not faster).

Below the padding threshold, products can go instead to cuBLASLt with an algorithm that does
not split K (cublaslt.py): the same order again, at the rows' own count. `lt_plan` checks the
bits at every such row count and, at start, times it against the other path per row count.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

REFERENCE_ROWS = 2048
PROBE_ROWS = list(range(1, 321)) + list(range(352, 1025, 32))


def invariant_from(weight: torch.Tensor, seed: int = 0) -> int:
    """The smallest probed row count M such that every probed count >= M gives each row the same
    bits as in a REFERENCE_ROWS-row product with this weight [N, K] (1: all probes agree)."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(REFERENCE_ROWS, weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
    full = F.linear(x, weight)
    worst = 0
    for m in PROBE_ROWS:
        if not torch.equal(F.linear(x[:m], weight), full[:m]):
            worst = m
    if worst == PROBE_ROWS[-1]:
        return REFERENCE_ROWS
    return next(m for m in PROBE_ROWS if m > worst) if worst else 1


def calibrate(weights) -> dict[tuple[int, int], int]:
    """(N, K) -> rows to pad smaller products to, for each distinct shape among weights."""
    out: dict[tuple[int, int], int] = {}
    for w in weights:
        key = tuple(w.shape)
        if key not in out:
            out[key] = invariant_from(w)
            if out[key] > 1:
                log.info("products with weight %s are padded to %d rows (row results vary below)", key, out[key])
    return out


def stream_matches(weight: torch.Tensor, seed: int = 0) -> bool:
    """Whether gemm_stream gives every row of a REFERENCE_ROWS-row product the bits cuBLAS gives
    it there (where cuBLAS does not split K): then the two may share a weight's row counts."""
    from openjev.worker.cuda import gemm_stream

    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(REFERENCE_ROWS, weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
    return torch.equal(gemm_stream.linear(x, weight), F.linear(x, weight))


def stream_plan(weights) -> dict[tuple[int, int], int]:
    """(N, K) -> rows up to which products go to gemm_stream: its measured STREAM_ROWS where it
    gives cuBLAS's bits on this card, else 0."""
    from openjev.worker.cuda import gemm_stream

    out: dict[tuple[int, int], int] = {}
    for w in weights:
        key = tuple(w.shape)
        if key not in out:
            rows = gemm_stream.stream_rows(*key)
            out[key] = rows if rows and stream_matches(w) else 0
            if rows and not out[key]:
                log.warning("weight %s: the streaming kernel's bits differ from cuBLAS's; cuBLAS only", key)
    return out


def lt_plan(weights, min_rows: dict, stream_rows: dict) -> dict:
    """(N, K) -> a cublaslt.UnsplitLinear for the padded shapes (min_rows > 1) where, on this card,
    it gives every row count below min_rows the bits of a REFERENCE_ROWS-row cuBLAS product; its
    `rows` are the row counts where it was faster than the runner's other path (gemm_stream up to
    stream_rows, the padded product above). Shapes without one are left out."""
    from openjev.worker.cuda import cublaslt

    out: dict = {}
    seen: set = set()
    for w in weights:
        key = tuple(w.shape)
        if key in seen or min_rows.get(key, 1) <= 1:
            continue
        seen.add(key)
        try:
            lt = cublaslt.UnsplitLinear(*key)
            rows = [m for m in range(1, min_rows[key]) if lt.plan(m) is not None]  # others: no unsplit algorithm
            why = lt_mismatch(lt, w, rows)
        except Exception as error:  # an optional speed-up probed at start: any failure keeps the padding
            why = repr(error)
        if why:
            log.warning("weight %s: products below %d rows stay padded: %s", key, min_rows[key], why)
            continue
        lt.rows, saved = faster_rows(w, lt, min_rows[key], stream_rows.get(key, 0), rows)
        log.info(
            "weight %s: cuBLASLt unsplit at %d of %d row counts below %d (%.0f us saved, summed over them)",
            key, len(lt.rows), min_rows[key] - 1, min_rows[key], 1e6 * saved,
        )  # fmt: skip
        if lt.rows:
            out[key] = lt
    return out


def lt_mismatch(lt, weight: torch.Tensor, rows, seed: int = 0) -> str:
    """'' when lt gives every row count in `rows` the bits of a REFERENCE_ROWS-row product, else
    the first row count that differs (or has no unsplit algorithm)."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(REFERENCE_ROWS, weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
    full = F.linear(x, weight)
    for m in rows:
        if lt.plan(m) is None:
            return f"no unsplit algorithm at {m} rows"
        if not torch.equal(lt(x[:m], weight), full[:m]):
            return f"bits differ at {m} rows"
    return ""


def faster_rows(weight, lt, min_rows: int, stream_rows: int, rows, reps: int = 5) -> tuple[frozenset, float]:
    """(row counts where lt beat the other path, seconds saved summed over them): medians of
    `reps` interleaved CUDA-event timings a row count, after one untimed round."""
    import statistics

    x_all = torch.randn(max(rows, default=1), weight.shape[1], device=weight.device).to(weight.dtype)
    faster, saved = set(), 0.0
    for m in rows:
        x = x_all[:m]
        arms = {"other": lambda x=x: linear(x, weight, min_rows, stream_rows), "lt": lambda x=x: lt(x, weight)}
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(reps + 1):
            for name, fn in arms.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                if rep:
                    samples[name].append(start.elapsed_time(end) / 1e3)
        other, mine = (statistics.median(samples[name]) for name in ("other", "lt"))
        if mine < other:
            faster.add(m)
            saved += other - mine
    return frozenset(faster), saved


def linear(x: torch.Tensor, weight: torch.Tensor, min_rows: int, stream_rows: int = 0, lt=None) -> torch.Tensor:
    """x @ weight^T: by `lt` (a cublaslt.UnsplitLinear from lt_plan) at its row counts; else by
    gemm_stream up to stream_rows rows (only where stream_matches); else cuBLAS, with x padded
    with zero rows up to min_rows first when it has fewer."""
    m = x.shape[0]
    if lt is not None and m in lt.rows:
        return lt(x, weight)
    if 0 < m <= stream_rows:
        from openjev.worker.cuda import gemm_stream

        return gemm_stream.linear(x, weight)
    if m >= min_rows:
        return F.linear(x, weight)
    return F.linear(F.pad(x, (0, 0, 0, min_rows - m)), weight)[:m]

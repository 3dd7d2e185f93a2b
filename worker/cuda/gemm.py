"""Matrix products whose rows do not depend on how many rows share the launch.

Prefix reuse computes a token in launches of different sizes: with the whole prompt under
`off`, inside a short suffix launch under `shared`. cuBLAS picks its algorithm by row count, and
for some weight shapes picks split-K below a threshold, which sums each output in another order:
the token's bf16 result then changes with its launch, and policies drift apart (27B shape, 8
layers: 1.8e-3 in probability, 30 near-tie choice changes; docs/benchmarks/index.md). On the H200
only the MLP down product (K = 17,408) varies, at up to 128 rows; zero workspace stops it for all
shapes but makes every product slower (benchmarks/gemm_invariance.py; docs/cuda-kernels.md).

So each weight shape is probed once at start: the product of M random rows is compared bit for
bit with the same rows inside a 4,096-row product, for every M up to 320, multiples of 32 up to
1,024 and of 128 up to 4,096 (the graph buckets' row counts); products of fewer rows than the
smallest M above every mismatch are padded up to it.

Products of few rows can instead go to our weight-streaming kernel (gemm_stream.py), which sums
every output in one order at every row count. On the H200 that order is cuBLAS's unsplit one, bit
for bit (benchmarks/gemm_stream.py; docs/cuda-kernels.md), so rows then keep their bits when a
launch crosses from one to the other. `stream_plan` checks that per weight shape at start and
gives the runner each shape's `stream_rows` (0 where the bits differ or it was not faster).

Products can also go to cuBLASLt with an algorithm that does not split K (cublaslt.py): the
same order again, at the rows' own count, so no padding. `lt_plan` checks the bits of each
algorithm at each row count passes have and, at start, times them against the other path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Every row count up to 320, then the graph buckets' counts (4 steps an octave to 1,024, then
# multiples of buckets.TILE_ROWS to the 4,096-token pass budget): long passes run at those too.
REFERENCE_ROWS = 4096
PROBE_ROWS = list(range(1, 321)) + list(range(352, 1025, 32)) + list(range(1152, REFERENCE_ROWS + 1, 128))


def reference_rows(weight: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """REFERENCE_ROWS seeded random rows for products with `weight` [N, K], in its dtype."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    return torch.randn(REFERENCE_ROWS, weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)


def one_per_shape(weights) -> dict[tuple[int, int], torch.Tensor]:
    """(N, K) -> the first weight of that shape: the start-up probes run once a shape."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for w in weights:
        out.setdefault(tuple(w.shape), w)
    return out


def invariant_from(weight: torch.Tensor, seed: int = 0) -> int:
    """The smallest probed row count M such that every probed count >= M gives each row the same
    bits as in a REFERENCE_ROWS-row product with this weight [N, K] (1: all probes agree)."""
    x = reference_rows(weight, seed)
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
    for key, w in one_per_shape(weights).items():
        out[key] = invariant_from(w)
        if out[key] > 1:
            log.info("products with weight %s are padded to %d rows (row results vary below)", key, out[key])
    return out


def stream_matches(weight: torch.Tensor, rows: int, seed: int = 0) -> bool:
    """Whether gemm_stream, at every row count up to `rows` (those it would serve, each with the
    tile variant it picks there), gives each row the bits a REFERENCE_ROWS-row cuBLAS product
    gives it (where cuBLAS does not split K): then the two may share a weight's row counts."""
    from openjev.worker.cuda import gemm_stream

    x = reference_rows(weight, seed)
    full = F.linear(x, weight)
    return all(torch.equal(gemm_stream.linear(x[:m], weight), full[:m]) for m in range(1, rows + 1))


def stream_plan(weights) -> dict[tuple[int, int], int]:
    """(N, K) -> rows up to which products go to gemm_stream: its measured STREAM_ROWS where it
    gives cuBLAS's bits on this card, else 0."""
    from openjev.worker.cuda import gemm_stream

    out: dict[tuple[int, int], int] = {}
    for key, w in one_per_shape(weights).items():
        rows = gemm_stream.stream_rows(*key)
        out[key] = rows if rows and stream_matches(w, rows) else 0
        if rows and not out[key]:
            log.warning("weight %s: the streaming kernel's bits differ from cuBLAS's; cuBLAS only", key)
    return out


def lt_plan(weights, min_rows: dict, stream_rows: dict, rows) -> dict:
    """(N, K) -> a cublaslt.UnsplitLinear whose `chosen` algorithm at each of `rows` (the row
    counts passes have: graph buckets) gives every row the bits of a REFERENCE_ROWS-row cuBLAS
    product and was faster, timed here, than the runner's other path (gemm_stream, cuBLAS, or
    cuBLAS padded); shapes with no such row count are left out. Any failure keeps the other path."""
    import time

    from openjev.worker.cuda import cublaslt

    started = time.perf_counter()
    out: dict = {}
    for key, w in one_per_shape(weights).items():
        try:
            lt = cublaslt.UnsplitLinear(*key)
            saved = choose_algorithms(lt, w, min_rows.get(key, 1), stream_rows.get(key, 0), rows)
        except Exception as error:  # an optional speed-up probed at start
            log.warning("weight %s: no cuBLASLt algorithms (%r)", key, error)
            continue
        log.info(
            "weight %s: cuBLASLt unsplit at %d of %d row counts (%s), %.0f us saved summed over them",
            key, len(lt.rows), len(rows), ",".join(map(str, sorted(lt.rows))) or "none", 1e6 * saved,
        )  # fmt: skip
        if lt.rows:
            out[key] = lt
    log.info("cuBLASLt algorithms checked and timed in %.1f s", time.perf_counter() - started)
    return out


# Each timing spans CALLS back-to-back calls (the host's launch gaps hide behind the GPU's work,
# as in a graph) and cuBLASLt must win by MARGIN: single-call timings picked paths up to 8% slower
# than the other one and flipped between start-ups (docs/cuda-kernels.md, cuBLASLt section).
CALLS, MARGIN = 8, 0.01


def choose_algorithms(lt, weight: torch.Tensor, min_rows: int, stream_rows: int, rows, reps: int = 5) -> float:
    """Set lt.chosen: at each row count the fastest of cuBLASLt's unsplit algorithms that gives
    the bits of a REFERENCE_ROWS-row product, where it beat the other path by MARGIN (medians of
    `reps` interleaved CUDA-event timings of CALLS calls each, after one untimed round). Returns
    the seconds saved, summed."""
    import statistics

    x_all = reference_rows(weight)
    full = F.linear(x_all, weight)
    saved = 0.0
    for m in rows:
        x = x_all[:m]
        exact = [a for a in lt.candidates(m) if torch.equal(lt(x, weight, a), full[:m])]
        if not exact:
            continue
        arms: dict[int, Callable[[], torch.Tensor]] = {-1: functools.partial(linear, x, weight, min_rows, stream_rows)}
        arms.update({i: functools.partial(lt, x, weight, a) for i, a in enumerate(exact)})
        samples: dict[int, list[float]] = {i: [] for i in arms}
        for rep in range(reps + 1):
            for i, fn in arms.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(CALLS):
                    fn()
                end.record()
                end.synchronize()
                if rep:  # the first round warms up
                    samples[i].append(start.elapsed_time(end) / 1e3 / CALLS)
        median = {i: statistics.median(ts) for i, ts in samples.items()}
        best = min(median, key=median.__getitem__)
        if best >= 0 and median[best] < (1 - MARGIN) * median[-1]:
            lt.chosen[m] = exact[best]
            saved += median[-1] - median[best]
    return saved


def linear(x: torch.Tensor, weight: torch.Tensor, min_rows: int, stream_rows: int = 0, lt=None) -> torch.Tensor:
    """x @ weight^T: by `lt` (a cublaslt.UnsplitLinear from lt_plan) at its row counts; else by
    gemm_stream up to stream_rows rows (only where stream_matches); else cuBLAS, with x padded
    with zero rows up to min_rows first when it has fewer."""
    m = x.shape[0]
    if lt is not None and m in lt.chosen:
        return lt(x, weight)
    if 0 < m <= stream_rows:
        from openjev.worker.cuda import gemm_stream

        return gemm_stream.linear(x, weight)
    if m >= min_rows:
        return F.linear(x, weight)
    return F.linear(F.pad(x, (0, 0, 0, min_rows - m)), weight)[:m]

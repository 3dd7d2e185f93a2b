"""The MLP down product (27B: weight [5120, 17408]) against its weight read: padded to cuBLAS's
invariance threshold (what the runner does), in 2 and 4 K slices of our own (split_linear: each
slice's product in fp32, the partials added in slice order, so a row's bits do not depend on the
row count wherever cuBLAS leaves the slices unsplit: split_from probes that), cuBLAS unpadded
(not batch invariant, for reference), gemm_stream, cuBLASLt with an unsplit algorithm
(cublaslt.py, below the padding threshold), and a device copy of the weight. Timing as
benchmarks/gemm_stream.py (time_methods: weight copies rotated, interleaved, medians). Prints a
table; GPU only (the device machine). Measured on the H200: docs/cuda-kernels.md.

    python3 benchmarks/gemm_split.py [--rows 1,16,64,...] [--out $OUT/gemm-split.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gemm_stream import ROTATE_BYTES, copy_ceiling, time_methods

from openjev.worker.cuda import cublaslt, gemm, gemm_stream

ROWS = [1, 16, 64, 80, 128, 256, 512, 2048, 4096]
N, K = 5120, 17408


def split_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    k = weight.shape[1] // parts
    acc = torch.mm(x[:, :k], weight[:, :k].T, out_dtype=torch.float32)
    for p in range(1, parts):
        acc += torch.mm(x[:, p * k : (p + 1) * k], weight[:, p * k : (p + 1) * k].T, out_dtype=torch.float32)
    return acc.to(x.dtype)


def split_from(weight: torch.Tensor, parts_to_try=(2, 4)) -> int:
    """The fewest slices for which every probed row count gets each row's bits of a 2,048-row
    product (gemm.PROBE_ROWS, as gemm.invariant_from probes cuBLAS); 1: none."""
    x = torch.randn(gemm.REFERENCE_ROWS, weight.shape[1], device=weight.device).to(weight.dtype)
    for parts in parts_to_try:
        full = split_linear(x, weight, parts)
        if all(torch.equal(split_linear(x[:m], weight, parts), full[:m]) for m in gemm.PROBE_ROWS):
            return parts
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, -(-ROTATE_BYTES // (N * K * 2)))
    ws = [(torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).bfloat16() for _ in range(copies)]
    xs = [torch.randn(max(rows), K, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
    pad, parts = gemm.invariant_from(ws[0]), split_from(ws[0])
    ceiling = copy_ceiling()
    scrub = torch.randn(2**27, device="cuda")
    flat = torch.empty(N * K, dtype=torch.bfloat16, device="cuda")
    floor_us = N * K * 2 / ceiling * 1e6
    result = {"device": torch.cuda.get_device_name(), "pad_rows": pad, "split_from": parts, "floor_us": floor_us}
    print(f"down [{N}, {K}]: cuBLAS invariant from {pad} rows; split_from -> {parts}; weight read {floor_us:.1f} us")
    print(f"{'M':>5} " + " ".join(f"{name:>7}" for name in methods_order()) + "  (us, medians)")
    lt = cublaslt.UnsplitLinear(N, K)
    for m in rows:
        xm = [x[:m] for x in xs]
        methods = {
            "copy": lambda i: flat.copy_(ws[i % copies].view(-1)),
            "padded": lambda i, xm=xm: gemm.linear(xm[i % copies], ws[i % copies], pad),
            "split2": lambda i, xm=xm: split_linear(xm[i % copies], ws[i % copies], 2),
            "split4": lambda i, xm=xm: split_linear(xm[i % copies], ws[i % copies], 4),
            "cublas": lambda i, xm=xm: F.linear(xm[i % copies], ws[i % copies]),
        }
        if m <= 256:
            methods["stream"] = lambda i, xm=xm: gemm_stream.linear(xm[i % copies], ws[i % copies])
        if m < pad:
            methods["lt"] = lambda i, xm=xm: lt(xm[i % copies], ws[i % copies])
        times, _ = time_methods(methods, args.rounds, scrub)
        result[str(m)] = times
        cells = " ".join(f"{1e6 * times[k]:7.1f}" if k in times else f"{'-':>7}" for k in methods_order())
        print(f"{m:5d} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def methods_order() -> list[str]:
    return ["copy", "padded", "split2", "split4", "cublas", "stream", "lt"]


if __name__ == "__main__":
    main()

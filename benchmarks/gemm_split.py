"""The MLP down product (27B: weight [5120, 17408]) as the runner can call it, against its weight
read: padded to cuBLAS's invariance threshold (the runner before the K split), in 2 and 4 K
slices (gemm.split_linear), cuBLAS unpadded (not batch invariant, for reference), gemm_stream,
and a device copy of the weight. Timing as benchmarks/gemm_stream.py (time_methods: weight copies
rotated, interleaved, medians). Prints a table; GPU only (the device machine).

    python3 benchmarks/gemm_split.py [--out $OUT/gemm-split.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gemm_stream import ROTATE_BYTES, copy_ceiling, time_methods

from openjev.worker.cuda import gemm, gemm_stream

ROWS = [1, 16, 64, 80, 128, 256, 512, 2048, 4096]
N, K = 5120, 17408


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, -(-ROTATE_BYTES // (N * K * 2)))
    ws = [(torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).bfloat16() for _ in range(copies)]
    xs = [torch.randn(max(ROWS), K, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
    pad, parts = gemm.invariant_from(ws[0]), gemm.split_from(ws[0])
    ceiling = copy_ceiling()
    scrub = torch.randn(2**27, device="cuda")
    flat = torch.empty(N * K, dtype=torch.bfloat16, device="cuda")
    floor_us = N * K * 2 / ceiling * 1e6
    result = {"device": torch.cuda.get_device_name(), "pad_rows": pad, "split_from": parts, "floor_us": floor_us}
    print(f"down [{N}, {K}]: cuBLAS invariant from {pad} rows; split_from -> {parts}; weight read {floor_us:.1f} us")
    print(f"{'M':>5} {'copy':>7} {'padded':>7} {'split2':>7} {'split4':>7} {'cublas':>7} {'stream':>7}  (us, medians)")
    for m in ROWS:
        xm = [x[:m] for x in xs]
        methods = {
            "copy": lambda i: flat.copy_(ws[i % copies].view(-1)),
            "padded": lambda i, xm=xm: gemm.linear(xm[i % copies], ws[i % copies], pad),
            "split2": lambda i, xm=xm: gemm.split_linear(xm[i % copies], ws[i % copies], 2),
            "split4": lambda i, xm=xm: gemm.split_linear(xm[i % copies], ws[i % copies], 4),
            "cublas": lambda i, xm=xm: F.linear(xm[i % copies], ws[i % copies]),
        }
        if m <= 256:
            methods["stream"] = lambda i, xm=xm: gemm_stream.linear(xm[i % copies], ws[i % copies])
        times, _ = time_methods(methods, args.rounds, scrub)
        result[str(m)] = times
        cells = " ".join(f"{1e6 * times[k]:7.1f}" if k in times else f"{'-':>7}" for k in methods_order())
        print(f"{m:5d} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def methods_order() -> list[str]:
    return ["copy", "padded", "split2", "split4", "cublas", "stream"]


if __name__ == "__main__":
    main()

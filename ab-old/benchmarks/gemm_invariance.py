"""Are cuBLAS bf16 products batch invariant on this GPU? Row i of X[:M] @ W^T, computed with M
rows, compared bit for bit with the same row computed inside the largest M.

Why: prefix reuse runs the same token in launches of different sizes. If a row's result depends
on M (the library picks another algorithm, e.g. split-K, for another M), every policy drifts from
`off` by bf16 rounding, which the 27B gates measured (docs/benchmarks/h200-2026-11-29/gates.md).

Each configuration runs in its own process (cuBLAS reads its environment once):
  python3 benchmarks/gemm_invariance.py            # all configurations, a table per configuration
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# (name, K, N) of the 27B shape's products: GDN in/out, attention in/out, MLP up/down, head rows
PRODUCTS = [
    ("gdn_in", 5120, 16480),
    ("gdn_out", 6144, 5120),
    ("attn_in", 5120, 14336),
    ("attn_out", 6144, 5120),
    ("gate_up", 5120, 34816),
    ("down", 17408, 5120),
]
ROWS = [1, 2, 3, 7, 16, 33, 64, 100, 128, 255, 512, 777, 1024, 2048, 4096]
CONFIGS = {
    "default": {},
    "no-reduced-precision": {"OPENJEV_GEMM_EXPERIMENT": "rpr-off"},
    "workspace-0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "workspace-0+rpr-off": {
        "CUBLAS_WORKSPACE_CONFIG": ":0:0",
        "CUBLASLT_WORKSPACE_SIZE": "0",
        "OPENJEV_GEMM_EXPERIMENT": "rpr-off",
    },
    "cublaslt": {"OPENJEV_GEMM_EXPERIMENT": "cublaslt"},
}


def measure() -> dict:
    import torch
    import torch.nn.functional as F

    mode = os.environ.get("OPENJEV_GEMM_EXPERIMENT", "")
    if mode == "rpr-off":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if mode == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"products": {}, "times_ms": {}}
    for name, k, n in PRODUCTS:
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16()
        full = F.linear(x, w)
        bad = {}
        for m in ROWS:
            part = F.linear(x[:m].contiguous(), w)
            differ = (part != full[:m]).any(dim=1).sum().item()
            if differ:
                bad[m] = differ
        out["products"][name] = bad
        times = {}
        for m in (16, 512, 4096):
            xm = x[:m].contiguous()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(20):
                start.record()
                F.linear(xm, w)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            times[m] = sorted(samples)[len(samples) // 2]
        out["times_ms"][name] = times
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure()))
        return
    rows = []
    for name, env in CONFIGS.items():
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env={**os.environ, **env}, capture_output=True, text=True
        )
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((name, result))
    print(
        "\n| config | product | rows M whose results differ from inside M=4096 (M: rows differing) "
        "| ms at M=16 / 512 / 4096 |"
    )
    print("|---|---|---|---|")
    for name, result in rows:
        for product, bad in result["products"].items():
            t = result["times_ms"][product]
            cells = ", ".join(f"{m}: {c}" for m, c in bad.items()) or "none"
            print(f"| {name} | {product} | {cells} | {t['16']:.3f} / {t['512']:.3f} / {t['4096']:.3f} |")


if __name__ == "__main__":
    main()

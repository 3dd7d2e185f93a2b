"""Where tree attention goes wrong, part by part (GPU): prints the worst error of
(1) one query over one key (softmax 1: the output is that key's V row, so only P V is tested),
(2) 64 queries over 64 keys with V one-hot (key j -> column j: the output's first 64 columns are
    the softmax weights, so Q K^T is tested through a P V that (1) found right),
(3) random segments against the reference.
Usage: python3 benchmarks/attention_probe.py
"""

from __future__ import annotations

import argparse

import torch

from openjev.worker.cuda import kernels as K
from openjev.worker.cuda import reference as ref

DEV = "cuda"
HQ, HKV, HD = 24, 4, 256


def run(q, kp, vp, lens, pipelined):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    rows = torch.arange(kp.shape[0], dtype=torch.int32, device=DEV)
    out = K.tree_attention(q, kp, vp, rows, cu, cu, max(lens), pipelined=pipelined)
    exp = ref.tree_attention(q.cpu(), kp.cpu(), vp.cpu(), rows.cpu(), cu.cpu(), cu.cpu(), None)
    return (out.float().cpu() - exp.float()).abs().max().item(), out, exp


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    torch.manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV).bfloat16()  # noqa: E731
    for pipelined in (False, True):
        tag = "pipelined" if pipelined else "single"
        err, *_ = run(r(1, HQ, HD), r(1, HKV, HD), r(1, HKV, HD), [1], pipelined)
        print(f"{tag}: one key (P V only): max |err| {err:.3g}")
        v = torch.zeros(64, HKV, HD, device=DEV)
        v[torch.arange(64), :, torch.arange(64)] = 1.0
        err, out, exp = run(r(64, HQ, HD) * 0.2, r(64, HKV, HD) * 0.2, v.bfloat16(), [64], pipelined)
        print(f"{tag}: one-hot V (Q K^T through P V): max |err| {err:.3g}")
        if err > 1e-2:
            bad = (out.float().cpu() - exp.float()).abs()[..., :64].amax(dim=(1,))
            print("  worst (token, key) errors, first 8 tokens x 16 keys:\n", bad[:8, :16])
        err, *_ = run(r(700, HQ, HD), r(700, HKV, HD), r(700, HKV, HD), [130, 1, 500, 69], pipelined)
        print(f"{tag}: random segments: max |err| {err:.3g}")


if __name__ == "__main__":
    main()

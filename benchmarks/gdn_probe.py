"""One launch of a GDN recurrence variant on 27B shapes (one segment of T tokens, an initial
state), for a profiler to look at: `ncu --kernel-name regex:gdn_recurrent python3 benchmarks/gdn_probe.py`.

    python3 benchmarks/gdn_probe.py [--tokens 4096] [--variant s8c32x2]
"""

from __future__ import annotations

import argparse

import torch

from openjev.worker.cuda import kernels as K


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variant", default=K.GDN_DEFAULT)
    args = p.parse_args()
    T, H, Hk, D = args.tokens, 48, 16, 128
    dev = "cuda"
    qn = torch.nn.functional.normalize(torch.randn(T, Hk, D, device=dev), dim=-1) * D**-0.5
    kn = torch.nn.functional.normalize(torch.randn(T, Hk, D, device=dev), dim=-1)
    v = torch.randn(T, 2 * Hk * D + H * D, device=dev).bfloat16()[:, 2 * Hk * D :].unflatten(1, (H, D))
    g, beta = -torch.rand(T, H, device=dev) * 0.5, torch.rand(T, H, device=dev)
    kq = (qn * kn).sum(-1)
    init = torch.randn(1, H, D, D, device=dev) * 0.1
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    for _ in range(3):  # the first compiles; the profiler looks at every launch it is told to
        K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, variant=args.variant)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

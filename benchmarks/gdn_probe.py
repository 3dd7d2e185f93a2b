"""One launch of a GDN recurrence variant on 27B shapes (one segment of T tokens, an initial
state; the inputs of kernels_gpu.py), three times, for a profiler to look at:
`ncu --kernel-name regex:gdn_recurrent python3 benchmarks/gdn_probe.py`.

    python3 benchmarks/gdn_probe.py [--tokens 4096] [--variant s8c32x2]
"""

from __future__ import annotations

import argparse

import torch
from kernels_gpu import cases

from openjev.worker.cuda import kernels as K


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variant", default=K.GDN_DEFAULT)
    args = p.parse_args()
    run = {name: fn for name, fn, *_ in cases(args.tokens)}[f"gdn_recurrent_{args.variant}"]
    for _ in range(3):  # the first compiles; the profiler looks at every launch it is told to
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

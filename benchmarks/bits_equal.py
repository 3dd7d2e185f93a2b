"""Whether two builds' saved outputs (torch.save of tensors in lists, tuples or dicts, as the A/B
probes' --save writes them) are equal bit for bit; prints one line for device_run.sh's reports.

    python3 benchmarks/bits_equal.py NEW.pt OLD.pt
"""

from __future__ import annotations

import sys

import torch


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return False


if __name__ == "__main__":
    new, old = sys.argv[1:]
    print("outputs bit-equal to ab-old:", equal(torch.load(new), torch.load(old)))

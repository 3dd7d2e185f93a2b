"""A sticky CUDA error is told from a working device (the worker stops serving on one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

# In a process of its own: the error it provokes leaves that process's CUDA context unusable.
PROBE = r"""
import cupy, torch
from openjev.worker.cuda.runner import device_fault

device = torch.device("cuda")
assert device_fault(device) is None, "a working device reported lost"
write = cupy.RawKernel(r'extern "C" __global__ void far(int *p) { *(volatile int *)(p + (1ll << 40)) = 1; }', "far")
write((1,), (1,), (cupy.zeros(1, dtype=cupy.int32),))
print(device_fault(device))
"""


def test_a_sticky_cuda_error_is_found_and_a_working_device_is_not():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "illegal memory access" in done.stdout, done.stdout

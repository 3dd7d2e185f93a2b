"""The CUDA kernels module for the GPU tests of this folder (skipped without CuPy and a GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def K():
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from openjev.worker.cuda import kernels

    return kernels

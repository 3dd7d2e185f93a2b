"""benchmarks/gdn_chunked_emulate.py, the CPU emulation of cuda/gdn_chunked.cu's three kernels
(tiles, strides, fragment layouts, loops), still agrees with the reference: kept in step with
the .cu by hand, it is the chunked kernel's only check without a GPU. ~40 s, so marked slow."""

import importlib.util
from pathlib import Path

import pytest

EMULATOR = Path(__file__).parents[3] / "benchmarks" / "gdn_chunked_emulate.py"


@pytest.mark.slow
def test_emulated_chunked_kernels_match_the_reference():
    spec = importlib.util.spec_from_file_location("gdn_chunked_emulate", EMULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.worst_difference() < 1e-5

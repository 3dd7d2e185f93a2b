"""Does programmatic dependent launch (PDL) shrink the gaps between a pass's kernels? (GPU only)

A 74-token pass on the 27B shape runs ~800 kernels, and the device sits idle ~1.5 ms between them
(docs/benchmarks/index.md, "Where a short request's time goes"). With PDL a kernel launched with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may be scheduled while the kernel before it
finishes; it waits (griddepcontrol.wait) before touching that kernel's output. This probe times,
inside CUDA graphs, replays interleaved, medians:
  chain:  800 small elementwise kernels, each reading the one before's output;
  layers: 64 x [a cuBLAS product of 74 rows, then 8 small kernels], the pass's rhythm;
each launched (a) as the worker does today (CuPy), (b) through cuLaunchKernelEx without the
attribute, (c) with it. Outputs of the three arms must be equal (the waits keep the order).

    python3 benchmarks/pdl_probe.py [--rounds 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import cupy
import numpy as np
import torch

SOURCE = r"""
extern "C" __global__ void scale(const float* __restrict__ x, float* __restrict__ y, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the kernel before is done and visible
    asm volatile("griddepcontrol.launch_dependents;");  // the next one may be scheduled now
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = x[i] * 0.5f + 1.f;
}
"""
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h, CUDA 12-13)


class Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class Config(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(Attribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


def launch_ex(function, grid, block, args, pdl: bool) -> None:
    """cuLaunchKernelEx on torch's current stream; args: torch tensors and ints (int32)."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int32(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.memmove(ctypes.addressof(attr) + Attribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    config = Config(
        (ctypes.c_uint * 3)(*grid),
        (ctypes.c_uint * 3)(*block),
        0,
        torch.cuda.current_stream().cuda_stream,
        ctypes.pointer(attr) if pdl else None,
        1 if pdl else 0,
    )
    handle = function.kernel.ptr  # RawKernel -> its cupy.cuda.Function for this device -> CUfunction
    rc = _cuda.cuLaunchKernelEx(ctypes.byref(config), handle, ctypes.cast(params, ctypes.c_void_p), None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx: CUresult {rc}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.cuda.init()
    function = cupy.RawModule(code=SOURCE, options=("-arch=sm_90",)).get_function("scale")
    n = 74 * 5120  # a 74-token pass's hidden rows, fp32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid, block = (sms, 1, 1), (256, 1, 1)
    bufs = [torch.zeros(n, device="cuda") for _ in range(2)]
    x = torch.randn(74, 5120, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(5120, 5120, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def small(how: str, i: int) -> None:
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        if how == "cupy":
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                function(grid, block, (cupy.from_dlpack(src), cupy.from_dlpack(dst), np.int32(n)))
        else:
            launch_ex(function, grid, block, (src, dst, n), pdl=how == "pdl")

    def chain(how: str) -> None:
        for i in range(800):
            small(how, i)

    def layers(how: str) -> None:
        for layer in range(64):
            torch.mm(x, weights[layer % 4])  # the product; its output is not read (the wait orders it)
            for i in range(8):
                small(how, i)

    results = {}
    for name, body in (("chain", chain), ("layers", layers)):
        graphs, outputs = {}, {}
        for how in ("cupy", "ex", "pdl"):
            bufs[0].fill_(1.0)
            torch.cuda.synchronize()
            body(how)  # warm (CuPy's and cuBLAS's first-call work) outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body(how)
            bufs[0].fill_(1.0)
            g.replay()
            torch.cuda.synchronize()
            outputs[how] = bufs[0].clone()
            graphs[how] = g
        equal = all(torch.equal(outputs["cupy"], outputs[h]) for h in ("ex", "pdl"))
        times: dict[str, list[float]] = {h: [] for h in graphs}
        for _ in range(args.rounds):
            for how, g in graphs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times[how].append(start.elapsed_time(end))
        results[name] = {"equal": equal, "ms": times}
        base = statistics.median(times["cupy"])
        print(f"{name}: outputs equal across arms: {equal}")
        for how, ts in times.items():
            med = statistics.median(ts)
            print(f"  {how:5s} median {med:.3f} ms (min {min(ts):.3f}, max {max(ts):.3f}), {med / base:.3f}x cupy")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

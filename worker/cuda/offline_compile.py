"""`python -m openjev.worker.cuda.offline_compile`: compile every kernel of `cuda/*.cu` for sm_90
(tree_attention.cu for sm_90a)
with this environment's NVRTC and CUDA headers, without a GPU. The GPU image runs it at build time,
so an image whose CUDA libraries cannot compile the kernels fails to build rather than to start.

It uses the worker's own sources and options (`kernels.kernel_source`, `kernels._options`) and
CuPy's NVRTC binding, with the header folder CuPy itself finds in the NVIDIA wheels
(`cuda.pathfinder`). It does not go through `cupy.RawModule`, which asks the driver for the device
first; running the kernels still needs a GPU (`make gpu-test`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time


def compile_all(arch: str = "sm_90") -> list[tuple[str, int]]:
    """(kernel name, cubin bytes) for every .cu file (for `arch`, or its architecture-specific form
    where the module needs it: kernels.arch_of); raises on the first that does not compile."""
    from cupy_backends.cuda.libs import nvrtc

    from openjev.worker.cuda import kernels

    # NVIDIA's `cuda` namespace (cuda-pathfinder, a CuPy dependency), imported by name: the
    # repository's own cuda/ folder would otherwise stand in for it in tools that read the tree.
    pathfinder = importlib.import_module("cuda.pathfinder")

    headers = pathfinder.find_nvidia_header_directory("cudart")
    if headers is None:
        raise RuntimeError("no CUDA runtime headers found (the nvidia-cuda-runtime wheel)")
    compiled = []
    for path in sorted(kernels.kernel_folder().glob("*.cu")):
        options = [
            *kernels._options(kernels.arch_of(path.stem, arch)),
            f"-I{headers}",
            "--device-as-default-execution-space",
        ]
        program = nvrtc.createProgram(kernels.kernel_source(path.stem), path.name, (), ())
        try:
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError:
                raise RuntimeError(f"{path.name} does not compile:\n{nvrtc.getProgramLog(program)}") from None
            compiled.append((path.stem, len(nvrtc.getCUBIN(program))))
        finally:
            nvrtc.destroyProgram(program)
    if not compiled:
        raise RuntimeError(f"no kernels in {kernels.kernel_folder()}")
    return compiled


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offline_compile", description=__doc__)
    p.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from cupy_backends.cuda.libs import nvrtc

    from openjev.worker.cuda import kernels

    started = time.monotonic()
    try:
        compiled = compile_all(args.arch)
    except (RuntimeError, ValueError) as error:  # ValueError: --arch that a module cannot take
        print(f"offline_compile: {error}", file=sys.stderr)
        return 1
    major, minor = nvrtc.getVersion()
    for name, size in compiled:
        print(f"{name}.cu: {size} bytes of {kernels.arch_of(name, args.arch)} cubin")
    print(f"{len(compiled)} kernels compiled by NVRTC {major}.{minor} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

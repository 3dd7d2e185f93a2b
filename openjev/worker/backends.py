"""Choosing and building the model runner: `--backend auto|cuda|torch`."""

from __future__ import annotations

from pathlib import Path

from openjev.export import load_export_meta


def cuda_available() -> bool:
    try:
        import cupy  # noqa: F401  (the CUDA backend's kernels need it)
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "cuda" if cuda_available() else "torch"
    if requested == "cuda" and not cuda_available():
        raise SystemExit("--backend cuda: no CUDA GPU with CuPy is available")
    if requested not in ("cuda", "torch"):
        raise SystemExit(f"unknown backend {requested!r}")
    return requested


def build_runner(backend: str, model_dir: Path, *, synthetic: str | None, seed: int, threads: int | None):
    """The export directory always provides metadata and the tokenizer; with `synthetic` the
    weights are seeded random ones of the named shape instead of the export's."""
    if backend == "torch":
        if synthetic is not None:
            raise SystemExit("--synthetic needs the CUDA backend")
        from openjev.worker.model.runner import TorchRunner

        return TorchRunner(model_dir, num_threads=threads)
    from openjev.worker.cuda.runner import CudaRunner

    if synthetic is not None:
        return CudaRunner.synthetic(synthetic, seed=seed, meta=load_export_meta(model_dir))
    return CudaRunner.from_export(model_dir)

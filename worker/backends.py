"""Choosing and building the model runner: `--backend auto|cuda|torch`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from openjev.export import CONFIG_FILE, ExportError
from openjev.worker import geometry

if TYPE_CHECKING:
    from openjev.worker.checkpoint.config import ModelConfig


def cuda_available() -> bool:
    try:
        import cupy  # noqa: F401  (the CUDA backend's kernels need it)
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


BACKENDS = ("auto", "cuda", "torch", "transformers")


def resolve_backend(requested: str) -> str:
    """auto: CUDA when a GPU is present, else torch. `transformers` is the benchmark's baseline
    arm (full prompts only), never chosen by auto."""
    if requested == "auto":
        return "cuda" if cuda_available() else "torch"
    if requested == "cuda" and not cuda_available():
        raise SystemExit("openjev-worker: --backend cuda: no CUDA GPU with CuPy is available")
    if requested not in BACKENDS:
        raise SystemExit(f"unknown backend {requested!r}")
    return requested


def cuda_config_problems(config: ModelConfig) -> list[str]:
    """Where config.json's sizes differ from those the CUDA kernels are compiled for
    (openjev.worker.geometry), one `field value (supported: ...)` each; empty: the model fits."""
    problems = []
    exact = {
        "head_dim": geometry.ATTN_HEAD_DIM,
        "linear_key_head_dim": geometry.GDN_HEAD_DIM,
        "linear_value_head_dim": geometry.GDN_HEAD_DIM,
        "linear_conv_kernel_dim": geometry.CONV_KERNEL_SIZE,
    }
    for field, supported in exact.items():
        if (value := getattr(config, field)) != supported:
            problems.append(f"{field} {value} (supported: {supported})")
    if config.rotary_dim % geometry.ROTARY_DIM_MULTIPLE:
        problems.append(
            f"partial_rotary_factor {config.partial_rotary_factor} (supported: a rotary dim, head_dim * "
            f"factor = {config.rotary_dim} here, that is a multiple of {geometry.ROTARY_DIM_MULTIPLE})"
        )
    if config.hidden_size % geometry.VECTOR_ELEMENTS or config.hidden_size > geometry.MAX_NORM_WIDTH:
        most = geometry.MAX_NORM_WIDTH
        problems.append(
            f"hidden_size {config.hidden_size} (supported: multiples of {geometry.VECTOR_ELEMENTS} up to {most})"
        )
    if config.intermediate_size % geometry.VECTOR_ELEMENTS:
        problems.append(
            f"intermediate_size {config.intermediate_size} (supported: multiples of {geometry.VECTOR_ELEMENTS})"
        )
    return problems


def check_cuda_config(config: ModelConfig) -> None:
    """ExportError naming config.json where the CUDA kernels cannot run this model's sizes:
    checked before the weights load (otherwise they load for minutes and the warm-up fails)."""
    problems = cuda_config_problems(config)
    if problems:
        raise ExportError(
            f"{CONFIG_FILE}: the cuda backend's kernels are compiled for other sizes: {'; '.join(problems)}; "
            "run this model with --backend torch"
        )


# Models this narrow run faster on one torch thread: their products are too small for intra-op
# threads to pay for their synchronisation, and the frontend on the same cores gets the other (the
# demo model on 2 cores: 8 short requests 0.154 s in sequence with 1 thread, 0.264 s with 2;
# docs/benchmarks/index.md). Wider models keep torch's default, one thread per core.
ONE_THREAD_HIDDEN_SIZE = 1024


def build_runner(
    backend: str,
    model_dir: Path,
    *,
    synthetic: str | None,
    seed: int,
    threads: int | None,
    cuda_options: dict | None = None,
):
    """The export directory always provides metadata and the tokenizer; with `synthetic` the
    weights are seeded random ones of the named shape instead of the export's. cuda_options:
    CudaRunner keyword arguments (graph cache, GEMM padding) of the cuda backend."""
    if backend == "torch":
        if synthetic is not None:
            raise SystemExit("openjev-worker: --synthetic needs a GPU (--backend cuda or transformers)")
        from openjev.worker.checkpoint.config import load_model_config
        from openjev.worker.model.runner import TorchRunner

        if threads is None and load_model_config(model_dir).hidden_size <= ONE_THREAD_HIDDEN_SIZE:
            threads = 1
        return TorchRunner(model_dir, num_threads=threads)
    if backend == "transformers" and synthetic is None:
        import torch

        from openjev.tools.bench.transformers_arm import TransformersRunner

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return TransformersRunner.from_export(
            model_dir, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32
        )
    from openjev.worker.cuda.runner import CudaRunner

    # transformers only borrows the CUDA runner's weights: no graphs, no padded products
    options = dict(cuda_options or {}) if backend == "cuda" else {"graph_cache_size": 0, "gemm_min_rows": 0}
    runner = (
        CudaRunner.synthetic(synthetic, seed=seed, **options)
        if synthetic
        else CudaRunner.from_export(model_dir, **options)
    )
    if backend == "transformers":
        # Same seed, same weights: transformers gets views of the CUDA runner's tensors.
        import torch

        from openjev.tools.bench.transformers_arm import TransformersRunner

        # the baseline as its users run it: cuBLAS's default, which CudaRunner turned off
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        return TransformersRunner(
            runner.config,
            runner.reference_weights(),
            runner.head_weight.float().tolist(),
            runner.head_bias,
            device=runner.device,
        )
    return runner

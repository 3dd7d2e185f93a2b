"""The roofline floor of a request (docs/benchmarks/index.md): one read of the weights or its
products, whichever takes longer,
max(weight_bytes / copy_bandwidth, 2 * params * tokens_computed / matmul_rate), both ceilings
measured on the card in the same run. A lower bound: a request of several passes reads the
weights once a pass, and attention and the GDN recurrence add work not counted here."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import expected_shapes


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_second: float  # bytes read + written by a large device-to-device copy
    matmul_flops_per_second: float  # a large bf16 GEMM on random data
    device: str


def model_size(config: ModelConfig) -> tuple[int, int]:
    """(weight bytes read per pass in bf16, matrix-product parameters a computed token multiplies).
    The embedding table is a row gather, not a read of the whole table nor a matrix product, so it
    counts in neither."""
    params = sum(_numel(shape) for name, shape in expected_shapes(config).items() if name != "embed_tokens.weight")
    return 2 * params, token_matmul_parameters(config)


def floor_seconds(config: ModelConfig, tokens_computed: int, ceilings: Ceilings) -> float:
    return size_floor_seconds(model_size(config), tokens_computed, ceilings)


def size_floor_seconds(size: tuple[float, int], tokens_computed: int, ceilings: Ceilings) -> float:
    """The floor from model_size's (weight bytes read per pass, matmul parameters): what a saved
    run keeps of its model shape."""
    weight_bytes, params = size
    return max(
        weight_bytes / ceilings.copy_bytes_per_second, 2.0 * params * tokens_computed / ceilings.matmul_flops_per_second
    )


def measure_ceilings(seconds: float = 0.5) -> Ceilings:
    """The best rate of back-to-back runs over `seconds` per ceiling, each run timed with CUDA
    events; random data, never zeros. The best, not a median: a card's clocks rise from idle and
    fall under sustained load (on one H200 the median after 0.5 s of 8192-wide products gave 690
    TFLOP/s where short runs had given 741-804), and a lower ceiling raises every floor and the
    load sweep's share of it, which flatters the results. The fastest run is a rate the card has
    shown, so a floor built from it is one the card could reach."""
    import time

    import torch

    def timed(fn) -> float:
        best = float("inf")
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    source = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB, far beyond L2
    target = torch.empty_like(source)
    copy_seconds = timed(functools.partial(target.copy_, source))
    copy_rate = 2 * source.numel() * source.element_size() / copy_seconds
    del source, target
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul_rate = 2 * n**3 / timed(functools.partial(torch.matmul, a, b))
    del a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_rate, matmul_rate, torch.cuda.get_device_name())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def matmul_parameters(config: ModelConfig) -> int:
    """Weights that every token multiplies in a matrix product. The embedding is a row lookup and
    the norms, conv1d taps and GDN gate parameters are element-wise, so none of them count; the judge's head is one
    vector dotted with a few rows, so it counts neither."""
    d, inter = config.hidden_size, config.intermediate_size
    mlp = 3 * d * inter  # gate, up, down
    gdn = d * (config.linear_conv_dim + config.linear_value_dim + 2 * config.linear_num_value_heads)  # qkv, z, b, a
    gdn += config.linear_value_dim * d  # out_proj
    hq, hkv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = d * (2 * hq * dh + 2 * hkv * dh) + hq * dh * d  # q (with its gate), k, v; o
    per_kind = {"linear_attention": gdn, "full_attention": attention}
    return sum(mlp + per_kind[kind] for kind in config.layer_types)


def token_matmul_parameters(config: ModelConfig) -> int:
    """matmul_parameters less the last layer's MLP, which the engine runs on the head rows only (a
    few a request): what every computed token multiplies, and what floors and the load sweep's
    matmul rate count (the head rows' last MLP left out keeps a floor a lower bound and the rate an
    under-count). Runs saved before 2026-12-02 counted all of matmul_parameters (1.1% more on 27B)."""
    return matmul_parameters(config) - 3 * config.hidden_size * config.intermediate_size


def weight_bytes_resident(config: ModelConfig) -> int:
    """bf16 bytes of every weight on the device, the embedding table included (the memory target
    is peak <= this + 12 GiB)."""
    return 2 * sum(_numel(shape) for shape in expected_shapes(config).values())

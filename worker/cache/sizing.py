"""The state cache's byte budget and how a worker builds its cache for a runner.

`--state-cache-bytes` (0: off; unset: the default below):
- torch backend: a fixed 256 MiB (the demo model's state at 1,500 tokens is ~3.2 MB: enough
  for agent sessions over dozens of contexts, small beside the process);
- cuda backend: half of the device memory free once the worker has loaded its weights, captured
  its CUDA graphs and run its warm-up request (`torch.cuda.mem_get_info`), so the other half
  stays for the passes' transient buffers. On the 27B shape a state is ~150 MB of fp32 GDN
  state plus 64 KB of K/V a token, so tens of GB hold a few hundred nodes.
"""

from __future__ import annotations

from typing import Any

from openjev.worker.cache.keys import GRID_TOKENS, CutRule
from openjev.worker.cache.store import CacheListener, StateCache

CPU_DEFAULT_BYTES = 256 << 20
GPU_FREE_FRACTION = 0.5
# states left at grid points before each branch point (besides the branch point itself): the
# CPU's are small; on the GPU each is ~150 MB and a captured pass holds 8 kept states
DEPOSITS_PER_SEGMENT = {"torch": 4, "cuda": 2}


def min_state_bytes(config, itemsize: int = 2) -> int:
    """Bytes every kept state has at least: the shortest one kept is a grid long (GRID_TOKENS
    tokens), with the fp32 recurrent state (Hv x Dk x Dv) and conv window of each GDN layer, its
    tokens' keys and values in each attention layer (both at `itemsize` bytes an element, the
    runner's activations) and its token ids. A budget below it keeps nothing, so the cache counts
    as off (it would cut requests for states it could only copy and drop; counting the GDN state
    alone left budgets up to 2.5x it on, keeping nothing)."""
    gdn_layers = sum(kind == "linear_attention" for kind in config.layer_types)
    attention_layers = sum(kind == "full_attention" for kind in config.layer_types)
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + state // config.linear_key_head_dim
    window = (config.linear_conv_kernel_dim - 1) * conv_dim
    kv = 2 * GRID_TOKENS * config.num_key_value_heads * config.head_dim
    return gdn_layers * (4 * state + itemsize * window) + attention_layers * itemsize * kv + 4 * GRID_TOKENS


def gpu_default_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return int(free * GPU_FREE_FRACTION)


def build_state_cache(
    runner: Any, budget_bytes: int, fingerprint: str, listener: CacheListener | None = None
) -> StateCache | None:
    """A cache for this runner (None if the runner cannot hand states over: the transformers arm)."""
    measure = getattr(runner, "cacheable_state", None)
    if measure is None:
        return None
    return StateCache(
        budget_bytes,
        fingerprint,
        CutRule(anywhere=bool(getattr(runner, "state_cut_anywhere", False))),
        measure,
        deposits_per_segment=DEPOSITS_PER_SEGMENT.get(runner.backend, 2),
        listener=listener,
        # the torch runner's activations are its dtype (fp32 by default), the CUDA runner's bf16
        min_entry_bytes=min_state_bytes(runner.config, getattr(getattr(runner, "dtype", None), "itemsize", 2))
        if hasattr(runner, "config")
        else 1,
    )

"""Launch wrappers for the CUDA kernels in `cuda/*.cu`.

Each `.cu` file is compiled once per process through `cupy.RawModule` (sm_90, C++17; sm_90a for
`tree_attention.cu`, which uses wgmma: `arch_of`), with the
tile geometry of `traits` as compile definitions and the kernels' folder (for the `.cuh` headers) on the
include path. Tensors cross from torch by DLPack (no copies) and every launch goes on torch's
current stream, so the wrappers compose with cuBLAS products issued by torch and can be captured
in a torch CUDA graph. Inputs are torch CUDA tensors; outputs are allocated here unless passed in.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import pathlib

import torch

from openjev.worker.cuda import traits
from openjev.worker.geometry import ATTN_HEAD_DIM, CONV_KERNEL_SIZE, GDN_CHUNK_TOKENS, GDN_HEAD_DIM, ROTARY_DIM_MULTIPLE

# Short names the runner and the launch code use.
CONV_K = CONV_KERNEL_SIZE
GDN_DIM = GDN_HEAD_DIM
GDN_CHUNK = GDN_CHUNK_TOKENS  # chunks of gdn_chunked sit at multiples of it from the sequence start


@functools.cache
def kernel_folder() -> pathlib.Path:
    """The .cu sources: `openjev/kernels` of an installed wheel (package data, a real folder, so
    NVRTC reads the headers from it). An editable install maps the package onto the source
    folders, whose cuda/ has no __init__.py (one would shadow NVIDIA's `cuda` package whenever
    the repository root is on sys.path), so its finder does not resolve it: use the source tree."""
    spec = importlib.util.find_spec("openjev.kernels")
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(next(iter(spec.submodule_search_locations)))
    return pathlib.Path(__file__).resolve().parents[2] / "cuda"


# Modules that use Hopper's architecture-specific instructions (wgmma) compile for sm_90a, whose
# code runs on sm_90 cards only; the others stay plain sm_90.
ARCH_SPECIFIC = frozenset({"tree_attention"})


def arch_of(name: str, family: str = "sm_90") -> str:
    """The -arch value module `name` compiles for: `family`, or sm_90a for the modules that use
    Hopper's wgmma (which no other architecture has: asked for another family, they raise)."""
    if name not in ARCH_SPECIFIC:
        return family
    if family != "sm_90":
        raise ValueError(f"{name}.cu uses Hopper's wgmma: it compiles for sm_90a only, not {family}")
    return "sm_90a"


@functools.cache
def _options(arch: str = "sm_90") -> tuple[str, ...]:
    folder = kernel_folder()
    # CuPy's kernel cache keys on the source and the options, not on included headers: the
    # headers' digest in the options makes an edited header compile anew.
    digest = hashlib.sha256()
    for header in sorted(folder.glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    definitions = (f"-DOPENJEV_HEADERS=0x{digest.hexdigest()[:16]}", *traits.compile_definitions())
    return (f"-arch={arch}", "-std=c++17", f"-I{folder}", *definitions)


def kernel_source(name: str) -> str:
    """The CUDA source of `cuda/{name}.cu` (see kernel_folder)."""
    return (kernel_folder() / f"{name}.cu").read_text(encoding="utf-8")


@functools.cache
def _module(name: str):
    import cupy

    code = kernel_source(name)
    options = _options(arch_of(name))
    try:
        module = cupy.RawModule(code=code, options=options)
        module.compile()  # compile now, so a failure is seen here rather than at first launch
    except cupy.cuda.compiler.CompileException:
        # NVRTC without the toolkit headers: the image's nvcc compiles the same source
        module = cupy.RawModule(code=code, options=options, backend="nvcc")
        module.compile()
    return module


@functools.cache
def _kernel(module: str, name: str, dynamic_smem: int = 0):
    kernel = _module(module).get_function(name)
    if dynamic_smem > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = dynamic_smem
    return kernel


class _StreamPointer:
    """A stream CuPy does not own, by the CUDA stream protocol (what Stream.from_external takes)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def _stream(ptr: int):
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy before it: ExternalStream, which 14.x deprecates
        return cupy.cuda.ExternalStream(ptr)
    return from_external(_StreamPointer(ptr))


def _cp(t: torch.Tensor):
    """Zero-copy CuPy view of a torch CUDA tensor (DLPack)."""
    import cupy

    t = t.detach()
    if t.dtype == torch.bfloat16:
        # kernels only take the pointer; CuPy may not know bf16, int16 has the same layout
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _launch(module: str, name: str, grid, block, args, dynamic_smem: int = 0) -> None:
    import numpy as np

    kernel = _kernel(module, name, dynamic_smem)
    # Convert inside the stream context: DLPack then hands tensors over on torch's own stream,
    # so no cross-stream event is recorded (which would also break CUDA graph capture).
    with _stream(torch.cuda.current_stream().cuda_stream):
        conv = []
        for a in args:
            if isinstance(a, torch.Tensor):
                conv.append(_cp(a))
            elif isinstance(a, bool):
                conv.append(np.int32(int(a)))
            elif isinstance(a, int):
                conv.append(np.int32(a))
            elif isinstance(a, float):
                conv.append(np.float32(a))
            else:
                conv.append(a)  # already a numpy scalar of the right width (np.int64 strides)
        kernel(tuple(grid), tuple(block), tuple(conv), shared_mem=dynamic_smem)


def _i64(x: int):
    import numpy as np

    return np.int64(x)


def _out(given, shape, dtype, device):
    """The caller's output buffer (tests pass NaN-poisoned ones) or a new one."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    assert tuple(given.shape) == tuple(shape) and given.dtype == dtype and given.is_contiguous()
    return given


def causal_conv1d(x, weight, windows, win_src, cu_seqlens, out=None, new_window=None, rows=None):
    """Depthwise causal conv (K = CONV_K = 4) + SiLU over packed segments.

    x: [T, C] bf16 (row stride may exceed C: a column slice of the fused projection)
    weight: [C, 4] bf16; windows: [S, 3, C] bf16 contiguous window rows (a pass's parent slots,
    slot 0 zeros); win_src: [3N] int32, where window row m of segment n is read
    (launch.LaunchPlan.win_src: >= 0 a packed row of x, else row -1 - v of windows flattened to
    [3S, C]; own_windows(N) for one window per segment); cu_seqlens: [N+1] int32.
    rows: output rows a thread (None: traits.CONV.rows(T)); the bits do not depend on it.
    Returns (out [T, C] bf16, new_window [N, 3, C] bf16).
    """
    T, C = x.shape
    N = cu_seqlens.numel() - 1
    assert x.stride(1) == 1 and C % 8 == 0 and weight.is_contiguous() and windows.is_contiguous()
    assert windows.shape[1:] == (CONV_K - 1, C) and win_src.dtype == torch.int32
    assert win_src.numel() == N * (CONV_K - 1) and win_src.is_contiguous()
    out = _out(out, (T, C), torch.bfloat16, x.device)
    new_window = _out(new_window, (N, CONV_K - 1, C), torch.bfloat16, x.device)
    threads, rows = traits.CONV.threads, rows or traits.CONV.rows(T)
    grid = ((C // 8 + threads - 1) // threads, traits.CONV.grid_rows(T, N, rows))
    args = (x, _i64(x.stride(0)), weight, win_src, windows, cu_seqlens, N, T, C, int(rows), out, new_window)
    _launch("conv1d", "causal_conv1d_packed", grid, (threads,), args)
    return out, new_window


def own_windows(num_segments: int, device) -> torch.Tensor:
    """win_src [3N] int32 for causal_conv1d when segment n's window is windows[n] (no in-pass
    parents: tests, benchmarks)."""
    return -1 - torch.arange(num_segments * (CONV_K - 1), dtype=torch.int32, device=device)


def gdn_prepare(conv_out, a, b, A_log, dt_bias, num_k_heads, out=None):
    """conv_out: [T, >= 2*Hk*128] bf16 (q then k columns); a, b: [T, H] bf16 (row-strided views);
    A_log, dt_bias: [H] fp32. Returns qn, kn [T, Hk, 128] fp32 (L2-normed, q times 128^-0.5),
    g, beta [T, H] fp32, kq [T, Hk] fp32 = qn . kn."""
    T = conv_out.shape[0]
    H = a.shape[1]
    assert a.stride(0) == b.stride(0) and a.stride(1) == 1 and b.stride(1) == 1
    dev = conv_out.device
    given = out if out is not None else (None,) * 5
    qn = _out(given[0], (T, num_k_heads, GDN_DIM), torch.float32, dev)
    kn = _out(given[1], (T, num_k_heads, GDN_DIM), torch.float32, dev)
    g = _out(given[2], (T, H), torch.float32, dev)
    beta = _out(given[3], (T, H), torch.float32, dev)
    kq = _out(given[4], (T, num_k_heads), torch.float32, dev)
    if T:
        _launch(
            "gated_delta",
            "gdn_prepare",
            (T,),
            (256,),
            (
                conv_out,
                _i64(conv_out.stride(0)),
                a,
                b,
                _i64(a.stride(0)),
                A_log,
                dt_bias,
                H,
                num_k_heads,
                qn,
                kn,
                g,
                beta,
                kq,
            ),
        )
    return qn, kn, g, beta, kq


# name -> (threads per column group, columns per block, columns per thread)
GDN_VARIANTS = {"s8c16x1": (8, 16, 1), "s8c32x2": (8, 32, 2)}
GDN_DEFAULT = "s8c32x2"  # the fastest variant on an H200 at 64 to 4,096 tokens (docs/cuda-kernels.md)


@functools.cache
def gdn_schedule(device: torch.device) -> tuple[torch.Tensor, int]:
    """(the work-ticket counters of the recurrence and of the chunked kernels, zeros between
    launches; the device's SM count). Made at a runner's start (CudaRunner), not while a graph is
    captured. One set a device: launches that take tickets must not overlap (the worker runs its
    passes on one stream)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(2 + traits.GDN_SCHED_SMS, dtype=torch.int32, device=device), sms


_GDN_MOST_COLUMN_BLOCKS = GDN_DIM // min(cols for _, cols, _ in GDN_VARIANTS.values())  # flags a head
_GDN_DEPS: dict[int, torch.Tensor] = {}
_GDN_DEPS_KEPT: list[torch.Tensor] = []  # a graph captured with an outgrown one still uses it


def gdn_dependencies(device: torch.device, segments: int, heads: int) -> torch.Tensor:
    """The recurrence's launch count and per-item done flags (gated_delta.cu, `deps`) for passes of
    up to `segments` segments of `heads` value heads, in any variant; one set a device, grown when
    a launch needs more. Made at a runner's start for its largest pass (CudaRunner), not while a
    graph is captured."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    entries = 1 + segments * heads * _GDN_MOST_COLUMN_BLOCKS
    have = _GDN_DEPS.get(index)
    if have is None or have.numel() < entries:
        if torch.cuda.is_current_stream_capturing():  # its zero fill would be part of the graph
            raise RuntimeError(f"gdn_dependencies: {segments} segments need a larger buffer while a graph is captured")
        have = torch.zeros(entries, dtype=torch.int64, device=device)
        _GDN_DEPS[index] = have
        _GDN_DEPS_KEPT.append(have)
    return have


def gdn_recurrent(
    qn,
    kn,
    kq,
    v,
    g,
    beta,
    cu_seqlens,
    init_state=None,
    variant: str = GDN_DEFAULT,
    out=None,
    final=None,
    init_idx=None,
    level_off=None,
    level: int = 0,
    levels: int = 1,
):
    """Gated delta rule over packed segments.

    qn, kn: [T, Hk, 128] fp32; kq: [T, Hk] fp32 (qn . kn); v: [T, H, 128] bf16 view (token stride
    free, inner contiguous); g, beta: [T, H] fp32; cu_seqlens: [N+1] int32;
    init_state: [*, H, 128, 128] fp32 (dim 0 may be strided) or None (zeros).
    Forest passes (segments ordered by level, all on the same grid):
    init_idx: [N] int32 or None (row n of init_state, or zeros without it): >= 0 a row of
    init_state, -1 zeros, <= -2 row -2 - i of `final` (an in-pass parent: finished by an earlier
    launch, or by this one before the child's items start);
    level_off: [levels + 1] int32 or None ([0, N]); this launch runs the non-empty segments
    level_off[level] .. level_off[level + levels] - 1 (a child after its parent), the others' rows
    of out and final are left as they are.
    Returns (o [T, H, 128] bf16, final_state [N, H, 128, 128] fp32).
    """
    T, H = g.shape
    Hk = qn.shape[1]
    N = cu_seqlens.numel() - 1
    assert v.stride(2) == 1 and v.stride(1) == GDN_DIM and H % Hk == 0
    parts, cols, per_thread = GDN_VARIANTS[variant]
    assert v.data_ptr() % 16 == 0 and v.stride(0) % 8 == 0, "v rows must be 16-byte aligned (cp.async)"
    dev = g.device
    out = _out(out, (T, H, GDN_DIM), torch.bfloat16, dev)
    final = _out(final, (N, H, GDN_DIM, GDN_DIM), torch.float32, dev)
    if init_idx is None:
        init_idx = (
            torch.arange(N, dtype=torch.int32, device=dev)
            if init_state is not None
            else torch.full((N,), -1, dtype=torch.int32, device=dev)
        )
    if level_off is None:  # [0, N], made on the device: capturable
        level_off = torch.arange(0, 2 * N, max(N, 1), dtype=torch.int32, device=dev)[:2]
    assert init_idx.dtype == torch.int32 and level_off.dtype == torch.int32
    if init_state is None:
        init, stride = final, 0  # never read: no init_idx is >= 0 then
    else:
        assert init_state.shape[1:] == (H, GDN_DIM, GDN_DIM) and init_state[0].is_contiguous()
        init, stride = init_state, init_state.stride(0)
    sched, sms = gdn_schedule(dev)
    deps = gdn_dependencies(dev, N, H)
    _launch(
        "gated_delta",
        f"gdn_recurrent_{variant}",
        (4 * sms,),  # every resident slot at 4 blocks an SM; workers take the items (gated_delta.cu)
        (cols // per_thread * parts,),
        (
            qn,
            kn,
            kq,
            v,
            _i64(v.stride(0)),
            g,
            beta,
            cu_seqlens,
            H,
            Hk,
            init,
            _i64(stride),
            init_idx,
            level_off,
            level,
            level + levels,
            sched,
            sms,
            deps,
            out,
            final,
        ),
    )
    return out, final


# Passes of at most this many query tokens a segment take tree attention's pipelined form (the
# same bits): 1.06-1.26x faster for a few query rows under a long cached context, 1.08x slower
# on a whole 512-token prompt, 1.32x at 4,096 (cuda/tree_attention.cu, docs/cuda-kernels.md)
ATTN_PIPELINED_MAX_Q = 256


def attention_tiles(cu_q, Tq: int, G: int) -> torch.Tensor:
    """tree_attention's work list for segments cu_q [N+1] int32 of Tq query rows in all and G
    query heads a KV head (tree_attention.cu, attention_tile_plan); made on the device, so
    capturable; a pass's attention layers share it."""
    N = cu_q.numel() - 1
    slots = (Tq * G + traits.ATTENTION.block_q - 1) // traits.ATTENTION.block_q + N
    tiles = torch.empty(slots, dtype=torch.int32, device=cu_q.device)
    threads = traits.ATTENTION.plan_threads
    _launch("tree_attention", "attention_tile_plan", (1,), (threads,), (cu_q, N, G, slots, tiles))
    return tiles


def tree_attention(q, k_pool, v_pool, kv_rows, cu_q, cu_k, max_q_len, gate=None, out=None, pipelined=None, tiles=None):
    """Causal GQA attention over packed segments whose keys are rows of shared K/V pools.

    q: [Tq, Hq, 256] bf16; k_pool, v_pool: [P, Hkv, 256] bf16; kv_rows: [cu_k[-1]] int32;
    cu_q, cu_k: [N+1] int32 (segment n: T_n queries, S_n >= T_n keys, own keys last);
    gate: [Tq, Hq, 256] bf16 view or None (output times sigmoid(gate)); pipelined: the kernel's
    form (None: pipelined up to ATTN_PIPELINED_MAX_Q query tokens; both give the same bits);
    tiles: attention_tiles(cu_q, Tq, Hq // Hkv) (None: made here). Returns [Tq, Hq, 256] bf16.
    """
    Tq, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    assert D == ATTN_HEAD_DIM and q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()
    out = _out(out, q.shape, torch.bfloat16, q.device)
    if gate is None:
        gate_t, st, sh, has_gate = q, 0, 0, False
    else:
        assert gate.stride(2) == 1
        gate_t, st, sh, has_gate = gate, gate.stride(0), gate.stride(1), True
    geo = traits.ATTENTION
    # a block's rows are (token, head) pairs of the Hq / Hkv heads that share one KV head; a
    # block a listed tile of a segment
    if tiles is None:
        tiles = attention_tiles(cu_q, Tq, Hq // Hkv)
    grid = (tiles.numel(), Hkv, 1)
    if pipelined is None:
        pipelined = max_q_len <= ATTN_PIPELINED_MAX_Q
    _launch(
        "tree_attention",
        "tree_attention_fwd_pipelined" if pipelined else "tree_attention_fwd",
        grid,
        (geo.threads,),
        (
            q,
            k_pool,
            v_pool,
            kv_rows,
            cu_q,
            cu_k,
            Hq,
            Hkv,
            1.0 / math.sqrt(D),
            gate_t,
            _i64(st),
            _i64(sh),
            has_gate,
            tiles,
            out,
        ),
        dynamic_smem=geo.launch_bytes(pipelined),
    )
    return out


def add_rms_norm(residual, weight, eps, x_add=None, row_idx=None, out=None):
    """residual: [T, D] bf16 (updated in place to residual + x_add when no row_idx);
    x_add: [T, D] bf16 or None; row_idx: [R] int32 or None; weight: [D] bf16.
    Returns (normed [R, D] bf16, residual_rows [R, D] bf16) with R = T without row_idx."""
    T, D = residual.shape
    assert D % 8 == 0 and D <= 8192 and residual.is_contiguous()
    R = T if row_idx is None else row_idx.numel()
    out = _out(out, (R, D), torch.bfloat16, residual.device)
    res_out = residual if row_idx is None else torch.empty_like(out)
    if R:
        _launch(
            "fused_ops",
            "add_rms_norm",
            (R,),
            (256,),
            (
                x_add if x_add is not None else residual,
                x_add is not None,
                residual,
                row_idx if row_idx is not None else _dummy_idx(residual.device),
                row_idx is not None,
                weight,
                float(eps),
                D,
                res_out,
                out,
            ),
        )
    return out, res_out


@functools.lru_cache(maxsize=8)
def _dummy_idx(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


def gated_rms_norm(x, z, weight, eps, out=None):
    """x: [T, H, 128] bf16; z: [T, H*128] bf16 view (row stride free); weight: [128] bf16.
    Returns [T, H*128] bf16 = rmsnorm(x) * weight * silu(z)."""
    T, H, Dv = x.shape
    assert Dv == GDN_DIM and x.is_contiguous() and z.stride(1) == 1
    out = _out(out, (T, H * Dv), torch.bfloat16, x.device)
    jobs = T * H
    if jobs:
        _launch(
            "fused_ops",
            "gated_rms_norm",
            ((jobs + 7) // 8,),
            (256,),
            (x, z, _i64(z.stride(0)), weight, float(eps), T, H, out),
        )
    return out


def rotary_table(positions, rotary_dim, theta):
    """cos, sin: [T, rotary_dim/2] fp32 for positions [T] (int), built in fp32 the way
    transformers builds them (inv_freq = 1 / theta^(2j/rotary_dim); angle = position * inv_freq)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().contiguous(), angles.sin().contiguous()


def qk_norm_rope(src, weight, cos, sin, eps, dst=None, dst_row0=0):
    """src: [T, H, 256] bf16 view (inner dim contiguous); weight: [256] bf16;
    cos, sin: [T, rotary_dim/2] fp32 (rotary_table). Per-head RMSNorm (1 + w), then rotate-half
    rotary on the first rotary_dim dims. Writes rows dst_row0 .. dst_row0+T-1 of dst
    ([*, H, 256] bf16, new if None); returns dst."""
    T, H, D = src.shape
    rotary_dim = 2 * cos.shape[1]
    assert D == ATTN_HEAD_DIM and src.stride(2) == 1 and rotary_dim % ROTARY_DIM_MULTIPLE == 0 and cos.shape[0] == T
    if dst is None:
        dst = torch.empty(T, H, D, dtype=torch.bfloat16, device=src.device)
    assert dst.is_contiguous() and dst.shape[1] == H
    jobs = T * H
    if jobs:
        _launch(
            "fused_ops",
            "qk_norm_rope",
            ((jobs + 7) // 8,),
            (256,),
            (
                src,
                _i64(src.stride(0)),
                _i64(src.stride(1)),
                weight,
                cos,
                sin,
                rotary_dim,
                float(eps),
                T,
                H,
                dst,
                _i64(dst_row0),
            ),
        )
    return dst


def silu_mul(gate_up, out=None):
    """gate_up: [T, 2I] bf16 -> [T, I] bf16 = silu(gate) * up."""
    T, I2 = gate_up.shape
    inter = I2 // 2
    assert gate_up.is_contiguous() and inter % 8 == 0
    out = _out(out, (T, inter), torch.bfloat16, gate_up.device)
    vecs = T * inter // 8
    if vecs:
        _launch("fused_ops", "silu_mul", ((vecs + 255) // 256,), (256,), (gate_up, T, inter, out))
    return out


def gather_rows(src, idx, out=None):
    """src: [*, D] bf16 contiguous; idx: [R] int32 -> [R, D] bf16."""
    D = src.shape[1]
    R = idx.numel()
    out = _out(out, (R, D), torch.bfloat16, src.device)
    if R:
        _launch("fused_ops", "gather_rows", ((D // 8 + 127) // 128, R), (128,), (src, idx, R, D, out))
    return out

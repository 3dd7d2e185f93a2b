"""Packed PyTorch references of the CUDA kernels, built on the per-segment math in
`openjev.worker.model.ops` (the readable statement of the model). Each takes the same packed
tensors as its kernel, loops over segments, and computes in fp32 on whatever device the inputs
are on (tests move them to the CPU, where the rotary tables are built).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.model import ops


def _spans(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def conv_windows(x: Tensor, windows: Tensor, win_src: Tensor) -> Tensor:
    """Each segment's incoming conv window [N, 3, C], read as causal_conv1d_packed reads it: window
    row m of segment n is x[v] for v = win_src[3n + m] >= 0, else row -1 - v of windows [S, 3, C]
    flattened to [3S, C]."""
    flat = windows.reshape(-1, windows.shape[-1])
    rows = [x[v] if v >= 0 else flat[-1 - v] for v in win_src.tolist()]
    return torch.stack(rows).reshape(-1, 3, x.shape[1])


def causal_conv1d_packed(
    x: Tensor, weight: Tensor, windows: Tensor, win_src: Tensor, cu_seqlens: Tensor
) -> tuple[Tensor, Tensor]:
    """x: [T, C]; weight: [C, 4]; windows: [S, 3, C], win_src: [3N] (conv_windows); cu_seqlens: [N+1].
    Returns (out [T, C] fp32, new_window [N, 3, C] in x.dtype)."""
    window = conv_windows(x, windows, win_src)
    outs, new_windows = [], []
    for n, (s, e) in enumerate(_spans(cu_seqlens)):
        o, w = ops.causal_conv1d(x[s:e].float(), weight.float(), window[n].float())
        outs.append(o)
        new_windows.append(w.to(x.dtype))
    return torch.cat(outs), torch.stack(new_windows)


def gdn_prepare(
    conv_out: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, num_k_heads: int, dk: int = 128
):
    """conv_out: [T, >= 2*Hk*dk] (q then k columns); a, b: [T, H]; a_log, dt_bias: [H] fp32.
    Returns qn, kn [T, Hk, dk] fp32 (L2-normed; q times dk^-0.5), g, beta [T, H] fp32,
    kq [T, Hk] fp32 = qn . kn."""
    T = conv_out.shape[0]
    key_dim = num_k_heads * dk
    q = ops.l2_normalize(conv_out[:, :key_dim].float().reshape(T, num_k_heads, dk)) * dk**-0.5
    k = ops.l2_normalize(conv_out[:, key_dim : 2 * key_dim].float().reshape(T, num_k_heads, dk))
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, g, torch.sigmoid(b.float()), (q * k).sum(-1)


def gdn_packed(qn, kn, v, g, beta, cu_seqlens, init_state=None):
    """qn, kn: [T, Hk, Dk] fp32; v: [T, H, Dv]; g, beta: [T, H]; init_state: [N, H, Dk, Dv] or None.
    Returns (o [T, H, Dv] fp32, final_state [N, H, Dk, Dv] fp32). GDN_CHUNK_TOKENS-token chunks per segment."""
    ratio = v.shape[1] // qn.shape[1]
    q, k = qn.repeat_interleave(ratio, dim=1), kn.repeat_interleave(ratio, dim=1)
    outs, states = [], []
    for n, (s, e) in enumerate(_spans(cu_seqlens)):
        o, st = ops.gated_delta_rule(
            q[s:e], k[s:e], v[s:e].float(), g[s:e], beta[s:e], None if init_state is None else init_state[n]
        )
        outs.append(o)
        states.append(st)
    return torch.cat(outs), torch.stack(states)


def gdn_chunked_packed(
    qn, kn, v, g, beta, cu_seqlens, positions, init_state=None, tail_in=None, chunk=GDN_CHUNK_TOKENS
):
    """Same arguments as chunked_gdn.gdn_chunked, but tail rows all fp32: k [Hk*Dk] | v [H*Dv] | g [H] |
    beta [H] (the kernels keep v in bf16: chunked_gdn.unpack_tails gives these rows from theirs).
    Each segment's rows are its tail (positions[cu[n]] % chunk rows of tail_in[n]) then its own;
    from its parent's state they run through chunks counted from the first tail row.
    Returns (o [T, H, Dv] fp32 of the own rows, final [N, H, Dk, Dv] fp32 at the last chunk
    boundary, tail_out: per segment the [rows, width] rows after that boundary)."""
    T, Hk, Dk = qn.shape
    H, Dv = v.shape[1], v.shape[2]
    ratio = H // Hk
    outs, finals, tails = [], [], []
    for n, (s, e) in enumerate(_spans(cu_seqlens)):
        tail = int(positions[s]) % chunk
        rows = tail_in[n, :tail].float() if tail else qn.new_zeros(0, (Hk + H) * Dk + 2 * H)
        k = torch.cat([rows[:, : Hk * Dk].reshape(tail, Hk, Dk), kn[s:e].float()])
        vv = torch.cat([rows[:, Hk * Dk : Hk * Dk + H * Dv].reshape(tail, H, Dv), v[s:e].float()])
        gg = torch.cat([rows[:, Hk * Dk + H * Dv : Hk * Dk + H * Dv + H], g[s:e].float()])
        bb = torch.cat([rows[:, Hk * Dk + H * Dv + H : Hk * Dk + H * Dv + 2 * H], beta[s:e].float()])
        q = torch.cat([qn.new_zeros(tail, Hk, Dk), qn[s:e].float()])  # tail rows' outputs are the parent's
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        state = None if init_state is None else init_state[n].float()
        done = (k.shape[0] // chunk) * chunk
        o1, st = ops.gated_delta_rule(q[:done], k[:done], vv[:done], gg[:done], bb[:done], state, chunk)
        o2, _ = ops.gated_delta_rule(q[done:], k[done:], vv[done:], gg[done:], bb[done:], st, chunk)
        outs.append(torch.cat([o1, o2])[tail:])
        finals.append(st)
        kk = k[done:, ::ratio].reshape(-1, Hk * Dk)
        tails.append(torch.cat([kk, vv[done:].reshape(-1, H * Dv), gg[done:], bb[done:]], dim=1))
    return torch.cat(outs), torch.stack(finals), tails


def tree_attention(q, k_pool, v_pool, kv_rows, cu_q, cu_k, gate=None) -> Tensor:
    """Same arguments as kernels.tree_attention. Returns [Tq, Hq, D] fp32."""
    out = []
    rows = kv_rows.long()
    for (qs, qe), (ks, ke) in zip(_spans(cu_q), _spans(cu_k), strict=True):
        idx = rows[ks:ke]
        keys, values = k_pool[idx].float(), v_pool[idx].float()
        o = ops.attention(q[qs:qe].float(), keys, values, q_offset=(ke - ks) - (qe - qs))
        if gate is not None:
            o = o * torch.sigmoid(gate[qs:qe].float())
        out.append(o)
    return torch.cat(out)


def add_rms_norm(residual, weight, eps, x_add=None, row_idx=None) -> tuple[Tensor, Tensor]:
    """Returns (normed [R, D] fp32, residual rows [R, D] in residual.dtype)."""
    r = residual if x_add is None else (residual.float() + x_add.float()).to(residual.dtype)
    if row_idx is not None:
        r = r[row_idx.long()]
    return ops.rms_norm(r.float(), weight, eps), r


def gated_rms_norm(x, z, weight, eps) -> Tensor:
    """x: [T, H, Dv] bf16; z: [T, H*Dv]. Returns [T, H*Dv] fp32 (the norm rounded like the model)."""
    T, H, Dv = x.shape
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
    return (weight.float() * normed * F.silu(z.reshape(T, H, Dv).float())).reshape(T, H * Dv)


def qk_norm_rope(src, weight, positions, rotary_dim, theta, eps) -> Tensor:
    """src: [T, H, D]; positions: [T]. Per-head RMSNorm (1 + w) rounded to src.dtype, then
    rotary in fp32. Returns [T, H, D] fp32."""
    normed = ops.rms_norm(src, weight, eps).float()
    return ops.apply_rotary(normed, positions.long(), rotary_dim, theta)


def silu_mul(gate_up: Tensor) -> Tensor:
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()

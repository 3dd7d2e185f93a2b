"""The plain PyTorch math of the Qwen3.5 hybrid backbone, one segment at a time, unbatched.

These are the references the CUDA kernels are tested against: keep them readable and exact.
Where transformers rounds in a particular order (rotary tables, norm dtypes) we follow it, since
transformers is the oracle within 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from openjev.worker.geometry import GDN_CHUNK_TOKENS

# transformers' l2norm epsilon (matching flash-linear-attention), added to the squared norm.
L2NORM_EPS = 1e-6


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + weight).
    x: [..., D] any float (e.g. [T, D], or [T, H, Dh] per head); weight: [D]. Computes in fp32,
    returns x.dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The GDN output norm: RMSNorm over Dv times `weight` (plain w, not 1 + w: its weights are
    initialised to ones) times silu(gate).
    x, gate: [T, H, Dv]; weight: [Dv]. Computes in fp32, returns x.dtype."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def l2_normalize(x: Tensor) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim. x: [..., D] fp32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def rotary_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, rotary_dim] fp32 for positions [T] int64, half-split layout (rotate-half).
    Built in fp32 exactly as transformers builds them, so long positions round alike."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, positions: Tensor, rotary_dim: int, theta: float) -> Tensor:
    """Rotary embedding on the first rotary_dim dims of each head, rotate-half convention.
    x: [T, H, D]; positions: [T] int64. Returns [T, H, D] in x.dtype."""
    cos, sin = rotary_cos_sin(positions.to(x.device), rotary_dim, theta)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated_half * sin, x_pass], dim=-1)


def causal_conv1d(x: Tensor, weight: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU, continuing from the previous inputs.
    x: [T, C]; weight: [C, K] (tap K-1 multiplies the current input); window: [K-1, C], the
    K-1 inputs before x (None: zeros, the start of a prompt).
    Returns (silu(conv(x)) [T, C] in x.dtype, new window [K-1, C] = the last K-1 inputs)."""
    num_taps = weight.shape[1]
    if window is None:
        window = x.new_zeros(num_taps - 1, x.shape[1])
    padded = torch.cat([window.to(x.dtype), x], dim=0)  # [T + K - 1, C]
    taps = padded.unfold(0, num_taps, 1)  # [T, C, K]: taps[t, c, j] = padded[t + j, c]
    out = (taps * weight[None]).sum(-1)
    return F.silu(out), padded[-(num_taps - 1) :].clone()


def gated_delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token: the plainest statement of the math.
    q, k: [T, H, Dk] (q already scaled); v: [T, H, Dv]; g: [T, H] log decay; beta: [T, H];
    state: [H, Dk, Dv] fp32 or None (zeros). Per token:
        S <- e^g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Returns (o [T, H, Dv] in v.dtype, final state [H, Dk, Dv] fp32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    num_heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    s = q.new_zeros(num_heads, key_dim, value_dim) if state is None else state.float().clone()
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        update = beta[t][:, None] * (v[t] - predicted)
        s = s + k[t][:, :, None] * update[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def _delta_rule_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of the gated delta rule in matrix form (WY / UT transform).
    q, k: [H, C, Dk]; v: [H, C, Dv]; g, beta: [H, C]; s: [H, Dk, Dv]; all fp32.

    Within the chunk, with G_t = sum_{j<=t} g_j and u_t the value written at step t:
        S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t - G_j} k_j u_j^T
        u_t = beta_t (v_t - e^{G_t} S_0^T k_t - sum_{j<t} e^{G_t - G_j} (k_t.k_j) u_j)
    so (I + A) U = beta V - beta e^G K S_0 with A strictly lower triangular; one triangular
    solve gives all u_t, then outputs and the end state are matrix products."""
    chunk_len = q.shape[1]
    cum_g = g.cumsum(-1)  # [H, C]
    causal = torch.ones(chunk_len, chunk_len, dtype=torch.bool, device=q.device).tril()
    # decay[h, t, j] = e^{G_t - G_j} for j <= t; masked before exp so j > t cannot overflow.
    decay = (cum_g[:, :, None] - cum_g[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_below = torch.ones(chunk_len, chunk_len, dtype=torch.bool, device=q.device).tril(-1)
    # A[h, t, j] = beta_t e^{G_t - G_j} (k_t . k_j) for j < t.
    strictly_lower = (beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_below, 0.0)
    system = strictly_lower + torch.eye(chunk_len, device=q.device)
    rhs = beta[:, :, None] * (v - (cum_g.exp()[:, :, None] * k) @ s)  # [H, C, Dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, C, C], zero above the diagonal
    out = (cum_g.exp()[:, :, None] * q) @ s + scores @ u
    end_decay = (cum_g[:, -1:] - cum_g).exp()  # e^{G_C - G_j}: [H, C]
    s_end = cum_g[:, -1].exp()[:, None, None] * s + (end_decay[:, :, None] * k).transpose(-1, -2) @ u
    return out, s_end


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk_size: int = GDN_CHUNK_TOKENS
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over chunks of chunk_size tokens counted from the segment start.
    q, k: [T, H, Dk] (L2-normalized, q scaled by Dk^-0.5, k heads repeated to the v heads);
    v: [T, H, Dv]; g: [T, H] log decay (<= 0); beta: [T, H]; state: [H, Dk, Dv] fp32 or None.
    Returns (o [T, H, Dv] in v.dtype, final state [H, Dk, Dv] fp32). fp32 math throughout."""
    # Head-major fp32 copies: [H, T, D] and [H, T].
    qh, kh, vh = (t.float().transpose(0, 1) for t in (q, k, v))
    gh, betah = g.float().T, beta.float().T
    num_heads, seq_len, key_dim = kh.shape
    s = qh.new_zeros(num_heads, key_dim, vh.shape[-1]) if state is None else state.float()
    outs = []
    for start in range(0, seq_len, chunk_size):
        chunk = slice(start, min(start + chunk_size, seq_len))
        o, s = _delta_rule_chunk(qh[:, chunk], kh[:, chunk], vh[:, chunk], gh[:, chunk], betah[:, chunk], s)
        outs.append(o)
    out = torch.cat(outs, dim=1) if outs else vh.new_zeros(vh.shape)
    return out.transpose(0, 1).to(v.dtype), s


# Query rows per attention block, counted from the segment's start. Equal to the GDN chunk so that
# cutting a segment at a multiple of 64 tokens from its start leaves every block (and so every
# bit) where it was: the state cache cuts there (openjev.worker.cache.keys).
ATTENTION_BLOCK_ROWS = GDN_CHUNK_TOKENS


def attention(q: Tensor, k: Tensor, v: Tensor, q_offset: int, block_rows: int = ATTENTION_BLOCK_ROWS) -> Tensor:
    """Causal GQA attention of a segment's queries over its ancestors' keys and its own.
    q: [T, Hq, D]; k, v: [S, Hkv, D] with S = q_offset + T (ancestors first). Query i sees
    keys 0..q_offset+i. Query head h reads kv head h // (Hq / Hkv). Scale D^-0.5.
    Returns [T, Hq, D] in q.dtype (softmax in fp32). Queries go block_rows at a time so the score
    matrix stays [Hq, block_rows, S] even for 16k-token prompts; a query's bits depend on its block."""
    seq_len, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    if num_keys != q_offset + seq_len:
        raise ValueError(f"attention: {num_keys} keys, expected q_offset + T = {q_offset + seq_len}")
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for first in range(0, seq_len, block_rows):
        last = min(first + block_rows, seq_len)
        visible = q_offset + last  # keys beyond the block's last query are masked for every row
        scores = torch.einsum("thd,shd->hts", q[first:last], k[:visible]) * head_dim**-0.5
        query_pos = torch.arange(first, last, device=q.device) + q_offset
        key_pos = torch.arange(visible, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[first:last] = torch.einsum("hts,shd->thd", weights, v[:visible])
    return out


def head_score(hidden: Tensor, weight: Tensor, bias: float) -> float:
    """The scalar head: hidden [D] (after the final norm) . weight [D] fp32, products and sum in
    fp64, rounded to fp32, plus the fp32 bias in fp32. Returns the fp32 value as a float."""
    dot = (hidden.double() * weight.double()).sum().to(torch.float32)
    return float(dot + torch.tensor(bias, dtype=torch.float32))

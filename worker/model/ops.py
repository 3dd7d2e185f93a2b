"""The plain PyTorch math of the Qwen3.5 hybrid backbone, one segment at a time, unbatched.

These are the references the CUDA kernels are tested against: keep them readable and exact.
Where transformers rounds in a particular order (rotary tables, norm dtypes) we follow it, since
transformers is the oracle within 1e-4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from openjev.worker.geometry import GDN_CHUNK_TOKENS

# transformers' l2norm epsilon (matching flash-linear-attention), added to the squared norm.
L2NORM_EPS = 1e-6


# torch's CPU sigmoid, silu and softplus can round an element differently in the vectorised body
# and in the scalar tail of a thread's share, and with 3 or more threads the shares' ends move
# with the tensor's size: a row's bits then depend on what shares its pass (seen 2026-12-01).
# exp, log1p and the IEEE operations round alike in both paths, so these three are built from them
# (in fp32, rounded once to the input's dtype).
def sigmoid(x: Tensor) -> Tensor:
    return torch.reciprocal(1.0 + torch.exp(-x.float())).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def softplus(x: Tensor) -> Tensor:
    """torch's default: x above 20, else log(1 + e^x)."""
    x32 = x.float()
    return torch.where(x32 > 20.0, x32, torch.log1p(torch.exp(x32))).to(x.dtype)


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
    return (weight * normed * silu(gate.float())).to(x.dtype)


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
    return rotate(x, cos, sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rotary with the tables given: cos, sin [T, rotary_dim] of x's positions."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated_half * sin, x_pass], dim=-1)


def conv_taps(shifted: Sequence[Tensor], weight: Tensor) -> Tensor:
    """silu(sum_j shifted[j] * weight[:, j]), summed in tap order by separate elementwise products
    and additions, so an element's bits depend only on its own inputs (however many rows share
    the call). shifted[j]: [T, C], the inputs K-1-j steps back; weight: [C, K]."""
    taps = weight.T.contiguous()  # a column weight[:, j] is strided: multiplying by it is ~5x slower
    out = shifted[0] * taps[0]
    for j in range(1, len(taps)):
        out = out + shifted[j] * taps[j]
    return silu(out)


def causal_conv1d(x: Tensor, weight: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv + SiLU, continuing from the previous inputs.
    x: [T, C]; weight: [C, K] (tap K-1 multiplies the current input); window: [K-1, C], the
    K-1 inputs before x (None: zeros, the start of a prompt).
    Returns (silu(conv(x)) [T, C] in x.dtype, new window [K-1, C] = the last K-1 inputs)."""
    num_taps, seq_len = weight.shape[1], x.shape[0]
    if window is None:
        window = x.new_zeros(num_taps - 1, x.shape[1])
    padded = torch.cat([window.to(x.dtype), x], dim=0)  # [T + K - 1, C]
    out = conv_taps([padded[j : j + seq_len] for j in range(num_taps)], weight)
    return out, padded[padded.shape[0] - (num_taps - 1) :].clone()  # K = 1: empty, not [-0:]


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


def delta_rule_chunk(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One chunk of the gated delta rule in matrix form (WY / UT transform).
    q, k: [H, C, Dk]; v: [H, C, Dv]; g, beta: [H, C]; s: [H, Dk, Dv] or None (zeros); all fp32.
    H may be segments x heads (delta_batches.py): every op works head by head.

    Within the chunk, with G_t = sum_{j<=t} g_j and u_t the value written at step t:
        S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t - G_j} k_j u_j^T
        u_t = beta_t (v_t - e^{G_t} S_0^T k_t - sum_{j<t} e^{G_t - G_j} (k_t.k_j) u_j)
    so (I + A) U = beta V - beta e^G K S_0 with A strictly lower triangular; one triangular
    solve gives all u_t, then outputs and the end state are matrix products. With S_0 = 0 (a
    prompt's first chunk) its terms are left out: adding zeros would change no bit."""
    # torch.bmm and in-place steps: the products and roundings of the plain expressions, without
    # matmul's dispatch and the temporaries (a chunk's ops are tiny, so their overhead is its cost)
    cum_g = g.cumsum(-1)  # [H, C]
    # decay[h, t, j] = e^{G_t - G_j} for j <= t, zero above the diagonal. There (j > t) the
    # exponent is >= 0 and may overflow to inf: tril_ overwrites it (never multiplies it), so no
    # NaN, and the kept entries are the same exponentials (cheaper than masking before exp).
    decay = (cum_g[:, :, None] - cum_g[:, None, :]).exp_().tril_()
    k_t = k.transpose(-1, -2)
    # A[h, t, j] = beta_t e^{G_t - G_j} (k_t . k_j) for j < t. The unitriangular solve reads only
    # below the diagonal (it takes the diagonal as one), so what lies on it needs no masking.
    beta_col = beta[:, :, None]
    strictly_lower = torch.bmm(k, k_t).mul_(beta_col).mul_(decay)
    if s is None:
        rhs = beta_col * v
    else:
        start_decay = cum_g.exp()[:, :, None]  # e^{G_t}: [H, C, 1]
        rhs = beta_col * (v - torch.bmm(start_decay * k, s))  # [H, C, Dv]
    # solved as U^T (I + A)^T = rhs^T: the same system, 1.2-2.5x faster on CPU at these sizes
    # (torch passes the transposed views to BLAS without copying them to column-major first)
    u = torch.linalg.solve_triangular(strictly_lower.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    scores = torch.bmm(q, k_t).mul_(decay)  # [H, C, C], zero above the diagonal
    out = torch.bmm(scores, u) if s is None else torch.bmm(start_decay * q, s) + torch.bmm(scores, u)
    end_decay = (cum_g[:, -1:] - cum_g).exp_()  # e^{G_C - G_j}: [H, C]
    s_end = torch.bmm((end_decay[:, :, None] * k).transpose(-1, -2), u)
    if s is not None:
        # e^{G_C} taken from the [H, C] exponentials, not a separate exp of H values: a batch's
        # [H] vector would fall in an elementwise kernel's scalar tail (see delta_batches.py)
        s_end = start_decay[:, -1:] * s + s_end
    return out, s_end


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk_size: int = GDN_CHUNK_TOKENS
) -> tuple[Tensor, Tensor]:
    """The gated delta rule over chunks of chunk_size tokens counted from the segment start.
    q, k: [T, H, Dk] (L2-normalized, q scaled by Dk^-0.5, k heads repeated to the v heads);
    v: [T, H, Dv]; g: [T, H] log decay (<= 0); beta: [T, H]; state: [H, Dk, Dv] fp32 or None.
    Returns (o [T, H, Dv] in v.dtype, final state [H, Dk, Dv] fp32). fp32 math throughout."""
    qh, kh, vh = (t.float().transpose(0, 1).contiguous() for t in (q, k, v))
    out, s = gated_delta_rule_heads(
        qh, kh, vh, g.float().T.contiguous(), beta.float().T.contiguous(), state, chunk_size
    )
    return out.transpose(0, 1).to(v.dtype), s


def gated_delta_rule_heads(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk_size: int = GDN_CHUNK_TOKENS
) -> tuple[Tensor, Tensor]:
    """gated_delta_rule on head-major fp32 inputs: q, k [H, T, Dk]; v [H, T, Dv]; g, beta [H, T].
    Returns (o [H, T, Dv] fp32, final state [H, Dk, Dv] fp32)."""
    num_heads, seq_len, key_dim = k.shape
    if seq_len == 0:
        return v.new_zeros(v.shape), v.new_zeros(num_heads, key_dim, v.shape[-1]) if state is None else state.float()
    s = None if state is None else state.float()
    outs = []
    for start in range(0, seq_len, chunk_size):
        chunk = slice(start, min(start + chunk_size, seq_len))
        o, s = delta_rule_chunk(q[:, chunk], k[:, chunk], v[:, chunk], g[:, chunk], beta[:, chunk], s)
        outs.append(o)
    assert s is not None
    return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]), s


# Query rows per attention block, counted from the segment's start. Equal to the GDN chunk so that
# cutting a segment at a multiple of 64 tokens from its start leaves every block (and so every
# bit) where it was: the state cache cuts there (openjev.worker.cache.keys).
ATTENTION_BLOCK_ROWS = GDN_CHUNK_TOKENS


_FUTURE: dict[tuple[int, torch.device], Tensor] = {}


def _future(rows: int, device: torch.device) -> Tensor:
    """[rows, rows] bool, True above the diagonal (key after query), built once per size."""
    mask = _FUTURE.get((rows, device))
    if mask is None:
        mask = _FUTURE[(rows, device)] = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
    return mask


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
    # Grouped queries: the `group` query heads of one kv head are stacked as rows of one product
    # against that head's keys, so keys and values are laid out head-major once, never repeated.
    keys = k.transpose(0, 1).contiguous()  # [Hkv, S, D]
    values = v.transpose(0, 1).contiguous()
    out = torch.empty_like(q)
    for first in range(0, seq_len, block_rows):
        last = min(first + block_rows, seq_len)
        rows, visible = last - first, q_offset + last  # keys beyond the block's last query are masked for every row
        grouped = q[first:last].reshape(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        # [Hkv, group * rows, D]: kv head j's row i * rows + t is query head j * group + i, token t
        grouped = grouped.reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(grouped, keys[:, :visible].transpose(-1, -2)).mul_(head_dim**-0.5)
        scores = scores.unflatten(1, (group, rows))  # [Hkv, group, rows, visible]
        # every row sees every key before the block's first query: only the block's own keys can
        # lie after a query, so only those columns are masked (none for a single query)
        if rows > 1:
            scores[..., q_offset + first :].masked_fill_(_future(rows, q.device), float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype).flatten(1, 2)
        block = torch.bmm(weights, values[:, :visible])  # [Hkv, group*rows, D]
        out[first:last] = block.unflatten(1, (group, rows)).permute(2, 0, 1, 3).reshape(rows, num_q_heads, head_dim)
    return out


def head_score(hidden: Tensor, weight: Tensor, bias: float) -> float:
    """The scalar head: hidden [D] (after the final norm) . weight [D] fp32, products and sum in
    fp64, rounded to fp32, plus the fp32 bias in fp32. Returns the fp32 value as a float."""
    dot = (hidden.double() * weight.double()).sum().to(torch.float32)
    return float(dot + torch.tensor(bias, dtype=torch.float32))

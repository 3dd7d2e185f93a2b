"""The grouped GDN kernel (cuda/gdn_grouped.cu) against the reference in groups of its size, and
its exactness: alone or packed, whole or split at any position, parent and child in one launch
or apart, the same bits. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from test_kernels import BF16_TOL, DEV, chunked_case, per_segment, poisoned, rel

from openjev.worker.cuda import chunked_gdn as KC
from openjev.worker.cuda import grouped_gdn as KG

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-4  # fp32 throughout; only the order of summation differs from the reference
VARIANTS = list(KG.GDN_GROUPS)


def reference(ref, group, qn, kn, v, g, beta, cu, pos, init, tails):
    return ref.gdn_chunked_packed(
        qn.cpu(),
        kn.cpu(),
        v.cpu(),
        g.cpu(),
        beta.cpu(),
        cu.cpu(),
        pos.cpu(),
        None if init is None else init.cpu(),
        tails.cpu(),
        chunk=group,
    )


def grouped_case(K, lengths, starts, with_init, group):
    cu, qn, kn, v, g, beta, pos, init, tails = chunked_case(K, lengths, starts, with_init)
    return cu, qn, kn, v, g, beta, pos, init, tails[:, :group].contiguous()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("with_init", [True, False])
def test_gdn_grouped(K, ref, variant, with_init):
    group = KG.GDN_GROUPS[variant]
    lengths = [1, 3, 64, 65, 130, 17, 200, 6, 2]
    starts = [0, 101, 64, 5, 190, 63, 1000, 7, 9]  # tails of several sizes below a group
    cu, qn, kn, v, g, beta, pos, init, tails = grouped_case(K, lengths, starts, with_init, group)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    tail_out = poisoned(tails.shape, torch.float32)
    KG.gdn_grouped(qn, kn, v, g, beta, cu, pos, init, tails, out=out, final=fin, tail_out=tail_out, variant=variant)
    e_out, e_fin, e_tails = reference(ref, group, qn, kn, v, g, beta, cu, pos, init, tails)
    per_segment(out, e_out, cu, BF16_TOL, "grouped gdn o")
    for n in range(N):
        if e_fin[n].norm() > 0:
            assert rel(fin[n], e_fin[n]) < FP32_TOL, f"final state {n}"
        else:
            assert not fin[n].any(), f"final state {n}: zero state expected"
        rows = e_tails[n].shape[0]
        assert rows == (starts[n] + lengths[n]) % group
        got = tail_out[n, :rows, : e_tails[n].shape[1]].cpu()
        assert torch.equal(got, e_tails[n]), f"tail rows of segment {n} are copies of its inputs"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gdn_grouped_extreme_decays(K, ref, variant):
    """Decays at the edges of fp32 (runs of g = 0, steps of -30, -100 and -1000 that underflow
    e^g and e^{G_i - G_j}): outputs and states finite and against the reference."""
    group = KG.GDN_GROUPS[variant]
    lengths, starts = [300, 41, 9], [0, 3, 0]
    cu, qn, kn, v, g, beta, pos, init, tails = grouped_case(K, lengths, starts, True, group)
    g[:, ::2] *= 8
    g[10:40] = 0.0
    g[50] = -30.0
    g[51:53, :10] = -100.0
    g[120] = -1000.0
    out, fin, _ = KG.gdn_grouped(qn, kn, v, g, beta, cu, pos, init, tails, variant=variant)
    assert torch.isfinite(out.float()).all() and torch.isfinite(fin).all()
    e_out, e_fin, _ = reference(ref, group, qn, kn, v, g, beta, cu, pos, init, tails)
    per_segment(out, e_out, cu, BF16_TOL, "grouped gdn o")
    for n in range(len(lengths)):
        assert rel(fin[n], e_fin[n]) < FP32_TOL, f"final state {n}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gdn_grouped_batch_invariant(K, variant):
    """Each segment's outputs, final state and tail are the same bits launched alone and packed."""
    group = KG.GDN_GROUPS[variant]
    lengths = [700, 5, 64, 131, 1, 90]
    starts = [0, 77, 128, 3, 4095, 641]
    cu, qn, kn, v, g, beta, pos, init, tails = grouped_case(K, lengths, starts, True, group)
    out, fin, tail_out = KG.gdn_grouped(qn, kn, v, g, beta, cu, pos, init, tails, variant=variant)
    c = cu.tolist()
    for n in range(len(lengths)):
        a, b = c[n], c[n + 1]
        one = torch.tensor([0, b - a], dtype=torch.int32, device=DEV)
        part = lambda x, a=a, b=b: x[a:b].contiguous()  # noqa: E731
        o1, f1, t1 = KG.gdn_grouped(
            part(qn),
            part(kn),
            v[a:b],
            part(g),
            part(beta),
            one,
            part(pos),
            init[n : n + 1],
            tails[n : n + 1],
            variant=variant,
        )
        rows = (starts[n] + lengths[n]) % group
        assert torch.equal(o1, out[a:b]), f"segment {n} outputs alone vs packed"
        assert torch.equal(f1[0], fin[n]), f"segment {n} final state alone vs packed"
        assert torch.equal(t1[0, :rows], tail_out[n, :rows]), f"segment {n} tail alone vs packed"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", [1, 3, 5, 8, 37, 64, 133])
def test_gdn_grouped_split_is_exact(K, variant, split):
    """A prompt run whole, and as a parent [0, split) plus a child [split, L) packed after an
    unrelated segment: the child's outputs, final state and tail are the same bits."""
    group, L = KG.GDN_GROUPS[variant], 301
    cu, qn, kn, v, g, beta, pos, _, _ = grouped_case(K, [L], [0], False, group)
    whole_o, whole_f, whole_t = KG.gdn_grouped(qn, kn, v, g, beta, cu, pos, variant=variant)
    p_cu = torch.tensor([0, split], dtype=torch.int32, device=DEV)
    par_o, par_f, par_t = KG.gdn_grouped(
        qn[:split], kn[:split], v[:split], g[:split], beta[:split], p_cu, pos[:split], variant=variant
    )
    assert torch.equal(par_o, whole_o[:split])
    o_cu, o_qn, o_kn, o_v, o_g, o_b, _, _, _ = grouped_case(K, [50], [0], False, group)
    cat = lambda a, b: torch.cat([a, b]).contiguous()  # noqa: E731
    c_cu = torch.tensor([0, 50, 50 + L - split], dtype=torch.int32, device=DEV)
    c_pos = torch.cat([torch.arange(50, dtype=torch.int32, device=DEV), pos[split:]])
    c_v = torch.cat([o_v, v[split:]]).contiguous()
    init = torch.stack([torch.zeros_like(par_f[0]), par_f[0]])
    tails = torch.stack([torch.zeros_like(par_t[0]), par_t[0]])
    c_o, c_f, c_t = KG.gdn_grouped(
        cat(o_qn, qn[split:]),
        cat(o_kn, kn[split:]),
        c_v,
        cat(o_g, g[split:]),
        cat(o_b, beta[split:]),
        c_cu,
        c_pos,
        init,
        tails,
        variant=variant,
    )
    assert torch.equal(c_o[50:], whole_o[split:]), "child outputs"
    assert torch.equal(c_f[1], whole_f[0]), "child final state"
    rows = L % group
    assert torch.equal(c_t[1, :rows], whole_t[0, :rows]), "child tail"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("split", [1, 3, 6, 64, 133])
def test_gdn_grouped_in_pass_parent_is_exact(K, variant, split):
    """A parent [0, split) and its child [split, L) in one launch, two levels (the child's tail
    rows are the parent's packed rows, its state the parent's final): the whole prompt's bits."""
    group, L = KG.GDN_GROUPS[variant], 300
    cu, qn, kn, v, g, beta, pos, _, _ = grouped_case(K, [L], [0], False, group)
    whole_o, whole_f, whole_t = KG.gdn_grouped(qn, kn, v, g, beta, cu, pos, variant=variant)
    H, width = v.shape[1], KC.gdn_tail_width(kn.shape[1], v.shape[1])
    tail = split % group
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    src = KC.ChunkSources(
        init_slots=torch.zeros(1, H, 128, 128, device=DEV),
        init_idx=i32([-1, -2]),  # the child starts from run 0's final state
        tails=torch.zeros(group, width, device=DEV),
        tail_src=i32([0] * group + [split - tail + r for r in range(tail)] + [0] * (group - tail)),
        level_off=i32([0, 1, 2]),
        num_levels=2,
    )
    o, f, t = KG.gdn_grouped(qn, kn, v, g, beta, i32([0, split, L]), pos, sources=src, variant=variant)
    assert torch.equal(o, whole_o), "outputs"
    assert torch.equal(f[1], whole_f[0]), "the child's final state"
    assert torch.equal(t[1, : L % group], whole_t[0, : L % group]), "the child's tail"

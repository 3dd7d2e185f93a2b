"""Every CUDA kernel against its packed PyTorch reference, on fresh random inputs per check,
outputs NaN-poisoned before each run, relative error per packed segment. Skipped without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openjev.worker.cuda import chunked_gdn as KC

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2  # bf16 operands / bf16 outputs
FP32_TOL = 1e-4  # fp32 state math (recurrent vs chunked order of summation)


@pytest.fixture(scope="module")
def ref():
    from openjev.worker.cuda import reference

    return reference


DEV = "cuda"


def rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN (unwritten or bad) output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEV)


def per_segment(out, expected, cu, tol, what):
    cu = cu.tolist()
    for n in range(len(cu) - 1):
        err = rel(out[cu[n] : cu[n + 1]], expected[cu[n] : cu[n + 1]])
        assert err < tol, f"{what}: segment {n} rel err {err:.3e} >= {tol}"


LENGTHS = [1, 3, 64, 65, 130, 17]


@pytest.mark.parametrize("rows", [None, 3, 16])
@pytest.mark.parametrize("trial", range(2))
def test_causal_conv1d(K, ref, trial, rows):
    C = 10240  # the 27B conv channels (q, k: 16*128 each; v: 48*128)
    cu = cu_of(LENGTHS)
    T, N = int(cu[-1]), len(LENGTHS)
    fused = torch.randn(T, C + 512, device=DEV).bfloat16()  # conv input is a column slice
    x = fused[:, :C]
    w = (torch.randn(C, 4, device=DEV) * 0.5).bfloat16()
    win, src = torch.randn(N, 3, C, device=DEV).bfloat16(), K.own_windows(N, DEV)
    out, nw = poisoned((T, C), torch.bfloat16), poisoned((N, 3, C), torch.bfloat16)
    K.causal_conv1d(x, w, win, src, cu, out=out, new_window=nw, rows=rows)
    e_out, e_win = ref.causal_conv1d_packed(x.cpu(), w.cpu(), win.cpu(), src.cpu(), cu.cpu())
    per_segment(out, e_out, cu, BF16_TOL, "conv out")
    assert torch.equal(nw.cpu(), e_win), "new windows are exact copies of inputs"


# A forest pass for the conv's window sources, in the caller's order (parents first): (tokens,
# in-pass parent, external parent: index into the fake kept states, whose windows are random).
# Windows that come from: zeros (0, 16); an ancestor's rows (1, 4, 6); a parent shorter than 3,
# walking further up (2, 3, 7, 8, 14); an external parent's window (5, 9, 15; 15 shares 5's
# slot); in-pass rows and then the external window (10, 11: two 1-token parents up); zeros and
# then rows (13). Segment 3 spans several row groups, 16 starts a 65-row one.
CONV_FOREST = [
    (5, None, None),  # 0
    (1, 0, None),  # 1
    (2, 1, None),  # 2
    (130, 2, None),  # 3
    (1, 1, None),  # 4
    (3, None, 0),  # 5
    (1, 5, None),  # 6
    (1, 6, None),  # 7
    (64, 7, None),  # 8
    (1, None, 1),  # 9
    (1, 9, None),  # 10
    (3, 10, None),  # 11
    (1, None, None),  # 12
    (2, 12, None),  # 13
    (17, 13, None),  # 14
    (2, None, 0),  # 15
    (65, None, None),  # 16
]


def conv_forest(C, pad_tokens=0, empty=0):
    """(x [T(+pad), C] bf16 column slice in the plan's order, slot windows [1 + P, 3, C], win_src,
    cu, and in the plan's order each run's expected incoming and new window [3, C]) for
    CONV_FOREST; pad_tokens, empty: a graph pass's pad segment and empty segments after the real
    ones, reading slot 0's zeros (graph_launch.GraphLauncher._fill)."""
    from openjev.worker.cuda.launch import CudaSegmentState, KvNode, plan_launch
    from openjev.worker.runner_api import SegmentRun

    ext_windows = torch.randn(2, 3, C, device=DEV).bfloat16()
    ext = [CudaSegmentState(9, {0: (ext_windows[e], None, None)}, KvNode(None, 9, {})) for e in range(2)]
    own = [torch.randn(n, C, device=DEV).bfloat16() for n, _, _ in CONV_FOREST]
    before = []  # per caller's run: every input before it (3 zero rows or its parent's window first)
    runs = []
    for n, parent, e in CONV_FOREST:
        if parent is not None:
            before.append(torch.cat([before[parent], own[parent]]))
            start = runs[parent].start_position + CONV_FOREST[parent][0]
        else:
            before.append(torch.zeros(3, C, device=DEV).bfloat16() if e is None else ext_windows[e])
            start = 0 if e is None else ext[e].num_tokens
        runs.append(SegmentRun([0] * n, start, None if e is None else ext[e], False, False, parent))
    plan = plan_launch(runs, vocab_size=1)
    assert plan.num_levels == 4 and len(plan.parents) == 2
    T = plan.cu[-1]
    fused = torch.randn(T + pad_tokens, C + 512, device=DEV).bfloat16()  # pad rows hold garbage
    fused[:T, :C] = torch.cat([own[o] for o in plan.order])
    slots = torch.stack([torch.zeros(3, C, device=DEV).bfloat16()] + [p.gdn[0][0] for p in plan.parents])
    extra = (1 if pad_tokens else 0) + empty
    cu = plan.cu + ([T + pad_tokens] if pad_tokens else []) + [T + pad_tokens] * empty
    win_src = plan.win_src + [-1 - m for _ in range(extra) for m in range(3)]
    windows = [before[o][-3:] for o in plan.order]
    new = [torch.cat([before[o], own[o]])[-3:] for o in plan.order]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    return fused[:, :C], slots, i32(win_src), i32(cu), windows, new


@pytest.mark.parametrize("pad", [(0, 0), (7, 2)])
def test_causal_conv1d_window_sources(K, ref, pad):
    """Windows read at their sources in one launch (CONV_FOREST: in-pass ancestors' rows, short
    parents, external slots, zeros, mixed) give what the same kernel gives from windows gathered
    beforehand (the runner's path until 2026-12-01), bit for bit; outputs match the reference
    from the prompt's own inputs; new windows are the last 3 inputs of each prompt, exactly.
    With a graph pass's pad segment and empty segments after the real ones, the real segments'
    rows do not change."""
    C = 10240
    x, slots, win_src, cu, windows, new = conv_forest(C, *pad)
    T, N, R = x.shape[0], cu.numel() - 1, len(windows)  # R real segments
    real_T = int(cu[R])
    w = (torch.randn(C, 4, device=DEV) * 0.5).bfloat16()
    # the encoding as the reference reads it = each prompt's 3 inputs before the run
    assert torch.equal(ref.conv_windows(x.cpu(), slots.cpu(), win_src.cpu())[:R], torch.stack(windows).cpu())
    out, nw = poisoned((T, C), torch.bfloat16), poisoned((N, 3, C), torch.bfloat16)
    K.causal_conv1d(x, w, slots, win_src, cu, out=out, new_window=nw)
    assert not torch.isnan(out).any() and not torch.isnan(nw).any(), "rows left unwritten"
    # the former path: windows gathered into [N, 3, C] first (Launch.windows), then the kernel
    src = win_src.long()
    gathered = torch.where(
        (src >= 0)[:, None],
        x.index_select(0, src.clamp(min=0)),
        slots.flatten(0, 1).index_select(0, (-1 - src).clamp(min=0)),
    ).view(N, 3, C)
    g_out, g_nw = K.causal_conv1d(x, w, gathered, K.own_windows(N, DEV), cu)
    assert torch.equal(out, g_out) and torch.equal(nw, g_nw), "not the bits of gathered windows"
    for rows in (1, 5, 16, 64):  # the same bits, however many rows a thread walks
        r_out, r_nw = K.causal_conv1d(x, w, slots, win_src, cu, rows=rows)
        assert torch.equal(r_out, out) and torch.equal(r_nw, nw), f"{rows} rows a thread"
    assert torch.equal(nw[:R], torch.stack(new)), "new windows: the last 3 inputs of each prompt"
    own = K.own_windows(R, DEV)
    e_out, _ = ref.causal_conv1d_packed(
        x[:real_T].cpu(), w.cpu(), torch.stack(windows).cpu(), own.cpu(), cu[: R + 1].cpu()
    )
    per_segment(out[:real_T], e_out, cu[: R + 1], BF16_TOL, "conv out")
    if pad != (0, 0):  # padding changes no real row
        _, _, src0, cu0, _, _ = conv_forest(C)
        assert torch.equal(src0, win_src[: 3 * R]) and torch.equal(cu0, cu[: R + 1])
        p_out, p_nw = K.causal_conv1d(x[:real_T], w, slots, src0, cu0)
        assert torch.equal(p_out, out[:real_T]) and torch.equal(p_nw, nw[:R])
        assert not nw[R + 1 :].any(), "empty segments' new windows: slot 0's zeros"


def test_gdn_prepare(K, ref):
    T, Hk, H = 300, 16, 48
    conv = torch.randn(T, 2 * Hk * 128 + H * 128, device=DEV).bfloat16()
    ab = torch.randn(T, 2 * H + 7, device=DEV).bfloat16()
    a, b = ab[:, :H], ab[:, H : 2 * H]
    a_log = torch.log(torch.rand(H, device=DEV) * 15 + 1)
    dt_bias = torch.randn(H, device=DEV)
    outs = tuple(poisoned(s, torch.float32) for s in [(T, Hk, 128), (T, Hk, 128), (T, H), (T, H), (T, Hk)])
    got = K.gdn_prepare(conv, a, b, a_log, dt_bias, Hk, out=outs)
    exp = ref.gdn_prepare(conv.cpu(), a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu(), Hk)
    for name, o, e in zip(("qn", "kn", "g", "beta", "kq"), got, exp, strict=True):
        assert rel(o, e) < FP32_TOL, name


def gdn_inputs(lengths, H=48, Hk=16):
    cu = cu_of(lengths)
    T, N = int(cu[-1]), len(lengths)
    qn = torch.nn.functional.normalize(torch.randn(T, Hk, 128, device=DEV), dim=-1) * 128**-0.5
    kn = torch.nn.functional.normalize(torch.randn(T, Hk, 128, device=DEV), dim=-1)
    conv = torch.randn(T, 2 * Hk * 128 + H * 128, device=DEV).bfloat16()
    v = conv[:, 2 * Hk * 128 :].unflatten(1, (H, 128))  # the kernel reads v out of the conv output
    g = -torch.rand(T, H, device=DEV) * 0.5 - 0.01
    beta = torch.rand(T, H, device=DEV)
    init = torch.randn(N, H, 128, 128, device=DEV) * 0.1
    kq = (qn * kn).sum(-1)
    return cu, qn, kn, kq, v, g, beta, init


@pytest.mark.parametrize("variant", ["s8c16x1", "s8c32x2"])
@pytest.mark.parametrize("with_init", [True, False])
def test_gdn_recurrent(K, ref, variant, with_init):
    cu, qn, kn, kq, v, g, beta, init = gdn_inputs(LENGTHS)
    init = init if with_init else None
    T, N, H = qn.shape[0], len(LENGTHS), v.shape[1]
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, variant=variant, out=out, final=fin)
    e_out, e_fin = ref.gdn_packed(
        qn.cpu(), kn.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(), None if init is None else init.cpu()
    )
    per_segment(out, e_out, cu, BF16_TOL, "gdn o")
    for n in range(N):
        assert rel(fin[n], e_fin[n]) < FP32_TOL, f"final state {n}"


def test_gdn_recurrent_shares_keep_the_butterflys_bits(K):
    """s8c32x2 reduces its sums as lane shares, s8c16x1 by a butterfly; both add the same pairs
    over the same 8 lanes of a column, so their bits are equal."""
    cu, qn, kn, kq, v, g, beta, init = gdn_inputs(LENGTHS)
    got = {
        variant: K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, variant=variant)
        for variant in ("s8c16x1", "s8c32x2")
    }
    (o_a, f_a), (o_b, f_b) = got.values()
    assert torch.equal(o_a.view(torch.int16), o_b.view(torch.int16))
    assert torch.equal(f_a.view(torch.int32), f_b.view(torch.int32))


@pytest.mark.parametrize("variant", ["s8c16x1", "s8c32x2"])
def test_gdn_recurrent_extreme_decays(K, ref, variant):
    """Decays at the edges of fp32: runs of g = 0, steps of -30 and -100 (e^g underflows), -1000
    (a reset), fast-decaying heads beside slow ones; outputs and final states finite and against
    the reference."""
    lengths = [300, 41, 9]
    cu, qn, kn, kq, v, g, beta, init = gdn_inputs(lengths)
    g[:, ::2] *= 8  # even heads decay 8x faster than odd ones
    g[10:40] = 0.0
    g[50] = -30.0
    g[51, :24] = -100.0
    g[305] = -1000.0
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, variant=variant, out=out, final=fin)
    e_out, e_fin = ref.gdn_packed(qn.cpu(), kn.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(), init.cpu())
    per_segment(out, e_out, cu, BF16_TOL, "gdn o")
    for n in range(N):
        assert torch.isfinite(fin[n]).all() and rel(fin[n], e_fin[n]) < FP32_TOL, f"final state {n}"


def test_gdn_recurrent_level_range(K, ref):
    """A level of more items (segment, column block, head) than the grid has blocks, so workers
    take several in turn, empty segments among them; segments outside the level's range (a
    graph's pad segment) are not run: their rows stay as they were. Run twice: the schedule's
    counters are back at zero after a launch."""
    lengths = [(n * 7) % 23 for n in range(37)] + [9]  # zeros among them
    cu, qn, kn, kq, v, g, beta, init = gdn_inputs(lengths)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    off = torch.tensor([0, N - 1], dtype=torch.int32, device=DEV)
    K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, out=out, final=fin, level_off=off)
    assert not K.gdn_schedule(qn.device)[0].any(), "the schedule's counters were left non-zero"
    again = K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, out=out.clone(), final=fin.clone(), level_off=off)
    for a, b in zip(again, (out, fin), strict=True):  # bit-equal, NaN rows (not run) included
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    e_out, e_fin = ref.gdn_packed(qn.cpu(), kn.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(), init.cpu())
    last = int(cu[N - 1])
    per_segment(out[:last], e_out[:last], cu[:N], BF16_TOL, "gdn o")
    for n in range(N - 1):
        if lengths[n]:
            assert rel(fin[n], e_fin[n]) < FP32_TOL, f"final state {n}"
        else:
            assert torch.isnan(fin[n]).all(), f"empty segment {n}'s final state was written"
    assert torch.isnan(out[last:]).all() and torch.isnan(fin[N - 1]).all(), "a segment outside the range ran"


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "launch-a-level"])
@pytest.mark.parametrize("variant", ["s8c16x1", "s8c32x2"])
def test_gdn_recurrent_forest_levels(K, ref, variant, one_launch):
    """A forest on a fixed grid, in one launch (a child's items wait for their parent's) or one
    launch a level: level-0 segments start from rows of a strided slot buffer (or zeros), deeper
    ones from their in-pass parent's final state; each segment equals the reference started from
    the same state, and bit-equals the same segment launched alone."""
    lengths = (37, 5, 1, 70, 16, 3, 2)
    level_off = [0, 3, 5, 6, 7, 7]  # levels 0-3 and an empty fifth: segments by level
    # sources: slot 2, zeros, slot 1; parents 0, 1; parent 3; parent 5
    init_idx = [2, -1, 1, -2 - 0, -2 - 1, -2 - 3, -2 - 5]
    cu, qn, kn, kq, v, g, beta, _ = gdn_inputs(lengths)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    slots = torch.randn(3, 2, H, 128, 128, device=DEV)[:, 1] * 0.1  # [3, H, 128, 128], dim 0 strided
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    # one level more than there are (empty): it must change nothing
    for d in [0] if one_launch else range(5):
        K.gdn_recurrent(
            qn,
            kn,
            kq,
            v,
            g,
            beta,
            cu,
            slots,
            variant=variant,
            out=out,
            final=fin,
            init_idx=i32(init_idx),
            level_off=i32(level_off),
            level=d,
            levels=5 if one_launch else 1,
        )
    assert not torch.isnan(out).any() and not torch.isnan(fin).any()
    for n in range(N):
        src = init_idx[n]
        start = slots[src] if src >= 0 else fin[-2 - src] if src < -1 else torch.zeros_like(slots[0])
        s, e = int(cu[n]), int(cu[n + 1])

        def one(t, s=s, e=e):
            return t[s:e]

        e_out, e_fin = ref.gdn_packed(
            one(qn).cpu(),
            one(kn).cpu(),
            one(v).cpu(),
            one(g).cpu(),
            one(beta).cpu(),
            torch.tensor([0, e - s], dtype=torch.int32),
            start[None].cpu(),
        )
        assert rel(out[s:e], e_out) < BF16_TOL and rel(fin[n], e_fin[0]) < FP32_TOL, n
        alone_out, alone_fin = K.gdn_recurrent(
            one(qn),
            one(kn),
            one(kq),
            one(v),
            one(g),
            one(beta),
            i32([0, e - s]),
            start[None].contiguous(),
            variant=variant,
        )
        assert torch.equal(alone_out, out[s:e]) and torch.equal(alone_fin[0], fin[n]), n


def test_gdn_recurrent_one_launch_waits_for_the_parents_of_this_launch(K):
    """A long parent with many short children, then their children, in one launch, twice, with
    other inputs the second time: every child waits for its parent's state of this launch (not
    the one the first launch left in the same rows), so the second launch bit-equals one launch
    a level over the same inputs."""
    lengths = [300, 2] + [5] * 20 + [3] * 6
    level_off = [0, 2, 22, 28]
    init_idx = [-1, -1] + [-2 - 0] * 20 + [-2 - (2 + i) for i in range(6)]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    H, N = 48, len(lengths)

    def run(inputs, one_launch, out=None, fin=None):
        cu, qn, kn, kq, v, g, beta, _ = inputs
        out = poisoned((qn.shape[0], H, 128), torch.bfloat16) if out is None else out
        fin = poisoned((N, H, 128, 128), torch.float32) if fin is None else fin
        for d in [0] if one_launch else range(3):
            K.gdn_recurrent(
                qn, kn, kq, v, g, beta, cu, None, out=out, final=fin, init_idx=i32(init_idx),
                level_off=i32(level_off), level=d, levels=3 if one_launch else 1,
            )  # fmt: skip
        return out, fin

    first, second = gdn_inputs(lengths), gdn_inputs(lengths)
    out, fin = run(first, one_launch=True)
    out1 = out.clone()
    run(second, True, out, fin)  # into the rows the first launch wrote, as a graph's replay does
    e_out, e_fin = run(second, one_launch=False)
    assert torch.equal(out, e_out) and torch.equal(fin, e_fin)
    assert not torch.equal(out, out1), "the two launches' inputs were meant to differ"


TF32_TOL = 5e-3  # chunked GDN: tensor-core products of tf32-rounded fp32 operands, fp32 sums


def tail_rows(n_rows, H, Hk, width):
    """Random tail buffers [N, 64, width] in the kernels' words (KC.pack_tails): valid k (unit
    rows), bf16 v, decays, betas in the first rows; rows a segment must not read are NaN."""
    t = torch.full((len(n_rows), 64, width), float("nan"), device=DEV)
    for n, rows in enumerate(n_rows):
        k = torch.nn.functional.normalize(torch.randn(rows, Hk, 128, device=DEV), dim=-1).flatten(1)
        v = torch.randn(rows, H * 128, device=DEV).bfloat16().float()
        g = -torch.rand(rows, H, device=DEV) * 0.5 - 0.01
        b = torch.rand(rows, H, device=DEV)
        t[n, :rows] = KC.pack_tails(k, v, g, b)
    return t


def chunked_case(K, lengths, starts, with_init, H=48, Hk=16):
    cu, qn, kn, _, v, g, beta, init = gdn_inputs(lengths, H, Hk)
    pos = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts, lengths, strict=True)]).to(DEV)
    width = KC.gdn_tail_width(Hk, H)
    tails = tail_rows([s % 64 for s in starts], H, Hk, width)
    return cu, qn, kn, v, g, beta, pos, (init if with_init else None), tails


def chunked_reference(ref, cu, qn, kn, v, g, beta, pos, init, tails):
    """The reference on the CPU for a chunked_case's tensors (its tail words unpacked to fp32 rows)."""
    rows = KC.unpack_tails(tails, kn.shape[1], v.shape[1])
    cpu = [None if x is None else x.cpu() for x in (qn, kn, v, g, beta, cu, pos, init, rows)]
    return ref.gdn_chunked_packed(*cpu)


@pytest.mark.parametrize("with_init", [True, False])
def test_gdn_chunked(K, ref, with_init):
    lengths = [1, 3, 64, 65, 130, 17, 200, 63]
    starts = [0, 100, 64, 5, 190, 63, 1000, 1]  # tails of 0, 36, 0, 5, 62, 63, 40, 1 rows
    cu, qn, kn, v, g, beta, pos, init, tails = chunked_case(K, lengths, starts, with_init)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
    tail_out = poisoned(tails.shape, torch.float32)
    KC.gdn_chunked(qn, kn, v, g, beta, cu, pos, max(lengths), init, tails, out=out, final=fin, tail_out=tail_out)
    e_out, e_fin, e_tails = chunked_reference(ref, cu, qn, kn, v, g, beta, pos, init, tails)
    per_segment(out, e_out, cu, BF16_TOL, "chunked gdn o")
    for n in range(N):
        if e_fin[n].norm() > 0:
            assert rel(fin[n], e_fin[n]) < TF32_TOL, f"final state {n}"
        else:
            assert not fin[n].any(), f"final state {n}: zero state expected"
        rows = e_tails[n].shape[0]
        assert rows == (starts[n] + lengths[n]) % 64
        got = KC.unpack_tails(tail_out[n, :rows], kn.shape[1], H).cpu()
        assert torch.equal(got, e_tails[n]), f"tail rows of segment {n} are copies of its inputs"


def test_gdn_chunked_batch_invariant(K, ref):
    """Segments with tails and initial states, one over 11 chunks, packed in one launch: each
    matches the reference, and its outputs, final state and tail are the same bits when it is
    launched alone and with either state-pass variant (a result never depends on its neighbours
    or on how the state pass splits its work)."""
    lengths = [700, 5, 64, 131, 1, 90]
    starts = [0, 77, 128, 3, 4095, 640]  # tails of 0, 13, 0, 3, 63, 0 rows
    cu, qn, kn, v, g, beta, pos, init, tails = chunked_case(K, lengths, starts, True)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    runs = {}
    for variant in KC.GDN_STATE_VARIANTS:
        out, fin = poisoned((T, H, 128), torch.bfloat16), poisoned((N, H, 128, 128), torch.float32)
        tail_out = poisoned(tails.shape, torch.float32)
        KC.gdn_chunked(
            qn,
            kn,
            v,
            g,
            beta,
            cu,
            pos,
            max(lengths),
            init,
            tails,
            out=out,
            final=fin,
            tail_out=tail_out,
            state_variant=variant,
        )
        runs[variant] = (out, fin, tail_out)
    out, fin, tail_out = runs[KC.GDN_STATE_DEFAULT]
    for variant, (o2, f2, t2) in runs.items():
        assert torch.equal(o2, out) and torch.equal(f2, fin), f"state variant {variant} changes bits"
        for n in range(N):  # the rows past a tail stay NaN-poisoned
            rows = (starts[n] + lengths[n]) % 64
            assert torch.equal(t2[n, :rows], tail_out[n, :rows]), f"state variant {variant}: tail {n}"
    e_out, e_fin, _ = chunked_reference(ref, cu, qn, kn, v, g, beta, pos, init, tails)
    per_segment(out, e_out, cu, BF16_TOL, "chunked gdn o")
    c = cu.tolist()
    for n in range(N):
        assert rel(fin[n], e_fin[n]) < TF32_TOL, f"final state {n}"
        a, b = c[n], c[n + 1]
        one = torch.tensor([0, b - a], dtype=torch.int32, device=DEV)
        part = lambda x, a=a, b=b: x[a:b].contiguous()  # noqa: E731
        o1, f1, t1 = KC.gdn_chunked(
            part(qn), part(kn), v[a:b], part(g), part(beta), one, part(pos), b - a, init[n : n + 1], tails[n : n + 1]
        )
        rows = (starts[n] + lengths[n]) % 64
        assert torch.equal(o1, out[a:b]), f"segment {n} outputs alone vs packed"
        assert torch.equal(f1[0], fin[n]), f"segment {n} final state alone vs packed"
        assert torch.equal(t1[0, :rows], tail_out[n, :rows]), f"segment {n} tail alone vs packed"


def test_gdn_chunked_skips_segments_outside_the_levels(K):
    """A graph pass's pad segment lies after every level's range: its chunks are neither solved
    nor output (its rows keep what was there), and the other segments' bits do not change."""
    lengths, starts = [130, 70, 90], [0, 5, 0]
    cu, qn, kn, v, g, beta, pos, init, tails = chunked_case(K, lengths, starts, True)
    T, N, H = qn.shape[0], len(lengths), v.shape[1]
    every = KC.ChunkSources.per_segment(N, H, KC.gdn_tail_width(kn.shape[1], H), DEV, init, tails)
    outs = []
    for sources in (every, dataclasses.replace(every, level_off=every.level_off.new_tensor([0, N - 1]))):
        out = poisoned((T, H, 128), torch.bfloat16)
        KC.gdn_chunked(qn, kn, v, g, beta, cu, pos, max(lengths), out=out, sources=sources)
        outs.append(out)
    pad = cu.tolist()[N - 1]
    assert not outs[0].isnan().any()
    assert outs[1][pad:].isnan().all(), "the segment outside the levels was output"
    assert torch.equal(outs[1][:pad], outs[0][:pad])


@pytest.mark.parametrize("split", [1, 37, 64, 100, 128, 133])
def test_gdn_chunked_split_is_exact(K, split):
    """A prompt run whole, and as a parent [0, split) plus a child [split, L) launched beside an
    unrelated segment: the child's outputs, final state and tail are the same bits (what makes
    every policy agree with `off` exactly)."""
    L = 300
    cu, qn, kn, v, g, beta, pos, _, _ = chunked_case(K, [L], [0], False)
    whole_o, whole_f, whole_t = KC.gdn_chunked(qn, kn, v, g, beta, cu, pos, L)
    p_cu = torch.tensor([0, split], dtype=torch.int32, device=DEV)
    par_o, par_f, par_t = KC.gdn_chunked(
        qn[:split], kn[:split], v[:split], g[:split], beta[:split], p_cu, pos[:split], split
    )
    assert torch.equal(par_o, whole_o[:split])
    # the child packed after an unrelated 50-token segment (no parent)
    o_cu, o_qn, o_kn, o_v, o_g, o_b, _, _, _ = chunked_case(K, [50], [0], False)
    cat = lambda a, b: torch.cat([a, b]).contiguous()  # noqa: E731
    c_cu = torch.tensor([0, 50, 50 + L - split], dtype=torch.int32, device=DEV)
    c_pos = torch.cat([torch.arange(50, dtype=torch.int32, device=DEV), pos[split:]])
    c_v = torch.cat([o_v, v[split:]]).contiguous()
    init = torch.stack([torch.zeros_like(par_f[0]), par_f[0]])
    tails = torch.stack([torch.zeros_like(par_t[0]), par_t[0]])
    c_o, c_f, c_t = KC.gdn_chunked(
        cat(o_qn, qn[split:]),
        cat(o_kn, kn[split:]),
        c_v,
        cat(o_g, g[split:]),
        cat(o_b, beta[split:]),
        c_cu,
        c_pos,
        L - split,
        init,
        tails,
    )
    assert torch.equal(c_o[50:], whole_o[split:]), "child outputs"
    assert torch.equal(c_f[1], whole_f[0]), "child final state"
    rows = L % 64
    assert torch.equal(c_t[1, :rows], whole_t[0, :rows]), "child tail"


def tree_inputs(q_lens, prefix_lens, Hq=24, Hkv=4, D=256):
    """A pool holding some older rows (ancestors, shuffled) and then this launch's own rows."""
    old = max(prefix_lens) + 50
    Tq = sum(q_lens)
    k_pool = torch.randn(old + Tq, Hkv, D, device=DEV).bfloat16()
    v_pool = torch.randn(old + Tq, Hkv, D, device=DEV).bfloat16()
    ancestors = torch.randperm(old)
    rows, own = [], old
    for t, p in zip(q_lens, prefix_lens, strict=True):
        rows += ancestors[:p].tolist() + list(range(own, own + t))
        own += t
    kv_rows = torch.tensor(rows, dtype=torch.int32, device=DEV)
    q = torch.randn(Tq, Hq, D, device=DEV).bfloat16()
    qg = torch.randn(Tq, Hq, 2 * D, device=DEV).bfloat16()  # [query | gate] per head
    return (
        q,
        k_pool,
        v_pool,
        kv_rows,
        cu_of(q_lens),
        cu_of([t + p for t, p in zip(q_lens, prefix_lens, strict=True)]),
        qg[..., D:],
    )


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_tree_attention(K, ref, gated, pipelined):
    q_lens, prefix_lens = [130, 1, 64, 7, 200], [0, 300, 77, 129, 5]
    q, kp, vp, rows, cu_q, cu_k, gate = tree_inputs(q_lens, prefix_lens)
    gate = gate if gated else None
    out = poisoned(q.shape, torch.bfloat16)
    K.tree_attention(q, kp, vp, rows, cu_q, cu_k, max(q_lens), gate=gate, out=out, pipelined=pipelined)
    exp = ref.tree_attention(
        q.cpu(), kp.cpu(), vp.cpu(), rows.cpu(), cu_q.cpu(), cu_k.cpu(), None if gate is None else gate.cpu()
    )
    per_segment(out, exp, cu_q, BF16_TOL, "attention")


@pytest.mark.parametrize(
    "q_lens, prefix_lens", [([130, 1, 64, 7, 200], [0, 300, 77, 129, 5]), ([40] + [5] * 8, [3000] * 9)]
)
def test_tree_attention_forms_agree(K, q_lens, prefix_lens):
    """The single-buffered and the pipelined form give the same bits (whole prompts, and short
    segments under a long context), so the host may pick either for any pass."""
    q, kp, vp, rows, cu_q, cu_k, gate = tree_inputs(q_lens, prefix_lens)
    one, two = (
        K.tree_attention(q, kp, vp, rows, cu_q, cu_k, max(q_lens), gate=gate, pipelined=p) for p in (False, True)
    )
    assert torch.equal(one, two)


@pytest.mark.parametrize("segments", [5, 1500])
def test_attention_tiles_list_every_tile_once(K, segments):
    """attention_tile_plan: each segment's query tiles once, its last first, segments in order,
    then -1 to the end of the list; empty segments have none; more segments than a round of the
    plan's threads."""
    import random

    rng, G, BM = random.Random(segments), 6, 64
    lengths = [rng.choice((0, 1, 10, 11, 21, 22, 100, 300)) for _ in range(segments)]
    cu = cu_of(lengths)
    tiles = K.attention_tiles(cu, sum(lengths), G).tolist()
    expected = [(n << 16) | t for n, T in enumerate(lengths) for t in reversed(range(-(-T * G // BM)))]
    assert tiles[: len(expected)] == expected
    assert tiles[len(expected) :] == [-1] * (len(tiles) - len(expected)) and len(tiles) >= len(expected)


def test_tree_attention_rows_do_not_depend_on_grouping(K):
    """A segment's rows are the same bits alone, packed beside others (different block
    groupings of (token, head) rows), and split into a parent whose keys its child reads as
    ancestors (how prefix policies and cached states cut a prompt)."""
    q_lens, prefix_lens = [300, 3, 77, 1, 40], [0, 1500, 0, 2100, 64]
    q, kp, vp, rows, cu_q, cu_k, gate = tree_inputs(q_lens, prefix_lens)
    packed = K.tree_attention(q, kp, vp, rows, cu_q, cu_k, max(q_lens), gate=gate)
    for n in range(len(q_lens)):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        one = lambda t: torch.tensor([0, t], dtype=torch.int32, device=DEV)  # noqa: E731
        alone = K.tree_attention(
            q[qs].contiguous(),
            kp,
            vp,
            rows[ks].contiguous(),
            one(q_lens[n]),
            one(ks.stop - ks.start),
            q_lens[n],
            gate=gate[qs],
        )
        assert torch.equal(alone, packed[qs]), f"segment {n} alone"
    # segment 0 (300 tokens, no ancestors) cut at 130: the child's keys are the parent's rows then its own
    split, T = 130, q_lens[0]
    own = rows[:T]
    cut_cu_q = torch.tensor([0, split, T], dtype=torch.int32, device=DEV)
    cut_rows = torch.cat([own[:split], own])
    cut_cu_k = torch.tensor([0, split, split + T], dtype=torch.int32, device=DEV)
    cut = K.tree_attention(q[:T].contiguous(), kp, vp, cut_rows, cut_cu_q, cut_cu_k, T - split, gate=gate[:T])
    assert torch.equal(cut, packed[:T]), "parent + child equals the whole segment"


def test_add_rms_norm(K, ref):
    T, D = 77, 5120
    w = (torch.randn(D, device=DEV) * 0.1).bfloat16()
    for use_add, use_idx in [(True, False), (False, False), (True, True)]:
        res = torch.randn(T, D, device=DEV).bfloat16()
        add = torch.randn(T, D, device=DEV).bfloat16() if use_add else None
        idx = torch.tensor([76, 0, 5], dtype=torch.int32, device=DEV) if use_idx else None
        exp_n, exp_r = ref.add_rms_norm(
            res.cpu(), w.cpu(), 1e-6, None if add is None else add.cpu(), None if idx is None else idx.cpu()
        )
        R = T if idx is None else 3
        out = poisoned((R, D), torch.bfloat16)
        normed, res_rows = K.add_rms_norm(res, w, 1e-6, x_add=add, row_idx=idx, out=out)
        assert rel(normed, exp_n) < BF16_TOL
        assert torch.equal(res_rows.cpu(), exp_r), "residual rows are the bf16 sums"


def test_gated_rms_norm(K, ref):
    T, H = 99, 48
    x = torch.randn(T, H, 128, device=DEV).bfloat16()
    zz = torch.randn(T, H * 128 + 64, device=DEV).bfloat16()
    z = zz[:, : H * 128]
    w = (1 + 0.1 * torch.randn(128, device=DEV)).bfloat16()
    out = poisoned((T, H * 128), torch.bfloat16)
    K.gated_rms_norm(x, z, w, 1e-6, out=out)
    assert rel(out, ref.gated_rms_norm(x.cpu(), z.cpu(), w.cpu(), 1e-6)) < BF16_TOL


def test_qk_norm_rope(K, ref):
    T, H = 50, 24
    qg = torch.randn(T, H, 512, device=DEV).bfloat16()
    src = qg[..., :256]  # the query half of q_proj's [query | gate] heads
    w = (torch.randn(256, device=DEV) * 0.1).bfloat16()
    pos = torch.randint(0, 16384, (T,), dtype=torch.int32, device=DEV)
    dst = poisoned((T + 5, H, 256), torch.bfloat16)
    cos, sin = K.rotary_table(pos, 64, 1e7)
    K.qk_norm_rope(src, w, cos, sin, 1e-6, dst=dst, dst_row0=5)
    exp = ref.qk_norm_rope(src.cpu(), w.cpu(), pos.cpu(), 64, 1e7, 1e-6)
    assert rel(dst[5:], exp) < BF16_TOL


def test_silu_mul_and_gather(K, ref):
    T, inter = 33, 17408
    gu = torch.randn(T, 2 * inter, device=DEV).bfloat16()
    out = poisoned((T, inter), torch.bfloat16)
    K.silu_mul(gu, out=out)
    assert rel(out, ref.silu_mul(gu.cpu())) < BF16_TOL
    src = torch.randn(T, 5120, device=DEV).bfloat16()
    idx = torch.tensor([3, 32, 0, 3], dtype=torch.int32, device=DEV)
    got = K.gather_rows(src, idx, out=poisoned((4, 5120), torch.bfloat16))
    assert torch.equal(got, src[idx.long()])


@pytest.mark.parametrize("split", [1, 37, 64, 100, 128, 133])
def test_gdn_chunked_in_pass_parent_is_exact(K, split):
    """A parent [0, split) and its child [split, L) in one launch, two levels (the child's tail
    rows are the parent's packed rows, its state the parent's final): the same bits as the
    prompt run whole."""
    L = 300
    cu, qn, kn, v, g, beta, pos, _, _ = chunked_case(K, [L], [0], False)
    whole_o, whole_f, whole_t = KC.gdn_chunked(qn, kn, v, g, beta, cu, pos, L)
    H, width = v.shape[1], KC.gdn_tail_width(kn.shape[1], v.shape[1])
    tail = split % 64
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    src = KC.ChunkSources(
        init_slots=torch.zeros(1, H, 128, 128, device=DEV),
        init_idx=i32([-1, -2]),  # the child starts from run 0's final state
        tails=torch.zeros(64, width, device=DEV),
        tail_src=i32([0] * 64 + [split - tail + r for r in range(tail)] + [0] * (64 - tail)),
        level_off=i32([0, 1, 2]),
        num_levels=2,
    )
    two_cu = i32([0, split, L])
    o, f, t = KC.gdn_chunked(qn, kn, v, g, beta, two_cu, pos, max(split, L - split), sources=src)
    assert torch.equal(o, whole_o), "outputs"
    assert torch.equal(f[1], whole_f[0]), "the child's final state"
    assert torch.equal(t[1, : L % 64], whole_t[0, : L % 64]), "the child's tail"

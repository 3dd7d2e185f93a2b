"""Microbenchmark of the CUDA kernels on the 27B layer shapes, with the card's two ceilings.

Each op is captured once in a CUDA graph and its replays are timed with CUDA events (median of
20 after 5 warm-up replays), so host launch overhead stays out, as it does in the runner's
graphs. For each op: the fewest bytes it must move and the FLOPs it must do, the floor
max(bytes / copy_bw, flops / rate) with the rate that applies (bf16 tensor cores or fp32
CUDA cores), and measured / floor.

    PYTHONPATH=. python3 benchmarks/kernels_gpu.py [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from openjev.worker.cuda import chunked_gdn as KC
from openjev.worker.cuda import kernels as K

DEV = "cuda"
HID, INTER, HQ, HKV, HD = 5120, 17408, 24, 4, 256
H, HK, DKV = 48, 16, 128
CONV_C = 2 * HK * DKV + H * DKV
FP32_RATE = 67e12  # datasheet plain fp32 (the GDN recurrence runs on CUDA cores)


def time_graph(fn, reps: int = 20, warmup: int = 5) -> float:
    """Median ms of graph replays of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # eager warm-up: module load and allocations outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_eager(fn, reps: int = 20, warmup: int = 5) -> float:
    """Median ms of eager calls (host launch overhead included): the fallback when capture fails."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_op(fn) -> tuple[float, str]:
    try:
        return time_graph(fn), "graph"
    except Exception as exc:  # noqa: BLE001 - record and go on: one op must not sink the run
        print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        torch.cuda.synchronize()
        return time_eager(fn), "eager"


def ceilings() -> tuple[float, float]:
    """(device copy bytes/s counting read + write, bf16 GEMM FLOP/s), the GEMM first so the
    clocks are up before the copy is timed."""
    m = 8192
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    for _ in range(20):
        a @ b
    ms = time_graph(functools.partial(torch.matmul, a, b), reps=20)
    mma_rate = 2 * m**3 / (ms * 1e-3)
    del a, b
    n = 1 << 31  # 4 GiB of bf16 each way
    src = torch.randn(n // 2, device=DEV).view(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = min(time_eager(lambda: dst.copy_(src), reps=20), time_graph(lambda: dst.copy_(src), reps=20))
    return 2 * src.numel() * 2 / (ms * 1e-3), mma_rate


def _fla_case(qn, kn, v, g, beta, init):
    """flash-linear-attention's chunked gated delta rule on the same inputs (bf16 q, k, v as the
    model feeds it; q is already scaled), or None where it does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - an optional comparison
        print(f"fla: not timed ({type(exc).__name__}: {exc})")
        return None
    q, k, vv = qn.bfloat16()[None], kn.bfloat16()[None], v.contiguous()[None]
    return lambda: chunk_gated_delta_rule(
        q, k, vv, g[None], beta[None], scale=1.0, initial_state=init, output_final_state=True
    )


def _fla_stages(qn, kn, v, g, beta, init):
    """fla's forward as the four launches its chunk_gated_delta_rule_fwd makes (the decays' cumsum;
    k k^T, the solve and W, U: "intra"; the state pass; the output pass), each timed alone on the
    outputs of the one before: which of ours (solve, state, out) is furthest behind its match."""
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:  # noqa: BLE001 - an optional comparison (_fla_case says why)
        return []
    q, k, vv, bb = qn.bfloat16()[None], kn.bfloat16()[None], v.contiguous()[None], beta[None]
    cumsum = lambda: chunk_local_cumsum(g[None], chunk_size=64, scale=RCP_LN2)  # noqa: E731
    gc = cumsum()
    intra = lambda: chunk_gated_delta_rule_fwd_intra(k=k, v=vv, g=gc, beta=bb, chunk_size=64)  # noqa: E731
    w, u, _ = intra()
    state = lambda: chunk_gated_delta_rule_fwd_h(  # noqa: E731
        k=k, w=w, u=u, g=gc, initial_state=init, output_final_state=True, chunk_size=64
    )
    h, v_new, _ = state()
    out = lambda: chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=1.0, chunk_size=64)  # noqa: E731
    return [("cumsum", cumsum), ("intra", intra), ("state", state), ("out", out)]


def cases(T: int):
    """(name, fn, bytes, flops, rate_kind) for the 27B shapes at T tokens (one segment)."""
    r = lambda *s: torch.randn(*s, device=DEV).bfloat16()  # noqa: E731
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    out = []
    proj = r(T, CONV_C + HID)  # stands in for the fused in_proj output
    x = proj[:, :CONV_C]
    w = r(CONV_C, 4)
    win, wsrc = r(1, 3, CONV_C), K.own_windows(1, DEV)
    out.append(("conv1d", lambda: K.causal_conv1d(x, w, win, wsrc, cu), 2 * T * CONV_C * 2, 8 * T * CONV_C, "bw"))
    for rows in (4, 16):  # the rows a thread walks (conv1d: traits.CONV.rows(T))
        fn = lambda n=rows: K.causal_conv1d(x, w, win, wsrc, cu, rows=n)  # noqa: E731
        out.append((f"conv1d_rows{rows}", fn, 2 * T * CONV_C * 2, 8 * T * CONV_C, "bw"))
    conv, _ = K.causal_conv1d(x, w, win, wsrc, cu)
    ab = r(T, 2 * H)
    a_log, dt = torch.rand(H, device=DEV), torch.randn(H, device=DEV)
    prep = lambda: K.gdn_prepare(conv, ab[:, :H], ab[:, H:], a_log, dt, HK)  # noqa: E731
    out.append(("gdn_prepare", prep, T * (2 * HK * DKV * 2 + 2 * H * 2 + 2 * HK * DKV * 4 + 2 * H * 4), 0, "bw"))
    qn, kn, g, beta, kq = prep()
    v = conv[:, 2 * HK * DKV :].unflatten(1, (H, DKV))
    init = torch.randn(1, H, DKV, DKV, device=DEV) * 0.1
    gdn_bytes = T * (2 * HK * DKV * 4 + HK * 4 + H * DKV * 2 * 2 + 2 * H * 4) + 2 * H * DKV * DKV * 4
    gdn_flops = T * H * DKV * DKV * 7  # S^T k, S^T q (FMA = 2), decay+update (3)
    for variant in K.GDN_VARIANTS:
        fn = lambda vr=variant: K.gdn_recurrent(qn, kn, kq, v, g, beta, cu, init, variant=vr)  # noqa: E731
        out.append((f"gdn_recurrent_{variant}", fn, gdn_bytes, gdn_flops, "fp32"))
    # chunked (WY) form on tf32 tensor cores, per 64-token chunk and head: k k^T and T [K | V] in
    # the solve; W S and K~^T U in the state pass; q k^T, (e^G q) S_c and P U in the output pass
    chunks = -(-T // 64)
    chunk_flops = 2 * chunks * H * (64 * 64 * 128 + 64 * 64 * 256 + 3 * 64 * 128 * 128 + 2 * 64 * 64 * 128)
    # + scratch traffic per chunk and head in [64, 128] fp32 tiles: W written once, read by 2
    # column halves; U~ written, read; U written, read; S_c ([128, 128]) written, read
    chunk_bytes = gdn_bytes + chunks * H * 64 * DKV * 4 * (3 + 2 + 2 + 4)
    pos = torch.arange(T, dtype=torch.int32, device=DEV)
    width, max_chunks = KC.gdn_tail_width(HK, H), (T + 126) // 64
    src = KC.ChunkSources.per_segment(1, H, width, DEV, init)  # made once: the runner's slots hold states
    for sv in KC.GDN_STATE_VARIANTS:
        fn = lambda sv=sv: KC.gdn_chunked(qn, kn, v, g, beta, cu, pos, T, state_variant=sv, sources=src)  # noqa: E731
        out.append((f"gdn_chunked_{sv}", fn, chunk_bytes, chunk_flops, "tf32"))
    # the stages alone (the state pass overwrites U~ with U, so it is timed after a solve)
    geo = (1, H, HK, max_chunks, width)
    w = torch.empty(max_chunks + 1, H, 64, DKV, device=DEV)
    u, sc = torch.empty_like(w), torch.empty(max_chunks + 1, H, DKV, DKV, device=DEV)
    gc, tl = torch.empty(max_chunks + 1, H, 64, device=DEV), torch.empty(1, 64, width, device=DEV)
    kt = torch.empty(max_chunks + 1, HK, 64, DKV, device=DEV)
    fin, o = torch.empty(1, H, DKV, DKV, device=DEV), torch.empty(T, H, DKV, device=DEV).bfloat16()
    plan = KC.gdn_chunk_plan(cu, pos, max_chunks, max_chunks, src)
    solve = lambda: KC.gdn_chunk_solve(geo, kn, v, g, beta, src, tl, w, u, gc, kt, plan)  # noqa: E731
    state = lambda sv: KC.gdn_chunk_state(geo, kt, w, u, gc, cu, pos, src, 0, sc, fin, plan, sv)  # noqa: E731
    for sv in KC.GDN_STATE_VARIANTS:
        out.append((f"gdn_chunked:solve+state_{sv}", lambda sv=sv: (solve(), state(sv)), 0, 0, "bw"))
    out.append(("gdn_chunked:solve", solve, 0, 0, "bw"))
    out.append(("gdn_chunked:out", lambda: KC.gdn_chunk_out(geo, qn, kt, u, sc, gc, o, plan), 0, 0, "bw"))
    fla = _fla_case(qn, kn, v, g, beta, init)
    if fla is not None:
        out.append(("fla_chunk_gdn", fla, gdn_bytes, chunk_flops, "tf32"))
        out += [(f"fla_chunk_gdn:{n}", fn, 0, 0, "bw") for n, fn in _fla_stages(qn, kn, v, g, beta, init)]
    q, kv, gate = r(T, HQ, HD), r(2, T, HKV, HD), r(T, HQ, 2 * HD)[..., HD:]
    rows = torch.arange(T, dtype=torch.int32, device=DEV)
    att_flops = 4 * HQ * HD * T * (T + 1) / 2
    att_bytes = 2 * (2 * T * HQ * HD + 2 * T * HKV * HD + T * HQ * HD)
    # the bare name is the single-buffered form (what the name timed before the pipelined one existed,
    # so attention-ab against an older tree compares the same form); the runner's choice is one of the two
    forms = (("", False), (":pipelined", True))
    for form, pipelined in forms:

        def att(p=pipelined):
            return K.tree_attention(q, kv[0], kv[1], rows, cu, cu, T, gate=gate, pipelined=p)

        out.append(("tree_attention" + form, att, att_bytes, att_flops, "mma"))
    # a state-cache hit: a 40-token question and 8 five-token candidates under T cached keys
    lens = [40] + [5] * 8
    ctx_cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)
    ctx_rows = torch.cat(
        [torch.cat([rows, T + ctx_cu[i] + torch.arange(n, device=DEV, dtype=torch.int32)]) for i, n in enumerate(lens)]
    )
    ctx_cu_k = torch.tensor([0, *itertools.accumulate(T + n for n in lens)], dtype=torch.int32, device=DEV)
    cq, ckv = r(sum(lens), HQ, HD), r(2, T + sum(lens), HKV, HD)
    ctx_flops = 4 * HQ * HD * sum(lens) * T
    for form, pipelined in forms:

        def ctx(p=pipelined):
            return K.tree_attention(cq, ckv[0], ckv[1], ctx_rows, ctx_cu, ctx_cu_k, max(lens), pipelined=p)

        out.append(("tree_attention:cached_context" + form, ctx, 2 * (T * 2 * HKV * HD), ctx_flops, "mma"))
    # a graph pass's shape: 8 requests' segments, then the pad segment, then empty ones up to the
    # key's min(64, T) + 1 (the runner's grid), attention over max_q = T rounded up to 64; the
    # runner's form for that max_q
    real = [T // 10] * 8
    pad_lens = real + [T - sum(real)] + [0] * (min(64, T) - 8)
    pad_cu = torch.tensor([0, *itertools.accumulate(pad_lens)], dtype=torch.int32, device=DEV)
    max_q = 64 * -(-T // 64)
    pass_flops = 4 * HQ * HD * sum(n * (n + 1) / 2 for n in pad_lens)
    graph_pass = lambda: K.tree_attention(q, kv[0], kv[1], rows, pad_cu, pad_cu, max_q, gate=gate)  # noqa: E731
    out.append(("tree_attention:graph_pass", graph_pass, att_bytes, pass_flops, "mma"))
    qt, kt, vt = q.transpose(0, 1)[None], kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)  # noqa: E731
    out.append(("torch_sdpa(ref)", sdpa, att_bytes, att_flops, "mma"))
    res, add, wn = r(T, HID), r(T, HID), r(HID) * 0.1
    out.append(("add_rms_norm", lambda: K.add_rms_norm(res, wn, 1e-6, x_add=add), 4 * T * HID * 2, 0, "bw"))
    o, z, wg = r(T, H, DKV), r(T, H * DKV), r(DKV)
    out.append(("gated_rms_norm", lambda: K.gated_rms_norm(o, z, wg, 1e-6), 3 * T * H * DKV * 2, 0, "bw"))
    qg = r(T, HQ, 2 * HD)
    pos = torch.arange(T, dtype=torch.int32, device=DEV)
    wq = r(HD) * 0.1
    cos, sin = K.rotary_table(pos, 64, 1e7)
    rope = lambda: K.qk_norm_rope(qg[..., :HD], wq, cos, sin, 1e-6)  # noqa: E731
    out.append(("qk_norm_rope(q)", rope, 2 * T * HQ * HD * 2, 0, "bw"))
    gu = r(min(T, 4096), 2 * INTER)
    out.append(("silu_mul", lambda: K.silu_mul(gu), 3 * gu.shape[0] * INTER * 2, 0, "bw"))
    return out


def gdn_layer_graph(T: int) -> float:
    """The whole GDN mixer core (conv, prepare, the runner's default serial recurrence, gated
    norm) in one graph."""
    r = lambda *s: torch.randn(*s, device=DEV).bfloat16()  # noqa: E731
    cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    proj = r(T, CONV_C + H * DKV + 2 * H)
    w, win, nw = r(CONV_C, 4), r(1, 3, CONV_C), r(DKV)
    src = K.own_windows(1, DEV)
    a_log, dt = torch.rand(H, device=DEV), torch.randn(H, device=DEV)
    init = torch.randn(1, H, DKV, DKV, device=DEV) * 0.1

    def core():
        conv, _ = K.causal_conv1d(proj[:, :CONV_C], w, win, src, cu)
        z = proj[:, CONV_C : CONV_C + H * DKV]
        ab = proj[:, CONV_C + H * DKV :]
        qn, kn, g, beta, kq = K.gdn_prepare(conv, ab[:, :H], ab[:, H:], a_log, dt, HK)
        o, _ = K.gdn_recurrent(qn, kn, kq, conv[:, 2 * HK * DKV :].unflatten(1, (H, DKV)), g, beta, cu, init)
        return K.gated_rms_norm(o, z, nw, 1e-6)

    return time_graph(core)


def runner_capacity(shape: str = "27b") -> list[dict]:
    """End-to-end CudaRunner launches on seeded random weights, with each GDN kernel: a 512-token
    prompt, a 16,384-token candidate in 4 chained 4,096-token launches, and 33 candidates sharing
    a 2,048-token prefix, eagerly; then the first and last replayed from CUDA graphs. Wall time
    and peak device memory of each."""
    import time

    from openjev.worker.cuda.graph_launch import GraphLauncher
    from openjev.worker.cuda.runner import GDN_KERNELS, CudaRunner
    from openjev.worker.runner_api import SegmentRun

    t0 = time.perf_counter()
    first = CudaRunner.synthetic(shape, seed=0, graph_cache_size=0)
    torch.cuda.synchronize()
    weights_gb = torch.cuda.memory_allocated() / 1e9
    rows = [dict(case=f"{shape} weights built", s=time.perf_counter() - t0, peak_gb=weights_gb)]
    gen = torch.Generator().manual_seed(0)
    toks = lambda n: torch.randint(0, first.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731

    def timed(name, fn, repeat=3):
        fn()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rows.append(dict(case=name, s=statistics.median(times), peak_gb=torch.cuda.max_memory_allocated() / 1e9))
        return out

    p512, long = toks(512), toks(16384)
    tails = [toks(24) for _ in range(33)]
    prefix_tokens = toks(2048)

    def chained(runner):
        state, res = None, None
        for i in range(4):
            res = runner.run_launch([SegmentRun(long[i * 4096 : (i + 1) * 4096], i * 4096, state, i < 3, i == 3)])
            state = res[0].state
        return res

    def one_kernel(kernel: str) -> None:
        runner = CudaRunner.on_weights_of(first, graph_cache_size=0, gdn_kernel=kernel, gemm_min_rows=1)
        runner.gemm_rows, runner.stream_rows, runner.lt = first.gemm_rows, first.stream_rows, first.lt  # same paths
        timed(f"{kernel}: 1 x 512 tokens", lambda: runner.run_launch([SegmentRun(p512, 0, None, False, True)]))
        timed(f"{kernel}: 1 x 16384 (4 x 4096 chained)", functools.partial(chained, runner), repeat=1)
        prefix = runner.run_launch([SegmentRun(prefix_tokens, 0, None, True, False)])[0].state
        tail_runs = [SegmentRun(t, 2048, prefix, False, True) for t in tails]
        timed(f"{kernel}: 33 x 24-token tails on a 2048 prefix", lambda: runner.run_launch(tail_runs))
        runner.graphs = GraphLauncher(runner, 8, capture_after=1)  # timed()'s warm-up call captures
        timed(
            f"{kernel}: 1 x 512 tokens, CUDA graph", lambda: runner.run_launch([SegmentRun(p512, 0, None, False, True)])
        )
        timed(f"{kernel}: 33 tails, CUDA graph", lambda: runner.run_launch(tail_runs))

    for kernel in GDN_KERNELS:
        one_kernel(kernel)
        torch.cuda.empty_cache()
    return rows


def _safe(fn, *args) -> float:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        print(f"{fn.__name__} failed: {exc!r}")
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels_gpu.json")
    ap.add_argument("--tokens", default="512,4096,16384")
    ap.add_argument("--capacity", default="", help="also run CudaRunner end to end on this shape")
    ap.add_argument("--ops", default="", help="only ops whose name contains one of these (comma-separated)")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw, mma_rate = ceilings()
    rates = {"bw": None, "fp32": FP32_RATE, "mma": mma_rate, "tf32": mma_rate / 2}  # dense tf32: half of bf16
    rows = []
    for T in [int(t) for t in args.tokens.split(",") if t]:
        for name, fn, nbytes, flops, kind in cases(T):
            if not any(op in name for op in args.ops.split(",")):
                continue
            ms, how = time_op(fn)
            floor = max(nbytes / copy_bw, flops / rates[kind] if rates[kind] else 0.0) * 1e3
            print(f"  {name} T={T}: {ms:.4f} ms", flush=True)  # as it goes: a run cut short keeps these
            rows.append(
                dict(
                    op=name + ("" if how == "graph" else "[eager]"),
                    tokens=T,
                    ms=ms,
                    floor_ms=floor,
                    ratio=ms / floor if floor else float("nan"),
                    gbytes=nbytes / 1e9,
                    gflop=flops / 1e9,
                )
            )
        if args.ops in "gdn_layer_core":
            rows.append(
                dict(
                    op="gdn_layer_core(graph)",
                    tokens=T,
                    ms=_safe(gdn_layer_graph, T),
                    floor_ms=float("nan"),
                    ratio=float("nan"),
                    gbytes=0.0,
                    gflop=0.0,
                )
            )
        torch.cuda.empty_cache()
    result = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        card=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bw_tb_s=copy_bw / 1e12,
        bf16_tflop_s=mma_rate / 1e12,
        rows=rows,
    )
    if args.capacity:
        torch.cuda.empty_cache()
        try:
            result["runner"] = runner_capacity(args.capacity)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            result["runner_error"] = repr(exc)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{result['card']}  copy {copy_bw / 1e12:.2f} TB/s  bf16 GEMM {mma_rate / 1e12:.0f} TFLOP/s")
    print(f"{'op':28s} {'T':>6s} {'ms':>9s} {'floor':>9s} {'x floor':>8s}")
    for r in rows:
        print(f"{r['op']:28s} {r['tokens']:6d} {r['ms']:9.4f} {r['floor_ms']:9.4f} {r['ratio']:8.1f}")
    for r in result.get("runner", []):
        print(f"runner {r['case']:40s} {r['s'] * 1e3:10.1f} ms  peak {r['peak_gb']:7.2f} GB")


if __name__ == "__main__":
    main()

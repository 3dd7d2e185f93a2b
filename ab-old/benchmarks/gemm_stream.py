"""Products of few rows against the weight read: gemm_stream (every variant) vs cuBLAS (torch
F.linear, and as the runner called it before 2026-12-01: padded per worker/cuda/gemm.py; and "now":
gemm.linear with gemm_stream and cuBLASLt's unsplit algorithms chosen as the runner chooses them)
vs a device-to-device copy, for every weight shape of a 27B layer and M in ROWS. GPU only.

Timing: CUDA events around each call, methods interleaved within a round, the median of the
rounds. Each call takes the next of several weight copies (none finds its weight in L2), the
copy's dirty lines are evicted before the next call, and a round counts only if the host queued
all of it while a sleep kernel held the GPU (no launch gap inside a timing): time_methods. The
ceiling is a 2 GiB device copy (bytes read + written over time, as docs/cuda-kernels.md counts
it); a product's rate is its weight bytes over its time.

Bit checks: every variant's rows against the chosen variant's at the largest M; gemm_stream
against cuBLAS at every M and at 2,048 rows (where cuBLAS does not split K); cuBLAS's kernel
names per row count (torch profiler).

    python3 benchmarks/gemm_stream.py --out $OUT/gemm-stream.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from openjev.worker.cuda import cublaslt, gemm, gemm_stream
from openjev.worker.cuda.fused_weights import shape_config

ROWS = [1, 8, 16, 32, 48, 64, 74, 96, 128, 256]
ROTATE_BYTES = 600 * 2**20  # weight copies per shape: at least this much, 10x the L2


def layer_products(shape: str = "27b") -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the fused weights one layer multiplies by (fused_weights.py)."""
    c = shape_config(shape)
    d, inter = c.hidden_size, c.intermediate_size
    attn_q = 2 * c.num_attention_heads * c.head_dim  # q and its output gate
    return {
        "gdn_in": (c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads, d),
        "gdn_out": (d, c.linear_value_dim),
        "attn_in": (attn_q + 2 * c.num_key_value_heads * c.head_dim, d),
        "attn_out": (d, c.num_attention_heads * c.head_dim),
        "gate_up": (2 * inter, d),
        "down": (d, inter),
    }


LAYERS = {"gdn": ("gdn_in", "gdn_out", "gate_up", "down"), "attention": ("attn_in", "attn_out", "gate_up", "down")}


def copy_ceiling(rounds: int = 20) -> float:
    """Bytes read + written per second by a 2 GiB device copy."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ts = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(ts)


def time_methods(methods: dict, rounds: int, scrub: torch.Tensor) -> tuple[dict[str, float], dict]:
    """Median seconds per call of each method, a callable of the call count (it picks the weight
    copy: each call takes the next one, so none finds its weight in L2 from the call before). An
    untimed read of `scrub` after the copy evicts the copy's dirty lines, so that the next call
    does not pay their write-back. A round counts only if the host queued all of it while the GPU
    still slept (so no timing holds a launch gap); otherwise the sleep doubles and the round is
    run again."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    sleep, counted, redone, call = 4_000_000, 0, 0, 0
    while counted < rounds + 2:
        torch.cuda._sleep(sleep)
        slept = torch.cuda.Event()
        slept.record()
        events = []
        for name, fn in methods.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(call)
            e.record()
            call += 1
            events.append((name, s, e))
            if name == "copy":
                scrub.sum()
        ahead = not slept.query()
        torch.cuda.synchronize()
        if not ahead:
            sleep, redone = sleep * 2, redone + 1
            if redone > 8:
                raise RuntimeError("the host cannot queue a round ahead of the GPU")
            continue
        counted += 1
        if counted > 2:  # two warm-up rounds
            for name, s, e in events:
                samples[name].append(s.elapsed_time(e) / 1e3)
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    return medians, {"sleep_cycles": sleep, "rounds_redone": redone}


def cublas_kernels(x: torch.Tensor, w: torch.Tensor) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    F.linear(x, w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, w)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def methods_at(m: int, xs: list, ws: list, pad: int, stream: int, lt) -> dict:
    """The timed calls at M rows, call i on weight copy i % copies. "runner": cuBLAS as the runner
    called it before cuBLASLt (padded); "now": gemm.linear with gemm_stream up to `stream` rows and
    the cuBLASLt algorithms chosen as the runner chooses them at start (gemm.choose_algorithms)."""
    xm, copies = [t[:m] for t in xs], len(ws)
    flat = torch.empty(ws[0].numel(), dtype=torch.bfloat16, device="cuda")
    methods = {
        "copy": lambda i: flat.copy_(ws[i % copies].view(-1)),
        "cublas": lambda i: F.linear(xm[i % copies], ws[i % copies]),
        "runner": lambda i: gemm.linear(xm[i % copies], ws[i % copies], pad),
        "now": lambda i: gemm.linear(xm[i % copies], ws[i % copies], pad, stream, lt),
    }
    for code in gemm_stream.VARIANTS:
        methods[f"v{code}"] = lambda i, c=code: gemm_stream.linear(xm[i % copies], ws[i % copies], code=c)
    return methods


def measure_shape(n: int, k: int, rounds: int, gen, scrub: torch.Tensor) -> dict:
    wbytes = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // wbytes))
    ws = [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16() for _ in range(copies)]
    xs = [torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
    pad = gemm.invariant_from(ws[0])  # what the runner pads this shape's products to
    stream, lt = gemm_stream.stream_rows(n, k), cublaslt.UnsplitLinear(n, k)
    gemm.choose_algorithms(lt, ws[0], pad, stream, ROWS)  # as the runner does at start
    result: dict = {"N": n, "K": k, "weight_bytes": wbytes, "runner_pad_rows": pad, "rows": {}}
    result["cublaslt_rows"] = sorted(lt.rows)

    # bits: every variant against the chosen one at the largest M; ours against cuBLAS
    x, w = xs[0], ws[0]
    ref = gemm_stream.linear(x, w)
    result["variants_equal"] = all(torch.equal(gemm_stream.linear(x, w, code=c), ref) for c in gemm_stream.VARIANTS)
    x2048 = torch.randn(2048, k, device="cuda", generator=gen).bfloat16()
    ours2048, cub2048 = gemm_stream.linear(x2048, w), F.linear(x2048, w)
    result["rows_equal_cublas_2048"] = int((ours2048 == cub2048).all(dim=1).sum())
    result["elements_equal_cublas_2048"] = (ours2048 == cub2048).double().mean().item()
    exact = x2048.double() @ w.double().T
    result["rel_err_2048"] = {
        "ours": ((ours2048.double() - exact).norm() / exact.norm()).item(),
        "cublas": ((cub2048.double() - exact).norm() / exact.norm()).item(),
    }
    try:
        result["cublas_kernels"] = {m: cublas_kernels(x2048[:m], w) for m in (1, 16, 74, 256, 2048)}
    except Exception as e:  # the profiler is a side look: its failure must not cost the timings
        result["cublas_kernels"] = repr(e)

    for m in ROWS:
        row: dict = {}
        cub = F.linear(x[:m], w)
        ours = gemm_stream.linear(x[:m], w)
        row["rows_equal_cublas"] = int((ours == cub).all(dim=1).sum())
        row["rows_equal_ours_full"] = bool(torch.equal(ours, ref[:m]))
        times, row["timing"] = time_methods(methods_at(m, xs, ws, pad, stream, lt), rounds, scrub)
        best = min((t, c) for c, t in times.items() if c.startswith("v"))
        chosen = gemm_stream.choose(m, n, k).code
        row.update(times_s=times, best_variant=best[1], best_s=best[0], chosen_variant=chosen)
        result["rows"][m] = row
    del ws, xs
    torch.cuda.empty_cache()
    return result


def summarise(shapes: dict, ceiling: float) -> list[str]:
    lines = [
        f"copy ceiling {ceiling / 1e12:.2f} TB/s (2 GiB copy, read + write)",
        "",
        "| product (N x K) | M | cuBLAS us (TB/s) | runner us | ours best us (TB/s, variant) | ours chosen us "
        "| copy us |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in shapes.items():
        b = s["weight_bytes"]
        for m, row in s["rows"].items():
            t = row["times_s"]
            ch = t[f"v{row['chosen_variant']}"]
            lines.append(
                f"| {name} ({s['N']} x {s['K']}) | {m} | {t['cublas'] * 1e6:.1f} ({b / t['cublas'] / 1e12:.2f}) "
                f"| {t['runner'] * 1e6:.1f} | {row['best_s'] * 1e6:.1f} ({b / row['best_s'] / 1e12:.2f}, "
                f"{row['best_variant']}) | {ch * 1e6:.1f} | {t['copy'] * 1e6:.1f} |"
            )
    lines += [
        "",
        "Summed over a layer's products: weight bytes / summed time, as a fraction of the copy ceiling",
        "",
        "| layer | M | floor us | cuBLAS | runner | ours best | ours chosen | min(ours chosen, runner) | now |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layer, names in LAYERS.items():
        if not all(p in shapes for p in names):
            continue
        for m in ROWS:
            b = sum(shapes[p]["weight_bytes"] for p in names)
            rows = [shapes[p]["rows"][m] for p in names]
            cols = {
                "cublas": sum(r["times_s"]["cublas"] for r in rows),
                "runner": sum(r["times_s"]["runner"] for r in rows),
                "best": sum(r["best_s"] for r in rows),
                "chosen": sum(r["times_s"][f"v{r['chosen_variant']}"] for r in rows),
                # a dispatcher per product: ours (chosen variant) or the runner's cuBLAS call
                "dispatch": sum(min(r["times_s"][f"v{r['chosen_variant']}"], r["times_s"]["runner"]) for r in rows),
                # what the runner does since 2026-12-01: gemm_stream, cuBLASLt's chosen algorithms, padding
                "now": sum(r["times_s"]["now"] for r in rows),
            }
            cells = " | ".join(f"{t * 1e6:.0f} us, {b / t / ceiling:.0%}" for t in cols.values())
            lines.append(f"| {layer} | {m} | {b / ceiling * 1e6:.0f} | {cells} |")
    lines += [
        "",
        "| product | variants equal | rows equal to cuBLAS at M=2048 | per M (rows equal / M) | rel err ours, cuBLAS |",
    ]
    lines += ["|---|---|---|---|---|"]
    for name, s in shapes.items():
        per_m = ", ".join(f"{m}: {r['rows_equal_cublas']}" for m, r in s["rows"].items())
        e = s["rel_err_2048"]
        lines.append(
            f"| {name} | {s['variants_equal']} | {s['rows_equal_cublas_2048']} / 2048 "
            f"({s['elements_equal_cublas_2048']:.4f} of elements) | {per_m} "
            f"| {e['ours']:.2e}, {e['cublas']:.2e} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--products", default="", help="comma-separated subset of the product names")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the runner
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceiling = copy_ceiling()
    scrub = torch.randn(2**27, device="cuda")  # 512 MiB, read between a copy and the next call
    products = layer_products()
    wanted = [p for p in args.products.split(",") if p] or list(products)
    shapes: dict = {}
    for name in wanted:
        same = [p for p in shapes if products[p] == products[name]]
        if same:  # attn_out has gdn_out's shape: measured once, reported under both names
            shapes[name] = shapes[same[0]]
            continue
        shapes[name] = measure_shape(*products[name], args.rounds, gen, scrub)
        print(f"{name}: done", flush=True)
    print("\n".join(summarise(shapes, ceiling)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"ceiling_bytes_per_s": ceiling, "device": torch.cuda.get_device_name(), "shapes": shapes}, f, indent=1
            )


if __name__ == "__main__":
    main()

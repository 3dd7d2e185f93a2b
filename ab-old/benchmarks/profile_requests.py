"""Where a request's time goes on the GPU: one short and one long request of the workload through
the CUDA runner (27B shape, synthetic weights), with and without CUDA graphs.

For each request: wall time of the engine (median of 5 after 2 warm-ups), its roofline floor,
and from torch.profiler the device time per kernel family plus the share of the wall time the
device was idle (host work: Python, planning, launches, copies of state).

    PYTHONPATH=. python3 benchmarks/profile_requests.py --model .openjev/demo-model \
        --workload benchmarks/workload.jsonl [--out profile.md] [--cases noul:1-128,score:129-512]
        [--graphs-only] [--host]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from openjev.tools.bench import roofline, workload
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker import scheduler as scheduler_module
from openjev.worker.cuda.runner import CudaRunner
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.cost import default_cost_model

FAMILIES = [  # (family, substrings of kernel names), first match wins
    ("GEMM (cuBLAS)", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "splitk", "reduce_kernel")),
    ("GDN kernel (serial recurrence, or chunked solve + state pass)", ("gdn_chunk", "gdn_recurrent")),
    ("tree attention", ("tree_attention",)),
    ("conv1d", ("conv1d",)),
    ("norms, rope, gating, GDN prep", ("rms_norm", "rope", "silu", "gdn_prepare", "gather")),
    ("copies, fills, other", ("",)),
]


def family(name: str) -> str:
    low = name.lower()
    return next(f for f, keys in FAMILIES if any(k in low for k in keys))


def pick(cases, kind: str, group: str):
    return next(c for c in cases if c.kind == kind and c.group == group)


def timed(engine: Engine, work, temperature: float, repeats: int = 5) -> float:
    for _ in range(2):
        engine.execute(work, temperature=temperature, policy="auto")
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.execute(work, temperature=temperature, policy="auto")
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def profiled(engine: Engine, work, temperature: float) -> tuple[dict[str, float], float, float, dict[str, float]]:
    """(device seconds per family, device seconds in all, wall seconds, idle seconds by where) of
    one execution. Idle: before the first kernel (host work before the launch), between kernels
    (launch gaps, host waits inside the request) and after the last (results to the host)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        with record_function("openjev_request"):
            engine.execute(work, temperature=temperature, policy="auto")
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    per = defaultdict(float)
    spans = []
    request = None
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            per[family(event.name)] += event.device_time_total * 1e-6
            spans.append((event.time_range.start, event.time_range.end))
        elif event.name == "openjev_request":
            request = event.time_range
    idle: dict[str, float] = {}
    if spans and request is not None:  # profiler times are microseconds on one clock
        spans.sort()
        gaps, reach = 0.0, spans[0][1]
        for s, e in spans[1:]:
            gaps += max(0.0, s - reach)
            reach = max(reach, e)
        idle = {
            "before the first kernel": 1e-6 * max(0.0, spans[0][0] - request.start),
            "between kernels": 1e-6 * gaps,
            "after the last kernel": 1e-6 * max(0.0, request.end - reach),
        }
    return dict(per), sum(per.values()), wall, idle


def host_profile(engine: Engine, works: list, temperature: float) -> str:
    """Top functions by own time on the scheduler's thread (its `_step`) over `works` (Python
    3.12 lets one cProfile run at a time, so the request thread is left out)."""
    prof = cProfile.Profile()
    step = engine.scheduler._step

    def profiled_step(jobs):
        prof.enable()
        try:
            step(jobs)
        finally:
            prof.disable()

    spent = {"plan": 0.0, "prepare": 0.0}

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    plan, prep = engine.plan, scheduler_module.prepare
    engine.scheduler._step = profiled_step  # type: ignore[method-assign]
    engine.plan = timed("plan", plan)  # type: ignore[method-assign]
    scheduler_module.prepare = timed("prepare", prep)
    for w in works:
        engine.execute(w, temperature=temperature, policy="auto")
    engine.scheduler._step, engine.plan, scheduler_module.prepare = step, plan, prep  # type: ignore[method-assign]
    out = io.StringIO()
    out.write(
        ", ".join(f"{k} {1e3 * v / len(works):.2f} ms" for k, v in spent.items()) + " a request (request thread)\n"
    )
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--shape", default="27b")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cases", default="noul:1-128,choice:2049-4096", help="kind:group of each request profiled")
    p.add_argument("--graphs-only", action="store_true", help="skip the eager arm")
    p.add_argument("--host", action="store_true", help="also cProfile the scheduler thread's host work (graphs)")
    p.add_argument("--gdn-kernel", default="serial", help="serial or chunked (CudaRunner gdn_kernel)")
    args = p.parse_args()

    meta, candidates_of, _ = longest_tokens_fn(args.model)
    cases = workload.read_jsonl(args.workload)
    chosen = [pick(cases, *spec.split(":")) for spec in args.cases.split(",")]
    graph = CudaRunner.synthetic(args.shape, seed=0, graph_capture_after=1, gdn_kernel=args.gdn_kernel)
    eager = CudaRunner.on_weights_of(
        graph,
        graph_cache_size=0,
        gemm_min_rows=None,
    )
    ceilings = roofline.measure_ceilings()
    lines = [
        f"# Per-stage profile, {datetime.date.today().isoformat()}",
        "",
        f"- card {ceilings.device}; {args.shape} shape, synthetic weights, policy auto; "
        "command: `PYTHONPATH=. python3 benchmarks/profile_requests.py --model .openjev/demo-model "
        "--workload benchmarks/workload.jsonl`",
        f"- ceilings: copy {ceilings.copy_bytes_per_second / 1e12:.2f} TB/s, "
        f"bf16 GEMM {ceilings.matmul_flops_per_second / 1e12:.0f} TFLOP/s",
        "",
    ]
    for case in chosen:
        ids = candidates_of(case.request)
        kinds = [q["type"] for q in case.request["questions"].values()]
        work = [QuestionWork(kind, tuple(tuple(t) for t in q)) for kind, q in zip(kinds, ids, strict=True)]
        submitted = sum(len(t) for q in ids for t in q)
        lines += [f"## {case.name}: {sum(len(q) for q in ids)} candidates, {submitted} tokens submitted", ""]
        for name, runner in (("graphs", graph),) + (() if args.graphs_only else (("eager", eager),)):
            engine = Engine(runner, cost_model=default_cost_model("cuda"))
            wall = timed(engine, work, meta.temperature)
            result = engine.execute(work, temperature=meta.temperature, policy="auto")
            floor = roofline.floor_seconds(runner.config, result.num_computed_tokens, ceilings)
            per, device, profiled_wall, idle = profiled(engine, work, meta.temperature)
            lines += [
                f"### {name}: {1e3 * wall:.1f} ms median wall (floor {1e3 * floor:.1f} ms for "
                f"{result.num_computed_tokens} computed tokens, {result.num_launches} launches: {wall / floor:.2f}x)",
                "",
                f"Profiled run: wall {1e3 * profiled_wall:.1f} ms, device busy {1e3 * device:.1f} ms, device idle "
                f"{1e3 * max(0.0, profiled_wall - device):.1f} ms (host work; the profiler itself adds some).",
                "",
                "Idle, by where: " + ", ".join(f"{where} {1e3 * s:.2f} ms" for where, s in idle.items()),
                "",
                "| kernel family | device ms | share of device time |",
                "|---|---|---|",
            ]
            for fam, seconds in sorted(per.items(), key=lambda kv: -kv[1]):
                lines.append(f"| {fam} | {1e3 * seconds:.2f} | {100 * seconds / device:.0f}% |")
            lines.append("")
            if args.host and name == "graphs":
                lines += ["Host work of 5 more requests (cProfile of the scheduler thread):", "```"]
                lines += host_profile(engine, [work] * 5, meta.temperature).splitlines() + ["```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Whole requests through the engine on runner variants side by side (the serial or the chunked
GDN kernel, the graph buckets of long passes), on the synthetic 27B runner with CUDA graphs,
the first --per-group workload requests of each kind and length group (--groups: some only).
The runners share the weights and the product paths chosen at start, so arms differ only in
their options; each request runs alternately on each (rounds interleaved, so drift lands on
every arm alike) after one untimed warm-up that captures its graphs.
Prints per request the computed tokens, each arm's padded pass size, median and spread, and its
ratio to the first arm, then whether every arm gave the first arm's choices and its bits (the
GDN kernels sum in other orders; padding must not change a bit).

    PYTHONPATH=. python3 benchmarks/runner_arms_e2e.py --model .openjev/demo-model \\
        --workload benchmarks/workload.jsonl [--arms serial,chunked] [--rounds 7] [--out e2e.md]
        [--groups 513-2048,2049-4096] [--per-group 1] [--multi 0]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from openjev.tools.bench import workload
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.cuda import gemm
from openjev.worker.cuda.buckets import Bucketing
from openjev.worker.cuda.runner import LT_ROWS, CudaRunner, product_weights
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.cost import default_cost_model

ARMS = {
    "serial": {"gdn_kernel": "serial"},
    "chunked": {"gdn_kernel": "chunked"},
    # the recurrence before the position (the worker's default without a number), the chunked kernel from it
    "split": {"gdn_kernel": "split"},
    "split128": {"gdn_kernel": "split", "gdn_split_at": 128},
    "split256": {"gdn_kernel": "split", "gdn_split_at": 256},
    "split512": {"gdn_kernel": "split", "gdn_split_at": 512},
    "split1024": {"gdn_kernel": "split", "gdn_split_at": 1024},
    # long passes in 4 token steps an octave (before 2026-12-01c)
    "untiled": {"gdn_kernel": "serial", "graph_tile_from": 0},
    # the recurrence launched once a level (before 2026-12-02b)
    "levels": {"gdn_kernel": "serial", "gdn_level_launches": True},
}


def make_runners(shape: str, names: list[str]) -> dict[str, CudaRunner]:
    first = CudaRunner.synthetic(shape, seed=0, graph_capture_after=1, **ARMS[names[0]])
    runners = {names[0]: first}
    for name in names[1:]:
        # no probing (gemm_min_rows=1): the first runner's product paths, which start-up timing
        # could have chosen otherwise, so arms differ only in their options
        other = CudaRunner.on_weights_of(first, graph_capture_after=1, gemm_min_rows=1, **ARMS[name])
        other.gemm_rows, other.stream_rows, other.lt = first.gemm_rows, first.stream_rows, first.lt
        runners[name] = other

    # cuBLASLt algorithms for the row counts only other arms' buckets have, chosen as the runner
    # chooses them at start (added to the shared plans: the first runner never meets those rows)
    def tuned(r: CudaRunner) -> set[int]:
        return {t for t in Bucketing(r.budget).token_steps() if t <= LT_ROWS}

    extra = sorted(set().union(*(tuned(r) for r in runners.values())) - tuned(first))
    for key, w in gemm.one_per_shape(product_weights(first.layers)).items():
        if extra and key in first.lt:
            gemm.choose_algorithms(first.lt[key], w, first.gemm_rows[key], first.stream_rows[key], extra)
    return runners


def argmaxes(probabilities: list[list[float]]) -> list[int]:
    return [max(range(len(p)), key=p.__getitem__) for p in probabilities]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--shape", default="27b")
    p.add_argument("--arms", default="serial,chunked", help=f"comma-separated, first is the base: {', '.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--groups", default=",".join(workload.GROUP_NAMES), help="length groups, comma-separated")
    p.add_argument("--per-group", type=int, default=1, help="requests of each kind and group")
    p.add_argument("--multi", type=int, default=0, help="also this many requests of each multi-question group")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = args.arms.split(",")
    if len(names) < 2 or any(n not in ARMS for n in names):
        raise SystemExit(f"--arms: two or more of {', '.join(ARMS)}")

    meta, candidates_of, _ = longest_tokens_fn(args.model)
    cases = workload.read_jsonl(args.workload)
    groups = args.groups.split(",")
    chosen = [
        c
        for k in ("choice", "noul", "score")
        for g in groups
        for c in [c for c in cases if (c.kind, c.group) == (k, g)][: args.per_group]
    ] + [c for g in ("3q", "4q", "8q") for c in [c for c in cases if (c.kind, c.group) == ("multi", g)][: args.multi]]
    runners = make_runners(args.shape, names)
    engines = {name: Engine(runner, cost_model=default_cost_model("cuda")) for name, runner in runners.items()}
    base = names[0]
    lines = [
        f"# Whole requests on runner variants, {datetime.date.today().isoformat()}",
        "",
        f"- card {torch.cuda.get_device_name()}; {args.shape} shape, synthetic weights, policy auto, CUDA graphs; "
        f"{args.rounds} interleaved rounds after a warm-up; command: "
        f"`python3 benchmarks/runner_arms_e2e.py --arms {args.arms}`",
        "- arms: " + "; ".join(f"{n} {ARMS[n] or '(defaults)'}" for n in names),
        "",
        "| request | computed tokens | passes | padded rows ("
        + " / ".join(names)
        + ") | "
        + " | ".join(f"{n} ms (min-max)" for n in names)
        + " | "
        + " | ".join(f"{n} / {base}" for n in names[1:])
        + f" | same choices as {base} ({' / '.join(names[1:])}) | same bits as {base} |",
        "|---|---|---|---|" + "---|" * (2 * len(names) - 1) + "---|---|",
    ]
    for case in chosen:
        ids = candidates_of(case.request)
        kinds = [q["type"] for q in case.request["questions"].values()]
        work = [QuestionWork(k, tuple(tuple(t) for t in q)) for k, q in zip(kinds, ids, strict=True)]
        results = {name: e.execute(work, temperature=meta.temperature, policy="auto") for name, e in engines.items()}
        samples: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.execute(work, temperature=meta.temperature, policy="auto")
                torch.cuda.synchronize()
                samples[name].append(time.perf_counter() - start)
        med = {name: statistics.median(s) for name, s in samples.items()}
        r = results[base]
        # a one-pass request's padded row count (passes > 1: the first pass only, marked ~)
        rows = " / ".join(
            ("~" if r.num_launches > 1 else "") + str(runners[n].budget.bucket(min(r.num_computed_tokens, 4096)))
            for n in names
        )
        cells = " | ".join(
            f"{1e3 * med[n]:.1f} ({1e3 * min(samples[n]):.1f}-{1e3 * max(samples[n]):.1f})" for n in names
        )
        ratios = " | ".join(f"{med[n] / med[base]:.3f}" for n in names[1:])
        # per other arm, so that one arm's exactness shows (split: requests that never reach its position)
        same = " / ".join(str(argmaxes(results[n].probabilities) == argmaxes(r.probabilities)) for n in names[1:])
        bits = " / ".join(str(results[n].probabilities == r.probabilities) for n in names[1:])
        lines.append(
            f"| {case.name} | {r.num_computed_tokens} | {r.num_launches} | {rows} | {cells} | {ratios} "
            f"| {same} | {bits} |"
        )
        print(lines[-1], flush=True)
    # arms' graph pools add up on one card: retries (a cudaMalloc that failed, the cache freed, tried
    # again) make passes slow and erratic, not the kernels (four arms once did on an 80 GB card)
    stats = torch.cuda.memory_stats()
    lines += [
        "",
        f"- device memory: peak reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB of "
        f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}; allocator retries "
        f"{stats.get('num_alloc_retries', 0)}, out-of-memory errors {stats.get('num_ooms', 0)}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

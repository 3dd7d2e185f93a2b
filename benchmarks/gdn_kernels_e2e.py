"""Whole requests through the engine with each GDN kernel: the serial recurrence against the
chunked (WY) kernel, on the synthetic 27B runner (CUDA graphs), one workload request per kind and
length group. The two runners share the weights and the product paths chosen at start; each
request runs alternately on each (rounds interleaved, so drift lands on both alike) after one
untimed warm-up that captures its graphs.
Prints per request the computed tokens, the median and spread of each arm, and their ratio, then
the checks that both arms gave the same choices (their bits differ: the kernels sum in other
orders).

    PYTHONPATH=. python3 benchmarks/gdn_kernels_e2e.py --model .openjev/demo-model \\
        --workload benchmarks/workload.jsonl [--rounds 7] [--out gdn-e2e.md]
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
from openjev.worker.cuda.runner import CudaRunner
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.cost import default_cost_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--shape", default="27b")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    meta, candidates_of, _ = longest_tokens_fn(args.model)
    cases = workload.read_jsonl(args.workload)
    kinds_groups = [(k, g) for k in ("choice", "noul", "score") for g in workload.GROUP_NAMES]
    chosen = [next(c for c in cases if (c.kind, c.group) == kg) for kg in kinds_groups]
    serial = CudaRunner.synthetic(args.shape, seed=0, graph_capture_after=1)
    chunked = CudaRunner.on_weights_of(
        serial,
        graph_capture_after=1,
        gdn_kernel="chunked",
        gemm_min_rows=1,  # no probing: the products below are the serial runner's
    )
    # the same product paths as the serial runner (start-up timing could pick others): the arms
    # differ only in their GDN kernel
    chunked.gemm_rows, chunked.stream_rows, chunked.lt = serial.gemm_rows, serial.stream_rows, serial.lt
    engines = {
        name: Engine(runner, cost_model=default_cost_model("cuda"))
        for name, runner in (("serial", serial), ("chunked", chunked))
    }
    lines = [
        f"# Whole requests with each GDN kernel, {datetime.date.today().isoformat()}",
        "",
        f"- card {torch.cuda.get_device_name()}; {args.shape} shape, synthetic weights, policy auto, CUDA graphs; "
        f"{args.rounds} interleaved rounds after a warm-up; command: `python3 benchmarks/gdn_kernels_e2e.py`",
        "",
        "| request | computed tokens | passes | serial ms (min-max) | chunked ms (min-max) | chunked / serial "
        "| same choice |",
        "|---|---|---|---|---|---|---|",
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
        r = results["serial"]
        same = all(
            max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
            for a, b in zip(r.probabilities, results["chunked"].probabilities, strict=True)
        )
        cells = " | ".join(
            f"{1e3 * med[n]:.1f} ({1e3 * min(samples[n]):.1f}-{1e3 * max(samples[n]):.1f})" for n in engines
        )
        lines.append(
            f"| {case.name} | {r.num_computed_tokens} | {r.num_launches} | {cells} | "
            f"{med['chunked'] / med['serial']:.3f} | {same} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""`openjev bench`: the JevBench-shaped workload through the frontend, arms side by side.

python -m openjev.tools.bench.main --model .openjev/demo-model --out docs/benchmarks/cpu-demo --subset 24
(on a GPU) ... --worker-args "--synthetic 27b" --arms off,auto,shared,transformers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.tools import launch
from openjev.tools.bench import harness, report, workload

# Arm name -> the policy its requests carry.
POLICY_ARMS: dict[str, PrefixPolicy] = {policy: policy for policy in PREFIX_POLICIES}


def longest_tokens_fn(model: Path):
    from openjev.contract.request import parse_request
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer

    meta = load_export_meta(model)
    tokenizer = PromptTokenizer.from_export(model)

    def candidates(request: dict) -> list[list[list[int]]]:
        decision = parse_request(request, accepted_models=meta.accepted_model_names)
        return [tokenizer.encode(list(q.prompts)) for q in decision.questions]

    return meta, candidates, lambda request: max(len(ids) for q in candidates(request) for ids in q)


def stratified(cases: list[workload.Case], per_group: int) -> list[workload.Case]:
    seen: dict[str, int] = {}
    chosen = []
    for case in cases:
        key = report.group_of(case)
        if seen.get(key, 0) < per_group:
            chosen.append(case)
            seen[key] = seen.get(key, 0) + 1
    return chosen


def model_config(model: Path, worker_args: list[str]):
    if "--synthetic" in worker_args:
        from openjev.worker.cuda.fused_weights import shape_config

        return shape_config(worker_args[worker_args.index("--synthetic") + 1])
    from openjev.worker.checkpoint.config import load_model_config

    return load_model_config(model)


def worker_exit_stats(log_text: str) -> dict:
    """The worker's last words: peak device memory and CUDA graph counts (empty without a GPU)."""
    for line in reversed(log_text.splitlines()):
        if '"peak_memory"' in line:
            return json.loads(line)
    return {}


def token_counts(cases, candidates_of) -> dict[str, tuple[int, int]]:
    """case -> (tokens submitted, tokens of the shared token tree: what the floor computes)."""
    from openjev.worker.planner.plan import PackLimits
    from openjev.worker.planner.policy import plan_request

    tokens = {}
    for case in cases:
        ids = candidates_of(case.request)
        tokens[case.name] = (
            sum(len(t) for q in ids for t in q),
            plan_request(ids, "shared", PackLimits()).num_computed_tokens,
        )
    return tokens


def write(out: Path, results, peak, floors, tokens, ceilings, header: str) -> None:
    (out / "results.json").write_text(
        json.dumps(
            {
                "samples": [s.__dict__ for s in results.samples],
                "sweep": results.sweep,
                "tokens": tokens,
                "floors": floors,
                "peak_memory_bytes": peak,
                "header": header,
                "ceilings": ceilings.__dict__ if ceilings else None,
            },
            indent=0,
        )
    )


def measure_floors(model: Path, worker_args: list[str], tokens):
    """(ceilings, case -> floor seconds), both None without a GPU. Measured before the servers
    start, so that the ceilings see an idle card and a run cut short still has its floors."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    from openjev.tools.bench import roofline

    ceilings = roofline.measure_ceilings()
    config = model_config(model, worker_args)
    floors = {name: roofline.floor_seconds(config, t[1], ceilings) for name, t in tokens.items()}
    torch.cuda.empty_cache()
    return ceilings, floors


def render_saved(out: Path, cases: list[workload.Case], from_block: int = 0, name: str = "report") -> str:
    """NAME.md and its latency plot from out/results.json (e.g. of a run that was cut short); timed blocks
    before from_block (0-based) are left out of the tables."""
    saved = json.loads((out / "results.json").read_text())
    samples = [harness.Sample(**s) for s in saved["samples"]]
    results = harness.Results([s for s in samples if s.block < 0 or s.block >= from_block], saved["sweep"])
    arms = list(dict.fromkeys(s.arm for s in results.samples))
    names = {s.case for s in results.samples}
    cases = [c for c in cases if c.name in names]
    reference = "ours-auto" if "ours-auto" in arms else arms[0]
    header = saved["header"] + (
        f"\n- this report leaves out the first {from_block} timed block(s)" if from_block else ""
    )
    text = report.render(
        results,
        cases,
        arms,
        reference_arm=reference,
        floors=saved["floors"],
        tokens={k: tuple(v) for k, v in saved["tokens"].items()},
        header=header,
    )
    (out / f"{name}.md").write_text(text)
    report.plot(results, cases, arms, out / (f"latency-from-block{from_block}.png" if from_block else "latency.png"))
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="openjev bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", type=Path, required=True, help="export directory (tokenizer, metadata; weights unless --synthetic)"
    )
    p.add_argument("--workload", type=Path, default=None, help="contract-JSON workload (JSONL); generated when absent")
    p.add_argument("--out", type=Path, required=True, help="results folder (report.md, results.json, latency.png)")
    p.add_argument(
        "--arms", default="off,auto,shared", help="comma list of policies of our worker, plus 'transformers'"
    )
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--per-group", type=int, default=0, help="at most this many cases per kind x group (0: all)")
    p.add_argument(
        "--kinds", default="", help="comma list: only cases of these kinds (choice, noul, score, multi, capacity)"
    )
    p.add_argument(
        "--transformers-per-group",
        type=int,
        default=0,
        help="the transformers arm runs only this many cases per kind x group (0: as many as the others)",
    )
    p.add_argument("--worker-args", default="", help="extra flags for the workers, e.g. '--synthetic 27b'")
    p.add_argument("--sweep", default="1,4,16", help="concurrency levels of the auto arm ('' to skip)")
    p.add_argument("--sweep-seconds", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--report-only", action="store_true", help="render report.md from --out/results.json and stop")
    p.add_argument(
        "--from-block",
        type=int,
        default=0,
        help="with --report-only: leave out timed blocks before this one (0-based), writing report-from-blockN.md",
    )
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    meta, candidates_of, longest = longest_tokens_fn(args.model)
    saved_workload = args.out / "workload.jsonl"  # what a run without --workload generated
    if args.workload and args.workload.exists():
        cases = workload.read_jsonl(args.workload)
    elif args.report_only and saved_workload.exists():
        cases = workload.read_jsonl(saved_workload)
    else:
        cases = (
            workload.jevbench_cases(longest)
            + workload.multi_question_cases(longest)
            + workload.capacity_cases(longest, meta.max_length)
        )
        workload.write_jsonl(cases, saved_workload)
    if args.report_only:
        name = f"report-from-block{args.from_block}" if args.from_block else "report"
        print(render_saved(args.out, cases, args.from_block, name))
        return
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds.split(",")]
    if args.per_group:
        cases = stratified(cases, args.per_group)
    print(f"{len(cases)} cases", file=sys.stderr)

    tokens = token_counts(cases, candidates_of)
    worker_args = shlex.split(args.worker_args)
    ceilings, floors = measure_floors(args.model, worker_args, tokens)
    # The device machine gets a copy of the tree whose git may not match it: the caller names it.
    commit = (
        os.environ.get("OPENJEV_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    card = ceilings.device if ceilings else f"CPU ({platform.processor() or platform.machine()})"
    header = "\n".join(
        [
            f"# Benchmark {datetime.date.today().isoformat()}",
            "",
            f"- command: `python -m openjev.tools.bench.main {shlex.join(argv or sys.argv[1:])}`",
            f"- card: {card}; commit {commit or 'unknown'}; worker flags: `{args.worker_args or '(none)'}`",
            f"- {len(cases)} cases, {args.blocks} timed blocks after one warm-up traversal; concurrency 1 per arm, "
            "one persistent client per arm, arms interleaved per case in a shuffled order"
            + (
                f"; the transformers arm on {args.transformers_per_group} cases per kind x group only "
                "(ratios to it are paired on those cases)"
                if args.transformers_per_group and "transformers" in args.arms.split(",")
                else ""
            ),
            (
                f"- ceilings measured in this run: copy {ceilings.copy_bytes_per_second / 1e12:.2f} TB/s, "
                f"bf16 GEMM {ceilings.matmul_flops_per_second / 1e12:.0f} TFLOP/s"
                if ceilings
                else "- no GPU: no roofline floor"
            ),
        ]
    )
    arm_names = args.arms.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="openjev-bench-"))
    pairs, arms = [], []
    try:
        ours = launch.start_pair(args.model, workdir / "ours", worker_args=worker_args)
        pairs.append(ours)
        arms += [
            harness.Arm(f"ours-{name}", ours.frontend.address, POLICY_ARMS[name])
            for name in arm_names
            if name in POLICY_ARMS
        ]
        if "transformers" in arm_names:
            hf = launch.start_pair(
                args.model, workdir / "transformers", worker_args=worker_args + ["--backend", "transformers"]
            )
            pairs.append(hf)
            only = (
                frozenset(c.name for c in stratified(cases, args.transformers_per_group))
                if args.transformers_per_group
                else None
            )
            arms.append(harness.Arm("transformers", hf.frontend.address, None, only))
        results = harness.run_blocks(
            arms,
            cases,
            blocks=args.blocks,
            timeout=args.timeout,
            progress=lambda m: print(m, file=sys.stderr),
            after_block=lambda r: write(args.out, r, [], floors, tokens, ceilings, header),
        )
        auto = next((a for a in arms if a.name == "ours-auto"), arms[0])
        if args.sweep:
            for row in harness.concurrency_sweep(
                auto,
                cases,
                [int(x) for x in args.sweep.split(",")],
                seconds_per_level=args.sweep_seconds,
                timeout=args.timeout,
            ):
                results.sweep.append({"arm": auto.name, **row})
    finally:
        for pair in pairs:
            pair.stop()
    stats = [worker_exit_stats(pair.worker.log_text()) for pair in pairs]
    peak = [s.get("device_bytes") for s in stats]
    header += "\n- peak device memory per worker: " + ", ".join(
        f"{pair.worker.name}@{i}: " + (f"{b / 2**30:.1f} GiB" if b else "n/a")
        for i, (pair, b) in enumerate(zip(pairs, peak, strict=True))
    )
    for i, s in enumerate(stats):
        if "graph_captures" in s:
            header += (
                f"\n- CUDA graphs of worker@{i}: {s['graph_captures']} captures, {s['graph_replays']} replays, "
                f"{s['graph_capture_failures']} capture failures"
            )
    write(args.out, results, peak, floors, tokens, ceilings, header)
    print(render_saved(args.out, cases))


if __name__ == "__main__":
    main()

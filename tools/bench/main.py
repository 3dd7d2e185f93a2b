"""`openjev bench`: the JevBench-shaped workload through the frontend, arms side by side.

python -m openjev.tools.bench.main --model .openjev/demo-model --out docs/benchmarks/cpu-demo --per-group 2
(on a GPU) ... --worker-args "--synthetic 27b" --arms off,auto,shared,transformers

One run, in this order on one worker: first-seen requests (a workload of another seed, before any
other traffic), the arms at concurrency 1 in interleaved blocks, the first-seen requests replayed,
the concurrency sweep, the mixed run; then start-up time and peak memory from the worker's log.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.tools import launch
from openjev.tools.bench import harness, load, prepare, roofline, worker_log, workload
from openjev.tools.bench.prepare import longest_tokens_fn, stratified  # noqa: F401 (imported from here)
from openjev.tools.bench.saved import render_saved, write

# Arm name -> the policy its requests carry.
POLICY_ARMS: dict[str, PrefixPolicy] = {policy: policy for policy in PREFIX_POLICIES}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openjev bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", type=Path, required=True, help="export directory (tokenizer, metadata; weights unless --synthetic)"
    )
    p.add_argument("--workload", type=Path, default=None, help="contract-JSON workload (JSONL); generated when absent")
    p.add_argument(
        "--out", type=Path, required=True, help="results folder (report.md, results.json, latency.png, sweep.png)"
    )
    p.add_argument(
        "--arms", default="off,auto,shared", help="comma list of policies of our worker, plus 'transformers'"
    )
    p.add_argument("--blocks", type=int, default=3, help="timed blocks at concurrency 1 (0: none, nor their warm-up)")
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
    p.add_argument(
        "--start-timeout",
        type=float,
        default=launch.WORKER_START_SECONDS,
        help="seconds a worker may take to say SERVING",
    )
    p.add_argument(
        "--first-seen-seed", type=int, default=-1, help="seed of a split never sent before, run first (-1: skip)"
    )
    p.add_argument("--first-seen-per-group", type=int, default=0, help="its cases per kind x group (0: all 231)")
    p.add_argument("--first-seen-replays", type=int, default=2, help="replays of it after the timed blocks")
    p.add_argument("--sweep", default="1,4,16,32", help="client counts of the auto arm's sweep ('' to skip)")
    p.add_argument(
        "--sweep-sets", default="split,short", help="split: the whole JevBench split; short: its <= 512 tokens"
    )
    p.add_argument("--sweep-seconds", type=float, default=20.0, help="per level and set")
    p.add_argument("--mixed-clients", type=int, default=0, help="short-request clients of the mixed run (0: skip)")
    p.add_argument("--mixed-seconds", type=float, default=30.0, help="each of its two halves (alone, with long)")
    p.add_argument("--timeout", type=float, default=600.0, help="each request's deadline, seconds")
    p.add_argument("--report-only", action="store_true", help="render report.md from --out/results.json and stop")
    p.add_argument(
        "--from-block",
        type=int,
        default=0,
        help="with --report-only: leave out timed blocks before this one (0-based), writing report-from-blockN.md",
    )
    p.add_argument(
        "--ceilings",
        type=_ceilings,
        metavar="TB_S,TFLOP_S",
        help="with --report-only: floors at these copy and bf16 GEMM rates instead of the run's (another run's, "
        "to compare two runs at one ceiling), written to report-at-ceilings.md; give the run's --worker-args too",
    )
    return p


def _ceilings(text: str) -> roofline.Ceilings:
    try:
        copy, gemm = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected two numbers, TB/s and TFLOP/s (e.g. 4.25,789)") from None
    if not (copy > 0 and gemm > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: both rates must be positive")
    return roofline.Ceilings(copy * 1e12, gemm * 1e12, "given")


def _header(args, argv, cases, ceilings, extra: list[str]) -> str:
    # The device machine gets a copy of the tree whose git may not match it: the caller names it.
    commit = (
        os.environ.get("OPENJEV_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    card = ceilings.device if ceilings else f"CPU ({platform.processor() or platform.machine()})"
    hf_only = args.transformers_per_group and "transformers" in args.arms.split(",")
    command = " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    return "\n".join(
        [
            f"# Benchmark {datetime.date.today().isoformat()}",
            "",
            f"- command: `python -m openjev.tools.bench.main {command}`",
            f"- card: {card}; commit {commit or 'unknown'}; worker flags: `{args.worker_args or '(none)'}`",
            (
                f"- {len(cases)} cases, {args.blocks} timed blocks after one warm-up traversal; concurrency 1 per arm, "
                "one persistent client per arm, arms interleaved per case in a shuffled order"
                if cases
                else "- no concurrency-1 blocks"
            )
            + (
                f"; the transformers arm on {args.transformers_per_group} cases per kind x group only (ratios to it "
                "are paired on those cases)"
                if hf_only
                else ""
            ),
            (
                f"- ceilings measured in this run: copy {ceilings.copy_bytes_per_second / 1e12:.2f} TB/s, "
                f"bf16 GEMM {ceilings.matmul_flops_per_second / 1e12:.0f} TFLOP/s"
                if ceilings
                else "- no GPU: no roofline floor"
            ),
            *extra,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    flags = parser()
    args = flags.parse_args(argv)
    if args.ceilings and not args.report_only:
        flags.error("--ceilings re-renders a saved run: use it with --report-only")
    if args.from_block and not args.report_only:  # a new run ignored it
        flags.error("--from-block re-renders a saved run: use it with --report-only")
    arm_names = args.arms.split(",")
    if any(n not in POLICY_ARMS and n != "transformers" for n in arm_names) or not set(arm_names) & set(POLICY_ARMS):
        flags.error(f"--arms {args.arms!r}: one or more of {', '.join(POLICY_ARMS)}, plus 'transformers' if wanted")
    if args.workload and not args.workload.is_file():
        flags.error(f"--workload {args.workload}: no such file")
    args.out.mkdir(parents=True, exist_ok=True)
    meta, candidates_of, longest = longest_tokens_fn(args.model)
    saved_workload = args.out / "workload.jsonl"  # what a run without --workload generated
    if args.workload:
        everything = workload.read_jsonl(args.workload)
    elif args.report_only and saved_workload.exists():
        everything = workload.read_jsonl(saved_workload)
    else:
        everything = prepare.generated(longest, meta.max_length)
        workload.write_jsonl(everything, saved_workload)
    if args.report_only:
        name = f"report-from-block{args.from_block}" if args.from_block else "report"
        name += "-at-ceilings" if args.ceilings else ""  # the run's own report stays
        config = prepare.model_config(args.model, shlex.split(args.worker_args)) if args.ceilings else None
        try:
            print(render_saved(args.out, everything, candidates_of, args.from_block, name, args.ceilings, config))
        except ValueError as e:
            sys.exit(f"--ceilings: {e}")
        return
    cases = [c for c in everything if not args.kinds or c.kind in args.kinds.split(",")]
    cases = stratified(cases, args.per_group) if args.per_group else cases
    cases = cases if args.blocks > 0 else []
    levels = [int(x) for x in args.sweep.split(",") if x]
    sweep_sets = {k: v for k, v in prepare.split_sets(everything).items() if levels and k in args.sweep_sets.split(",")}
    first_seen = []
    if args.first_seen_seed >= 0:
        first_seen = workload.jevbench_cases(longest, args.first_seen_seed)
        first_seen = stratified(first_seen, args.first_seen_per_group) if args.first_seen_per_group else first_seen
    long_cases = [c for c in everything if c.kind == "capacity" and c.group == "16k"] if args.mixed_clients else []
    print(
        f"{len(cases)} cases; first-seen {len(first_seen)}; sweep sets "
        + ", ".join(f"{k} {len(v)}" for k, v in sweep_sets.items())
        + f"; mixed: {len(long_cases)} long",
        file=sys.stderr,
    )

    tokens = prepare.token_counts(cases, candidates_of)
    swept = list({c.name: c for subset in sweep_sets.values() for c in subset}.values())
    tree_tokens = {n: t[1] for n, t in prepare.token_counts(swept, candidates_of).items()}
    tree_tokens |= {n: t[1] for n, t in tokens.items()}
    worker_args = shlex.split(args.worker_args)
    if not any(a.startswith("--state-cache-bytes") for a in worker_args):
        # the blocks replay the same requests: with the state cache on they would time cache
        # hits, not requests (pass --state-cache-bytes in --worker-args to measure it)
        worker_args += ["--state-cache-bytes", "0"]
    config = prepare.model_config(args.model, worker_args)
    ceilings, floors = prepare.measure_floors(config, tokens)
    extra = []
    if first_seen:
        extra.append(
            f"- first-seen: {len(first_seen)} split requests of seed {args.first_seen_seed}, sent once before any "
            f"other traffic, replayed {args.first_seen_replays}x after the timed blocks"
        )
    if levels:
        extra.append(f"- sweep: {args.sweep} clients x {args.sweep_seconds:.0f} s on {', '.join(sweep_sets)}")
    if long_cases:
        extra.append(f"- mixed run: {args.mixed_clients} short clients, {args.mixed_seconds:.0f} s alone and with long")
    run = {
        "header": _header(args, argv, cases, ceilings, extra),
        "tokens": tokens,
        "floors": floors,
        "ceilings": ceilings.__dict__ if ceilings else None,
        "matmul_parameters": roofline.token_matmul_parameters(config),  # what the floors and rates count
        "weight_read_bytes": roofline.model_size(config)[0],  # with the above: the floor of any request
        "weight_bytes": roofline.weight_bytes_resident(config),
        "first_seen_seed": args.first_seen_seed if first_seen else None,
        "startup": [],
        "peak_memory_bytes": [],
    }
    workdir = Path(tempfile.mkdtemp(prefix="openjev-bench-"))
    pairs, arms = [], []
    results = harness.Results()
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    save = lambda _=None: write(args.out, results, run)  # noqa: E731
    try:
        ours = launch.start_pair(
            args.model, workdir / "ours", worker_args=worker_args, worker_timeout_seconds=args.start_timeout
        )
        pairs.append(ours)
        say(f"worker SERVING after {ours.worker.serving_seconds:.1f} s")
        arms += [harness.Arm(f"ours-{n}", ours.frontend.address, POLICY_ARMS[n]) for n in arm_names if n in POLICY_ARMS]
        auto = next((a for a in arms if a.name == "ours-auto"), arms[0])
        fresh = harness.Results()
        if first_seen:
            # before anything else reaches the worker: what real traffic meets
            harness.run_blocks([auto], first_seen, blocks=0, seed=1, progress=say, into=fresh, timeout=args.timeout)
            results.first_seen = fresh.samples
            save()
        if "transformers" in arm_names:
            hf = launch.start_pair(
                args.model,
                workdir / "transformers",
                worker_args=worker_args + ["--backend", "transformers"],
                worker_timeout_seconds=args.start_timeout,
            )
            pairs.append(hf)
            per = args.transformers_per_group
            only = frozenset(c.name for c in stratified(cases, per)) if per else None
            arms.append(harness.Arm("transformers", hf.frontend.address, None, only))
        if cases:
            harness.run_blocks(
                arms, cases, blocks=args.blocks, timeout=args.timeout, progress=say, after_block=save, into=results
            )
        if first_seen and args.first_seen_replays:
            replay = harness.Results()
            blocks = args.first_seen_replays - 1  # run_blocks' own warm-up traversal is the first replay
            harness.run_blocks(
                [auto], first_seen, blocks=blocks, seed=2, progress=say, into=replay, timeout=args.timeout
            )
            for sample in replay.samples:
                sample.block += 1
            results.first_seen += replay.samples
            save()
        for name, subset in sweep_sets.items():
            results.sweep += load.concurrency_sweep(
                auto, subset, levels, label=name, tree_tokens=tree_tokens, seconds_per_level=args.sweep_seconds,
                timeout=args.timeout,
            )  # fmt: skip
            rows = [r for r in results.sweep if r["set"] == name]
            say(f"sweep {name}: " + ", ".join(f"{r['clients']}: {r['throughput_rps']:.2f} req/s" for r in rows))
            save()
        if long_cases:
            short = sweep_sets.get("short") or prepare.split_sets(everything)["short"]
            results.mixed = load.mixed_run(
                auto, short, long_cases, clients=args.mixed_clients, seconds=args.mixed_seconds, timeout=args.timeout
            )
            alone, beside = results.mixed
            say(f"mixed: short p95 {alone['p95_ms']:.1f} ms alone, {beside['p95_ms']:.1f} with long")
    finally:
        for pair in pairs:
            pair.stop()
        run["startup"] = [
            worker_log.startup(p.worker.log_text(), p.worker.serving_seconds, p.worker.name) for p in pairs
        ]
        run["peak_memory_bytes"] = [worker_log.exit_stats(p.worker.log_text()).get("device_bytes") for p in pairs]
        save()
    for i, pair in enumerate(pairs):
        s = worker_log.exit_stats(pair.worker.log_text())
        if "graph_captures" in s:
            run["header"] += (
                f"\n- CUDA graphs of worker@{i}: {s['graph_captures']} captures, {s['graph_replays']} replays, "
                f"{s['graph_capture_failures']} capture failures"
                + (f", {s['graph_eager_passes']} eager passes" if "graph_eager_passes" in s else "")
            )
    save()
    print(render_saved(args.out, everything, candidates_of))


if __name__ == "__main__":
    main()

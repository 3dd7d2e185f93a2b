"""Numerical gates over a workload, in process: every policy against `off` on the same backend
and weights (max |dp|, max |d score|, choice changes, noul flips at 0.5, failures), and `off`
against transformers on the same weights (maximum differences, reported).

  python -m openjev.tools.bench.gates --model .openjev/demo-model --workload benchmarks/workload.jsonl
  (GPU) ... --backend cuda --synthetic 27b --layers 8 --out docs/benchmarks/gpu-gates.md
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.tools.bench import workload
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.planner.cost import default_cost_model

# Every policy but the reference it is compared against.
POLICIES: tuple[PrefixPolicy, ...] = tuple(p for p in PREFIX_POLICIES if p != "off")


def expected_score(p: list[float]) -> float:
    return sum(i * x for i, x in enumerate(p))


def compare(kinds: list[str], base: list[list[float]], other: list[list[float]]) -> dict[str, float]:
    """Differences between two answers to one request (per-question probability lists)."""
    out = {"max_dp": 0.0, "max_dscore": 0.0, "choice_changes": 0, "decisive_choice_changes": 0, "noul_flips": 0}
    for kind, p, q in zip(kinds, base, other, strict=True):
        out["max_dp"] = max(out["max_dp"], max(abs(a - b) for a, b in zip(p, q, strict=True)))
        if kind == "choice" and p.index(max(p)) != q.index(max(q)):
            out["choice_changes"] += 1
            # A change between near-tied options (top two within 2x the dp gate in the base
            # answer) is rounding noise deciding a tie; one beyond that is a real disagreement.
            top = sorted(p, reverse=True)
            out["decisive_choice_changes"] += int(len(top) > 1 and top[0] - top[1] > 2e-3)
        if kind == "score":
            out["max_dscore"] = max(out["max_dscore"], abs(expected_score(p) - expected_score(q)))
        if kind == "noul" and (p[1] >= 0.5) != (q[1] >= 0.5):
            out["noul_flips"] += 1
    return out


def build_runners(args):
    """(runner under test, transformers on the same weights, transformers on them in fp32 or None
    where the runner already is fp32): the fp32 one says which of the two bf16 ones is nearer."""
    if args.backend == "torch":
        from openjev.tools.bench.transformers_arm import TransformersRunner
        from openjev.worker.model.runner import TorchRunner

        return TorchRunner(args.model), TransformersRunner.from_export(args.model), None
    import torch

    from openjev.tools.bench.transformers_arm import TransformersRunner, to_device
    from openjev.worker.cuda.runner import CudaRunner

    options = {"graph_cache_size": args.graphs, "gdn_kernel": args.gdn_kernel}
    if args.gemm_min_rows is not None:
        options["gemm_min_rows"] = args.gemm_min_rows
    runner = (
        CudaRunner.synthetic(args.synthetic, seed=args.seed, num_layers=args.layers, **options)
        if args.synthetic
        else CudaRunner.from_export(args.model, **options)
    )
    head = runner.head_weight.float().tolist()
    oracle = TransformersRunner(runner.config, runner.reference_weights(), head, runner.head_bias, device=runner.device)
    exact = TransformersRunner(
        runner.config,
        to_device(runner.reference_weights(), runner.device, torch.float32),
        head,
        runner.head_bias,
        device=runner.device,
    )
    return runner, oracle, exact


def max_rel_head(ours, theirs) -> float:
    """Largest head-score difference relative to max(1, |theirs|)."""
    return max(
        (abs(a - b) / max(1.0, abs(b)) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True)),
        default=0.0,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m openjev.tools.bench.gates",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--backend", choices=("torch", "cuda"), default="torch")
    p.add_argument("--synthetic", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graphs", type=int, default=64, help="CUDA graph cache size (0: eager)")
    p.add_argument(
        "--gdn-kernel", choices=("serial", "chunked"), default="serial", help="cuda backend: GDN prefill kernel"
    )
    p.add_argument(
        "--gemm-min-rows", type=int, default=None, help="cuda backend: pad smaller products to this many rows"
    )
    p.add_argument("--skip", default="16k", help="comma list of case groups to leave out")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests")
    p.add_argument("--oracle-cases", type=int, default=40, help="cases compared with transformers")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--mixed-clients", type=int, default=8, help="batch invariance: requests sent at once, sharing passes"
    )
    args = p.parse_args(argv)

    meta, candidates_of, _ = longest_tokens_fn(args.model)
    cases = [c for c in workload.read_jsonl(args.workload) if c.group not in args.skip.split(",")][: args.limit]
    runner, oracle, exact = build_runners(args)
    engine = Engine(runner, cost_model=default_cost_model(args.backend))
    oracle_engine = Engine(oracle, cost_model=default_cost_model("torch"))
    exact_engine = Engine(exact, cost_model=default_cost_model("torch")) if exact is not None else None
    rows = {
        policy: {
            "max_dp": 0.0,
            "max_dscore": 0.0,
            "choice_changes": 0,
            "decisive_choice_changes": 0,
            "noul_flips": 0,
            "failures": 0,
            "saved_tokens": 0,
        }
        for policy in POLICIES
    }
    oracle_row = {
        "max_dp": 0.0,
        "max_dscore": 0.0,
        "choice_changes": 0,
        "decisive_choice_changes": 0,
        "noul_flips": 0,
        "max_rel_dscore_head": 0.0,
        "ours_vs_fp32": 0.0,
        "transformers_vs_fp32": 0.0,
        "cases": 0,
    }
    submitted = 0
    alone: dict[tuple[int, PrefixPolicy], list[list[float]]] = {}  # (case, policy) -> head scores run alone
    works: list[list[QuestionWork]] = []
    for index, case in enumerate(cases):
        if index % 25 == 0:
            print(f"gates: {index}/{len(cases)} requests", file=sys.stderr, flush=True)
        ids = candidates_of(case.request)
        kinds = [q["type"] for q in case.request["questions"].values()]
        work = [QuestionWork(kind, tuple(tuple(t) for t in q)) for kind, q in zip(kinds, ids, strict=True)]
        works.append(work)
        base = engine.execute(work, temperature=meta.temperature, policy="off")
        alone[index, "off"] = base.head_scores
        submitted += base.num_submitted_tokens
        for policy in POLICIES:
            try:
                other = engine.execute(work, temperature=meta.temperature, policy=policy)
            except Exception as error:  # a failure is a gate result, not a crash of the run
                print(f"{case.name} {policy}: {error!r}", file=sys.stderr)
                rows[policy]["failures"] += 1
                continue
            alone[index, policy] = other.head_scores
            rows[policy]["saved_tokens"] += other.num_saved_tokens
            for key, value in compare(kinds, base.probabilities, other.probabilities).items():
                rows[policy][key] = (
                    max(rows[policy][key], value) if key.startswith("max") else rows[policy][key] + value
                )
        if index < args.oracle_cases:
            ref = oracle_engine.execute(work, temperature=meta.temperature, policy="off")
            oracle_row["cases"] += 1
            for key, value in compare(kinds, ref.probabilities, base.probabilities).items():
                oracle_row[key] = max(oracle_row[key], value) if key.startswith("max") else oracle_row[key] + value
            oracle_row["max_rel_dscore_head"] = max(
                oracle_row["max_rel_dscore_head"], max_rel_head(base.head_scores, ref.head_scores)
            )
            if exact_engine is not None:
                truth = exact_engine.execute(work, temperature=meta.temperature, policy="off").head_scores
                for key, scores in (("ours_vs_fp32", base.head_scores), ("transformers_vs_fp32", ref.head_scores)):
                    oracle_row[key] = max(oracle_row[key], max_rel_head(scores, truth))
    mixed = batch_invariance(engine, works, alone, meta.temperature, args.mixed_clients, args.seed)
    card = "CPU"
    if args.backend == "cuda":
        import torch

        card = torch.cuda.get_device_name()
    lines = [
        f"# Numerical gates, {datetime.date.today().isoformat()}",
        "",
        f"- command: `python -m openjev.tools.bench.gates {' '.join(argv or sys.argv[1:])}`",
        f"- backend {args.backend}, card {card}, weights: "
        + (
            f"synthetic {args.synthetic} seed {args.seed}, {runner.config.num_layers} layers"
            if args.synthetic
            else str(args.model)
        ),
        f"- {len(cases)} requests ({submitted} tokens submitted per policy)",
        "",
        "| policy vs off | max abs dp | max abs d score | choice changes (decisive: top-2 gap > 2e-3) "
        "| noul flips | failures | saved tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, r in rows.items():
        lines.append(
            f"| {policy} | {r['max_dp']:.2e} | {r['max_dscore']:.2e} "
            f"| {r['choice_changes']} ({r['decisive_choice_changes']}) | {r['noul_flips']} "
            f"| {r['failures']} | {r['saved_tokens']} |"
        )
    o = oracle_row
    if o["cases"] == 0:
        lines += ["", "Not compared with transformers in this run (--oracle-cases 0)."]
    else:
        lines += [
            "",
            f"Against transformers (`off`, same weights, first {o['cases']} requests): max abs dp {o['max_dp']:.2e}, "
            f"max abs d score {o['max_dscore']:.2e}, max head-score difference (relative to max(1, |s|)) "
            f"{o['max_rel_dscore_head']:.2e}, choice changes {o['choice_changes']} "
            f"(decisive {o['decisive_choice_changes']}), noul flips {o['noul_flips']}.",
        ]
    if exact is not None and o["cases"]:
        lines += [
            "",
            f"Against the same weights in fp32 (transformers, same requests), max head-score difference relative to "
            f"max(1, |s|): ours (bf16) {o['ours_vs_fp32']:.2e}, transformers in bf16 {o['transformers_vs_fp32']:.2e}.",
        ]
    lines += [
        "",
        f"Batch invariance: {mixed['requests']} requests sent {args.mixed_clients} at a time with random "
        f"policies, sharing passes ({mixed['shared']} of them shared at least one pass with another request): "
        f"{mixed['mismatches']} differ in any bit of any head score from the same request run alone; "
        f"{mixed['failures']} failed.",
    ]
    padded = {shape: rows for shape, rows in getattr(runner, "gemm_rows", {}).items() if rows > 1}
    if args.backend == "cuda":
        lines += [
            "",
            "Products padded to a row count (weight [N, K]: rows): "
            + (", ".join(f"{list(shape)}: {rows}" for shape, rows in padded.items()) or "none")
            + ". Through cuBLASLt's unsplit algorithms instead (weight: row counts): "
            + ("; ".join(f"{list(s)}: {sorted(lt.rows)}" for s, lt in getattr(runner, "lt", {}).items()) or "none")
            + ".",
        ]
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        lines += [
            "",
            f"CUDA graphs: {graphs.cache.num_captures} captures, {graphs.hits} replays, "
            f"{graphs.failures} capture failures.",
        ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    passed = all(
        r["max_dp"] <= 1e-3
        and r["max_dscore"] <= 1e-3
        and r["choice_changes"] == 0
        and r["noul_flips"] == 0
        and r["failures"] == 0
        for r in rows.values()
    ) and (graphs is None or graphs.failures == 0)
    passed = passed and mixed["mismatches"] == 0 and mixed["failures"] == 0
    sys.exit(0 if passed else 1)


def batch_invariance(
    engine: Engine,
    works: list[list[QuestionWork]],
    alone: dict[tuple[int, PrefixPolicy], list[list[float]]],
    temperature: float,
    clients: int,
    seed: int,
) -> dict[str, int]:
    """Every request again, `clients` at a time through the same engine (so they share forward
    passes) under a random policy each, compared bit for bit with the same request run alone."""
    rng = random.Random(seed)
    choices: tuple[PrefixPolicy, ...] = ("off", *POLICIES)
    jobs = [(index, rng.choice(choices)) for index in range(len(works))]
    jobs = [(index, policy) for index, policy in jobs if (index, policy) in alone]

    def one(job: tuple[int, PrefixPolicy]) -> tuple[tuple[int, PrefixPolicy], ExecutionResult | None]:
        index, policy = job
        try:
            return job, engine.execute(works[index], temperature=temperature, policy=policy)
        except Exception as error:  # counted, not raised: the report says how many
            print(f"mixed {index} {policy}: {error!r}", file=sys.stderr)
            return job, None

    out = {"requests": len(jobs), "shared": 0, "mismatches": 0, "failures": 0}
    with ThreadPoolExecutor(max(1, clients)) as pool:
        for (index, policy), result in pool.map(one, jobs):
            if result is None:
                out["failures"] += 1
                continue
            out["shared"] += result.num_shared_passes > 0
            out["mismatches"] += result.head_scores != alone[index, policy]
    return out


if __name__ == "__main__":
    main()

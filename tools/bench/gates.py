"""Numerical gates over a workload, in process: every policy against `off` on the same backend
and weights, batch invariance (each request again among others sharing its passes), and `off`
against transformers on the same weights (reported, not gated).

  python -m openjev.tools.bench.gates --model .openjev/demo-model --workload benchmarks/workload.jsonl
  (GPU) ... --backend cuda --synthetic 27b --layers 8 --out docs/benchmarks/gpu-gates.md

Requests: --limit of them, chosen seeded and round-robin over kind x length group (the split's
groups, the multi-question and the capacity cases), so even a short run covers every kind; the
16,384-token case is left out unless --skip omits it. Against `off`, each policy's head scores
and probabilities: with --exact (the default on cuda) any bit of difference fails the gate; on
torch (not bit exact across policies) differences up to --tolerance pass. The mixed run sends
every request again, --mixed-clients at a time in a shuffled order under a random policy each,
and compares its head scores bit for bit with the same request run alone; some requests must
share passes, and the ones longer than a chunk are among them (they run spread over more passes
there than alone). The per-request log of the mixed run ends the report.
"""

from __future__ import annotations

import argparse
import math
import random
import struct
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openjev.config import positive_int
from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.tools.bench import workload
from openjev.tools.bench.gates_report import render
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.geometry import DEFAULT_GDN_SPLIT_AT
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits, default_chunk_tokens, shared_pass_tokens

# Every policy but the reference it is compared against.
POLICIES: tuple[PrefixPolicy, ...] = tuple(p for p in PREFIX_POLICIES if p != "off")
# Strata run last in the round-robin (slow; the oracle's first requests never reach them).
LAST_GROUPS = ("16k",)


def expected_score(p: list[float]) -> float:
    return sum(i * x for i, x in enumerate(p))


def same_bits(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


@dataclass
class Diff:
    """Differences of one answer from a reference over some requests, and how many values each
    measure covered (a maximum over no values is n/a, not 0)."""

    head_bits: int = 0  # head scores differing in any bit
    max_dhead: float = 0.0
    max_rel_dhead: float = 0.0  # relative to max(1, |reference|)
    prob_bits: int = 0
    max_dp: float = 0.0
    max_dscore: float = 0.0
    choice_changes: int = 0
    decisive_choice_changes: int = 0  # top two of the reference more than 2e-3 apart
    noul_flips: int = 0
    failures: int = 0
    saved_tokens: int = 0
    non_finite: int = 0  # values of either answer that are NaN or infinite (max() would skip a NaN)
    covered: Counter[str] = field(default_factory=Counter)  # requests, head, prob, choice, noul, score

    def add(self, kinds: list[str], base: ExecutionResult, other: ExecutionResult) -> None:
        self.covered["requests"] += 1
        for a_row, b_row in zip(base.head_scores, other.head_scores, strict=True):
            for a, b in zip(a_row, b_row, strict=True):
                self.covered["head"] += 1
                self.non_finite += not (math.isfinite(a) and math.isfinite(b))
                self.head_bits += not same_bits(a, b)
                self.max_dhead = max(self.max_dhead, abs(a - b))
                self.max_rel_dhead = max(self.max_rel_dhead, abs(a - b) / max(1.0, abs(a)))
        for kind, p, q in zip(kinds, base.probabilities, other.probabilities, strict=True):
            self.covered[kind] += 1
            for a, b in zip(p, q, strict=True):
                self.covered["prob"] += 1
                self.non_finite += not (math.isfinite(a) and math.isfinite(b))
                self.prob_bits += not same_bits(a, b)
                self.max_dp = max(self.max_dp, abs(a - b))
            if kind == "choice" and p.index(max(p)) != q.index(max(q)):
                self.choice_changes += 1
                # A change between near-tied options (top two within 2x the dp gate in the base
                # answer) is rounding noise deciding a tie; one beyond that is a real disagreement.
                top = sorted(p, reverse=True)
                self.decisive_choice_changes += int(len(top) > 1 and top[0] - top[1] > 2e-3)
            if kind == "score":
                self.max_dscore = max(self.max_dscore, abs(expected_score(p) - expected_score(q)))
            if kind == "noul" and (p[1] >= 0.5) != (q[1] >= 0.5):
                self.noul_flips += 1

    def cell(self, key: str) -> str:
        """A table cell: the measure, or n/a where it covered nothing."""
        covers = {
            "head_bits": "head",
            "max_dhead": "head",
            "max_rel_dhead": "head",
            "prob_bits": "prob",
            "max_dp": "prob",
            "max_dscore": "score",
            "choice_changes": "choice",
            "noul_flips": "noul",
        }[key]
        if not self.covered[covers]:
            return "n/a"
        value = getattr(self, key)
        if key == "choice_changes":
            return f"{value} ({self.decisive_choice_changes})"
        return f"{value:.2e}" if isinstance(value, float) else str(value)

    def problems(self, name: str, exact: bool, tolerance: float) -> list[str]:
        """Why this comparison fails its gate ([] where it meets it)."""
        out = []
        if not self.covered["requests"]:
            out.append(f"{name}: compared no request")
        if self.non_finite:
            out.append(f"{name}: {self.non_finite} head scores or probabilities are not finite")
        if exact and (self.head_bits or self.prob_bits):
            out.append(
                f"{name}: {self.head_bits} head scores and {self.prob_bits} probabilities differ in some bit "
                f"from `off` (max |d head| {self.max_dhead:.2e}, max |dp| {self.max_dp:.2e}; --exact)"
            )
        for key in ("max_rel_dhead", "max_dp", "max_dscore"):
            if getattr(self, key) > tolerance:
                out.append(f"{name}: {key} {getattr(self, key):.2e} > {tolerance:g}")
        for key in ("choice_changes", "noul_flips", "failures"):
            if getattr(self, key):
                out.append(f"{name}: {getattr(self, key)} {key.replace('_', ' ')}")
        return out


def select_cases(
    cases: list[workload.Case], limit: int | None, seed: int, skip: set[str], kinds: set[str] | None
) -> list[workload.Case]:
    """At most `limit` cases, round-robin over kind x group (in the workload's order of strata,
    LAST_GROUPS last), each stratum's cases in a seeded random order."""
    strata: dict[tuple[str, str], list[workload.Case]] = {}
    for case in cases:
        if case.group in skip or (kinds is not None and case.kind not in kinds):
            continue
        strata.setdefault((case.kind, case.group), []).append(case)
    rng = random.Random(seed)
    for members in strata.values():
        rng.shuffle(members)
    order = sorted(strata, key=lambda key: key[1] in LAST_GROUPS)  # stable: otherwise file order
    chosen: list[workload.Case] = []
    limit = sum(map(len, strata.values())) if limit is None else limit
    for rank in range(max(map(len, strata.values()), default=0)):
        for key in order:
            if rank < len(strata[key]) and len(chosen) < limit:
                chosen.append(strata[key][rank])
    return chosen


def build_runners(args):
    """(runner under test, transformers on the same weights, transformers on them in fp32 or None
    where the runner already is fp32): the fp32 one says which of the two bf16 ones is nearer.
    No transformers runners where --oracle-cases is 0."""
    if args.backend == "torch":
        from openjev.worker.model.runner import TorchRunner

        if not args.oracle_cases:
            return TorchRunner(args.model), None, None
        from openjev.tools.bench.transformers_arm import TransformersRunner

        return TorchRunner(args.model), TransformersRunner.from_export(args.model), None
    import torch

    from openjev.tools.bench.transformers_arm import TransformersRunner, to_device
    from openjev.worker.cuda.runner import CudaRunner

    options = {
        "graph_cache_size": args.graphs,
        "gdn_kernel": args.gdn_kernel,
        "gdn_split_at": args.gdn_split_at,
        "max_pass_tokens": args.max_launch_tokens,
    }
    if args.gemm_min_rows is not None:
        options["gemm_min_rows"] = args.gemm_min_rows
    runner = (
        CudaRunner.synthetic(args.synthetic, seed=args.seed, num_layers=args.layers, **options)
        if args.synthetic
        else CudaRunner.from_export(args.model, **options)
    )
    if not args.oracle_cases:
        return runner, None, None
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


def parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--seed", type=int, default=0, help="request choice, mixed-run policies and order, synthetic weights"
    )
    p.add_argument("--graphs", type=int, default=64, help="CUDA graph cache size (0: eager)")
    p.add_argument(
        "--gdn-kernel",
        choices=("serial", "chunked", "split"),
        default="serial",
        help="cuda backend: GDN prefill kernel (split: the chunked one from --gdn-split-at on)",
    )
    p.add_argument(
        "--gdn-split-at",
        type=int,
        default=DEFAULT_GDN_SPLIT_AT,
        help="cuda backend, --gdn-kernel split: the chunked kernel's first position",
    )
    p.add_argument(
        "--gemm-min-rows", type=int, default=None, help="cuda backend: pad smaller products to this many rows"
    )
    p.add_argument("--skip", default="16k", help="comma list of case groups to leave out ('' : none)")
    p.add_argument("--kinds", default="", help="comma list: only cases of these kinds (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests, round-robin over kind x group")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of policies compared with `off`")
    p.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fail on any bit of difference from `off` (default: on for cuda, off for torch)",
    )
    p.add_argument(
        "--tolerance", type=float, default=1e-3, help="largest |dp|, |d score| and relative |d head| that pass"
    )
    p.add_argument("--oracle-cases", type=int, default=40, help="cases compared with transformers (the first chosen)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--mixed-clients", type=int, default=8, help="batch invariance: requests sent at once, sharing passes"
    )
    p.add_argument("--max-launch-tokens", type=positive_int, default=4096, help="pass budget (the worker's default)")
    p.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=None,
        help="a request's most tokens in a shared pass (default: the worker's, half of --shared-launch-tokens, "
        "else of --max-launch-tokens)",
    )
    p.add_argument(
        "--shared-launch-tokens",
        type=positive_int,
        default=None,
        help="most tokens of a pass while several requests wait (the worker's flag; default: the pass budget)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.exact is None:
        args.exact = args.backend == "cuda"
    if args.chunk_tokens is None:  # as the worker derives it (worker/main.py)
        args.chunk_tokens = default_chunk_tokens(shared_pass_tokens(args.max_launch_tokens, args.shared_launch_tokens))
    try:  # a combination the worker would refuse is a usage error here too, not a traceback later
        args.pack_limits = PackLimits(
            max_tokens=args.max_launch_tokens, chunk_tokens=args.chunk_tokens, shared_tokens=args.shared_launch_tokens
        )
    except ValueError as e:
        p.error(f"--max-launch-tokens, --chunk-tokens, --shared-launch-tokens: {e}")
    args.policies = tuple(x for x in args.policies.split(",") if x)
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies: {unknown or 'none'}; expected some of {POLICIES}")
    return args


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_gates(argv))


def run_gates(argv: list[str] | None = None) -> int:
    """Run the gates, print (and write) the report; 0 where every gate is met, else 1."""
    args = parse_args(argv)
    policies: tuple[PrefixPolicy, ...] = args.policies
    meta, candidates_of, longest = longest_tokens_fn(args.model)
    everything = workload.read_jsonl(args.workload)
    skip = {g for g in args.skip.split(",") if g}
    kinds = {k for k in args.kinds.split(",") if k} or None
    cases = select_cases(everything, args.limit, args.seed, skip, kinds)
    runner, oracle, exact = build_runners(args)
    limits = args.pack_limits
    engine = Engine(runner, pack_limits=limits, cost_model=default_cost_model(args.backend))
    # transformers scores whole prompts only (no chunks, no parent states): as the worker runs it
    whole = PackLimits(
        max_tokens=max(meta.max_length, limits.max_tokens), chunk_tokens=max(meta.max_length, limits.max_tokens)
    )
    oracle_engine = (
        Engine(oracle, pack_limits=whole, cost_model=default_cost_model("torch")) if oracle is not None else None
    )
    exact_engine = (
        Engine(exact, pack_limits=whole, cost_model=default_cost_model("torch")) if exact is not None else None
    )
    rows = {policy: Diff() for policy in policies}
    oracle_diff = Diff()
    fp32 = {"ours_vs_fp32": 0.0, "transformers_vs_fp32": 0.0}
    submitted = 0
    alone: dict[tuple[int, PrefixPolicy], ExecutionResult] = {}  # (case, policy) -> its answer run alone
    works: list[list[QuestionWork]] = []
    for index, case in enumerate(cases):
        if index % 25 == 0:
            print(f"gates: {index}/{len(cases)} requests", file=sys.stderr, flush=True)
        ids = candidates_of(case.request)
        question_kinds = [q["type"] for q in case.request["questions"].values()]
        work = [QuestionWork(kind, tuple(tuple(t) for t in q)) for kind, q in zip(question_kinds, ids, strict=True)]
        works.append(work)
        base = engine.execute(work, temperature=meta.temperature, policy="off")
        alone[index, "off"] = base
        submitted += base.num_submitted_tokens
        for policy in policies:
            try:
                other = engine.execute(work, temperature=meta.temperature, policy=policy)
            except Exception as error:  # a failure is a gate result, not a crash of the run
                print(f"{case.name} {policy}: {error!r}", file=sys.stderr)
                rows[policy].failures += 1
                continue
            alone[index, policy] = other
            rows[policy].saved_tokens += other.num_saved_tokens
            rows[policy].add(question_kinds, base, other)
        if oracle_engine is not None and index < args.oracle_cases:
            try:
                ref = oracle_engine.execute(work, temperature=meta.temperature, policy="off")
                truth = None
                if exact_engine is not None:
                    truth = exact_engine.execute(work, temperature=meta.temperature, policy="off").head_scores
            except Exception as error:  # reported, as the whole comparison is
                print(f"{case.name} transformers: {error!r}", file=sys.stderr)
                oracle_diff.failures += 1
                continue
            oracle_diff.add(question_kinds, ref, base)
            if truth is not None:
                for key, scores in (("ours_vs_fp32", base.head_scores), ("transformers_vs_fp32", ref.head_scores)):
                    fp32[key] = max(fp32[key], max_rel_head(scores, truth))
    mixed = batch_invariance(
        engine,
        cases,
        works,
        alone,
        meta.temperature,
        clients=args.mixed_clients,
        seed=args.seed,
        policies=("off", *policies),
        chunk_tokens=args.chunk_tokens,
    )
    # The engines are left open: a scheduler thread that ends while the interpreter exits can abort
    # it ("terminate called without an active exception", exit status 134 in place of the verdict's).
    graphs = getattr(runner, "graphs", None)
    failures = [
        problem for policy, diff in rows.items() for problem in diff.problems(policy, args.exact, args.tolerance)
    ]
    failures += mixed_problems(mixed)
    if graphs is not None and graphs.failures:
        failures.append(f"{graphs.failures} CUDA graph capture failures")
    text = render(
        args,
        argv,
        runner,
        cases,
        everything,
        longest,
        submitted,
        rows,
        oracle_diff,
        fp32,
        exact is not None,
        mixed,
        failures,
    )
    if args.out:
        args.out.write_text(text)
    print(text)
    return 1 if failures else 0


def mixed_problems(mixed: dict[str, Any]) -> list[str]:
    out = [] if mixed["requests"] else ["mixed run: compared no request"]
    if mixed["requests"] and not mixed["shared"]:
        out.append("mixed run: no request shared a pass with another (batch invariance not tested)")
    if mixed["long"] and not mixed["split_shared"]:
        out.append(
            f"mixed run: {mixed['long']} requests computed more than a chunk, but none ran over more than one "
            "pass while sharing one (invariance of a request split over passes not tested)"
        )
    if mixed["mismatches"]:  # bit for bit in either mode: the CPU reference is batch invariant too
        out.append(
            f"mixed run: {mixed['mismatches']} requests differ in some bit of a head score from alone "
            f"(max |d head| {mixed['max_dhead']:.2e})"
        )
    if mixed["failures"]:
        out.append(f"mixed run: {mixed['failures']} requests failed")
    return out


def batch_invariance(
    engine: Engine,
    cases: list[workload.Case],
    works: list[list[QuestionWork]],
    alone: dict[tuple[int, PrefixPolicy], ExecutionResult],
    temperature: float,
    *,
    clients: int,
    seed: int,
    policies: tuple[PrefixPolicy, ...],
    chunk_tokens: int,
) -> dict[str, Any]:
    """Every request again, `clients` at a time in a seeded order through the same engine (so
    they share forward passes) under a seeded random policy each, compared bit for bit with the
    same request run alone."""
    rng = random.Random(seed)
    drawn = [(index, rng.choice(policies)) for index in range(len(works))]
    rng.shuffle(drawn)  # long requests among short ones, not in the strata's order
    jobs = [job for job in drawn if job in alone]

    def one(job: tuple[int, PrefixPolicy]) -> tuple[tuple[int, PrefixPolicy], ExecutionResult | None]:
        index, policy = job
        try:
            return job, engine.execute(works[index], temperature=temperature, policy=policy)
        except Exception as error:  # counted, not raised: the report says how many
            print(f"mixed {cases[index].name} {policy}: {error!r}", file=sys.stderr)
            return job, None

    out: dict[str, Any] = {
        "jobs": jobs,
        "dropped": [job for job in drawn if job not in alone],
        "requests": len(jobs),
        "shared": 0,
        "long": 0,
        "split_shared": 0,
        "more_passes": 0,
        "fewer_passes": 0,
        "mismatches": 0,
        "max_dhead": 0.0,
        "failures": 0,
        "log": [],
    }
    with ThreadPoolExecutor(max(1, clients)) as pool:
        for (index, policy), result in pool.map(one, jobs):
            before = alone[index, policy]
            name = cases[index].name
            if result is None:
                out["failures"] += 1
                out["log"].append(
                    f"| {name} | {policy} | {before.num_computed_tokens} | {before.num_launches} | failed | | |"
                )
                continue
            shared = result.num_shared_passes > 0
            long = result.num_computed_tokens > chunk_tokens
            out["shared"] += shared
            out["long"] += long
            # what the gate needs: a request spread over passes that it shared (one longer than a
            # chunk may still run whole in one pass, where the pass has room)
            out["split_shared"] += result.num_launches > 1 and shared
            out["more_passes"] += result.num_launches > before.num_launches
            out["fewer_passes"] += result.num_launches < before.num_launches
            pairs = [
                (a, b)
                for x, y in zip(before.head_scores, result.head_scores, strict=True)
                for a, b in zip(x, y, strict=True)
            ]
            same = all(same_bits(a, b) for a, b in pairs)
            out["mismatches"] += not same
            for a, b in pairs:
                out["max_dhead"] = max(out["max_dhead"], abs(a - b))
            line = (
                f"| {name} | {policy} | {result.num_computed_tokens} | {before.num_launches} | {result.num_launches} "
                f"| {result.num_shared_passes} | {'yes' if same else 'no'} |"
            )
            out["log"].append(line)
            print(
                f"mixed {name} {policy}: passes alone {before.num_launches}, mixed {result.num_launches}, "
                f"shared {result.num_shared_passes}, same bits {same}",
                file=sys.stderr,
            )
    return out


if __name__ == "__main__":
    main()

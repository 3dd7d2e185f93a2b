"""The numerical gates' report (gates.py runs them): what was compared, how many values each
column covered, the verdict, and the mixed run's per-request log."""

from __future__ import annotations

import datetime
import shlex
import sys
from collections import Counter
from typing import TYPE_CHECKING

from openjev.tools.bench import workload

if TYPE_CHECKING:
    from openjev.tools.bench.gates import Diff

MIXED_LOG_HEADER = "## Mixed run, per request"


def render(
    args,
    argv,
    runner,
    cases,
    everything,
    longest,
    submitted,
    rows,
    oracle_diff: Diff,
    fp32,
    has_fp32: bool,
    mixed,
    failures,
) -> str:
    card = "CPU"
    if args.backend == "cuda":
        import torch

        card = torch.cuda.get_device_name()
    command = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    mode = (
        "exact: every head score and probability of every policy bit for bit those of `off`"
        if args.exact
        else f"tolerance {args.tolerance:g} against `off` (max |dp|, max |d score|, max |d head| relative to "
        "max(1, |s|); bit differences counted, not gated)"
    )
    lines = [
        f"# Numerical gates, {datetime.date.today().isoformat()}",
        "",
        f"- command: `python -m openjev.tools.bench.gates {command}`",
        f"- backend {args.backend}, card {card}, weights: "
        + (f"synthetic {args.synthetic}, {runner.config.num_layers} layers" if args.synthetic else str(args.model)),
        f"- seed {args.seed} (the requests chosen, the mixed run's policies and order"
        + (", the synthetic weights)" if args.synthetic else ")"),
        f"- gate: {mode}; every mixed-run request's head scores bit for bit those of the same request run alone",
        f"- pass budget {args.max_launch_tokens} tokens, chunks of {args.chunk_tokens} tokens (a request's most "
        "tokens in a pass it shares)"
        + (f", shared passes of at most {args.shared_launch_tokens}" if args.shared_launch_tokens else ""),
        f"- {len(cases)} of {len(everything)} workload requests, round-robin over kind x group in a seeded order "
        f"(left out: {args.skip or 'none'}{'; kinds ' + args.kinds if args.kinds else ''}); "
        f"{submitted} tokens submitted per policy",
        f"- verdict: **{'FAIL' if failures else 'PASS'}**" + (": " + "; ".join(failures) if failures else ""),
        "",
        "| kind | group | requests | questions | candidates | longest prompt (tokens) |",
        "|---|---|---|---|---|---|",
    ]
    strata: dict[tuple[str, str], list[workload.Case]] = {}
    for case in cases:
        strata.setdefault((case.kind, case.group), []).append(case)
    for (kind, group), members in strata.items():
        questions = [q for c in members for q in c.request["questions"].values()]
        candidates = sum(1 if q["type"] == "noul" else len(q["criteria"]) for q in questions)
        lines.append(
            f"| {kind} | {group} | {len(members)} | {len(questions)} | {candidates} "
            f"| {max(longest(c.request) for c in members)} |"
        )
    lines += [
        "",
        "## Every policy against `off`",
        "",
        "| policy vs off | head scores differing (any bit) | max abs d head | probabilities differing (any bit) "
        "| max abs dp | max abs d score | choice changes (decisive: top-2 gap > 2e-3) | noul flips | failures "
        "| saved tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, r in rows.items():
        lines.append(
            f"| {policy} | {r.cell('head_bits')} | {r.cell('max_dhead')} | {r.cell('prob_bits')} | {r.cell('max_dp')} "
            f"| {r.cell('max_dscore')} | {r.cell('choice_changes')} | {r.cell('noul_flips')} | {r.failures} "
            f"| {r.saved_tokens} |"
        )
    lines += [
        "",
        "Values each row compared:",
        "",
        "| policy | requests | head scores | probabilities | choice questions | noul questions | score questions |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, r in rows.items():
        c = r.covered
        lines.append(
            f"| {policy} | {c['requests']} | {c['head']} | {c['prob']} | {c['choice']} | {c['noul']} | {c['score']} |"
        )
    o = oracle_diff
    lines += ["", "## Against transformers (reported, not gated)", ""]
    if not o.covered["requests"]:
        lines += [
            f"Not compared with transformers in this run (--oracle-cases {args.oracle_cases}"
            + (f"; {o.failures} requests failed there)." if o.failures else ").")
        ]
    else:
        lines += [
            f"`off` against transformers on the same weights, {o.covered['requests']} of the first "
            f"{min(args.oracle_cases, len(cases))} requests chosen "
            f"({o.covered['choice']} choice, {o.covered['noul']} noul, {o.covered['score']} score questions; "
            f"{o.covered['head']} head scores): max abs dp {o.cell('max_dp')}, max abs d score {o.cell('max_dscore')}, "
            f"max head-score difference (relative to max(1, |s|)) {o.cell('max_rel_dhead')}, choice changes "
            f"(decisive) {o.cell('choice_changes')}, noul flips {o.cell('noul_flips')}; {o.failures} requests "
            "failed there.",
        ]
        if has_fp32:
            lines += [
                "",
                "Against the same weights in fp32 (transformers, same requests), max head-score difference relative to "
                f"max(1, |s|): ours (bf16) {fp32['ours_vs_fp32']:.2e}, transformers in bf16 "
                f"{fp32['transformers_vs_fp32']:.2e}.",
            ]
    m = mixed
    drawn = ", ".join(f"{policy} {n}" for policy, n in sorted(Counter(p for _, p in m["jobs"]).items()))
    lines += [
        "",
        "## Batch invariance",
        "",
        f"{m['requests']} requests sent {args.mixed_clients} at a time in a shuffled order, each under a random "
        f"policy ({drawn or 'none'}), compared bit for bit with the same request and policy run alone:",
        "",
        f"- {m['shared']} of them shared at least one pass with another request (gate: at least one)",
        f"- {m['long']} computed more than a chunk ({args.chunk_tokens} tokens); {m['split_shared']} ran over more "
        "than one pass while sharing one (gate: at least one where any computed more than a chunk)",
        f"- {m['more_passes']} ran in more passes mixed than alone, {m['fewer_passes']} in fewer",
        f"- {m['mismatches']} differ in some bit of some head score from alone (max abs d head "
        f"{m['max_dhead']:.2e}); {m['failures']} failed",
        "- (request, policy) pairs left out because they failed alone: "
        + (", ".join(f"({cases[i].name}, {p})" for i, p in m["dropped"]) or "none"),
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
            f"CUDA graphs: {graphs.cache.num_captures} captures, {graphs.hits} passes replayed a graph captured "
            "before them, "
            f"{graphs.failures} capture failures.",
        ]
    lines += [
        "",
        "Not gated here: the worker's state cache (off in this engine), and the transformers comparison above.",
        "",
        MIXED_LOG_HEADER,
        "",
        "| request | policy | tokens computed | passes alone | passes mixed | shared passes | same bits |",
        "|---|---|---|---|---|---|---|",
        *m["log"],
    ]
    return "\n".join(lines) + "\n"

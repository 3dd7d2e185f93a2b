"""How long the worker's planner takes (policy auto, the CUDA cost model, the runner's pass depth):
requests of benchmarks/workload.jsonl, and a score question with 8 levels over a long state (the
shape of a state-cache hit in benchmarks/profile_state_hit.py). Planning runs on the request's
thread before the request is admitted, so its time adds to the request's latency.

    .venv/bin/python benchmarks/plan_cpu.py [--model .openjev/demo-model] [--repeats 50] [--cases A,B]
        [--policies auto,shared] [--wide N]

Prints a table: tokens, candidates and per request and policy the best of 5 batches' mean plan
time. `--wide N` adds N candidates over a five-word state, choice questions of 255 criteria
each: with 65,536 (the contract's most candidates) near the largest request a frontend admits
by default (its token and rendered-byte limits are checked here); give it `--repeats 1`.
`--memory` instead plans 256 candidates of 16,384 tokens (the worker's default token limit) once
per policy under tracemalloc: the planner's peak allocation beyond the ids, and what it keeps.
"""

from __future__ import annotations

import argparse
import math
import time
import tracemalloc
from array import array
from pathlib import Path

from profile_state_hit import ASK, SENTENCE  # the cache-hit profile's question and state sentence

from openjev.contract.request import MAX_RENDERED_BYTES, parse_request
from openjev.frontend.service import DEFAULT_MAX_REQUEST_TOKENS
from openjev.tools.bench import workload
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits
from openjev.worker.planner.policy import plan_request

DEFAULT_CASES = "noul-1-128-0,choice-1-128-0,score-129-512-12,choice-2049-4096-112,choice-2049-4096-120"
STATE_SENTENCES = 240  # ~4,700 tokens, the profile's longest state
PASS_DEPTH = 8  # CudaRunner's max_pass_depth
BATCHES = 5


def requests(model: Path, cases: list[str], wide: int) -> dict[str, list[list[array]]]:
    """name -> per question, each candidate's token ids as array('I'), as the worker holds them
    (worker/stream.py)."""
    _, candidates_of, _ = longest_tokens_fn(model)
    by_name = {c.name: c.request for c in workload.read_jsonl(Path(__file__).parent / "workload.jsonl")}
    out = {name: [[array("I", t) for t in q] for q in candidates_of(by_name[name])] for name in cases}
    state = "".join(SENTENCE.format(n=i) for i in range(STATE_SENTENCES))
    request = {"state": state, "questions": {"q": ASK}}
    out["score-8-over-long-state"] = [[array("I", t) for t in candidates_of(request)[0]]]
    if wide:  # choice questions of 255 criteria each (the contract's most) over a short state
        per = 255
        questions = {
            f"q{j}": {
                "type": "choice",
                "instructions": "Pick one.",
                "criteria": {f"o{i}": None for i in range(j * per, min(wide, (j + 1) * per))},
            }
            for j in range(-(-wide // per))
        }
        wide_request = {"state": "The invoice is wrong.", "questions": questions}
        parse_request(wide_request, accepted_models=(), max_rendered_bytes=MAX_RENDERED_BYTES)  # the frontend's limits
        candidates = candidates_of(wide_request)
        tokens = sum(len(t) for q in candidates for t in q)
        assert tokens <= DEFAULT_MAX_REQUEST_TOKENS, f"{tokens} tokens: over the frontend's default limit"
        out[f"choice-{wide}-over-a-short-state"] = [[array("I", t) for t in q] for q in candidates]
    return out


def memory(policies: list[str]) -> None:
    cost = default_cost_model("cuda")
    questions = [
        [array("I", (1000 + (c * 7 + i) % 200000 for i in range(16384))) for c in range(255)],
        [array("I", range(1000, 17384))],
    ]
    print("256 candidates of 16,384 tokens (16 MiB of ids), one plan each under tracemalloc")
    print("| policy | seconds (under tracemalloc) | peak allocated MiB | kept MiB |")
    print("|---|---|---|---|")
    for policy in policies:
        tracemalloc.start()
        start = time.perf_counter()
        plan = plan_request(questions, policy, PackLimits(), cost, PASS_DEPTH)
        seconds = time.perf_counter() - start
        kept, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del plan
        print(f"| {policy} | {seconds:.2f} | {peak / 2**20:.0f} | {kept / 2**20:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--policies", default="auto")
    p.add_argument("--wide", type=int, default=0)
    p.add_argument("--memory", action="store_true", help="the planner's memory on a request of 4 Mi tokens instead")
    args = p.parse_args()
    cost = default_cost_model("cuda")
    policies = args.policies.split(",")
    if args.memory:
        memory(policies)
        return
    print(f"plan ms, best of {BATCHES} batches of {args.repeats}, policies interleaved")
    print("| request | tokens | candidates | " + " | ".join(policies) + " |")
    print("|---|---|---|" + "---|" * len(policies))
    for name, questions in requests(args.model, args.cases.split(","), args.wide).items():
        best = dict.fromkeys(policies, math.inf)
        for _ in range(BATCHES):  # the mean of a batch: a single plan is a few microseconds
            for policy in policies:
                start = time.perf_counter()
                for _ in range(args.repeats):
                    plan_request(questions, policy, PackLimits(), cost, PASS_DEPTH)
                best[policy] = min(best[policy], (time.perf_counter() - start) / args.repeats)
        tokens, candidates = sum(len(c) for q in questions for c in q), sum(len(q) for q in questions)
        print(f"| {name} | {tokens} | {candidates} | " + " | ".join(f"{1e3 * best[p]:.3f}" for p in policies) + " |")


if __name__ == "__main__":
    main()

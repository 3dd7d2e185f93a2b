"""How long the worker's planner takes (policy auto, the CUDA cost model, the runner's pass depth):
requests of benchmarks/workload.jsonl, and a score question with 8 levels over a long state (the
shape of a state-cache hit in benchmarks/profile_state_hit.py). Planning runs on the request's
thread before the request is admitted, so its time adds to the request's latency.

    .venv/bin/python benchmarks/plan_cpu.py [--model .openjev/demo-model] [--repeats 50] [--cases A,B]

Prints a table: tokens, candidates and per request the best of 5 batches' mean plan time.
"""

from __future__ import annotations

import argparse
import math
import time
from array import array
from pathlib import Path

from profile_state_hit import ASK, SENTENCE  # the cache-hit profile's question and state sentence

from openjev.tools.bench import workload
from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.planner.cost import default_cost_model
from openjev.worker.planner.plan import PackLimits
from openjev.worker.planner.policy import plan_request

DEFAULT_CASES = "noul-1-128-0,choice-1-128-0,score-129-512-12,choice-2049-4096-112,choice-2049-4096-120"
STATE_SENTENCES = 240  # ~4,700 tokens, the profile's longest state
PASS_DEPTH = 8  # CudaRunner's max_pass_depth
BATCHES = 5


def requests(model: Path, cases: list[str]) -> dict[str, list[list[array]]]:
    """name -> per question, each candidate's token ids as array('I'), as the worker holds them
    (worker/stream.py)."""
    _, candidates_of, _ = longest_tokens_fn(model)
    by_name = {c.name: c.request for c in workload.read_jsonl(Path(__file__).parent / "workload.jsonl")}
    out = {name: [[array("I", t) for t in q] for q in candidates_of(by_name[name])] for name in cases}
    state = "".join(SENTENCE.format(n=i) for i in range(STATE_SENTENCES))
    request = {"state": state, "questions": {"q": ASK}}
    out["score-8-over-long-state"] = [[array("I", t) for t in candidates_of(request)[0]]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cases", default=DEFAULT_CASES)
    args = p.parse_args()
    cost = default_cost_model("cuda")
    print(f"| request | tokens | candidates | plan ms (best of {BATCHES} batches of {args.repeats}) |")
    print("|---|---|---|---|")
    for name, questions in requests(args.model, args.cases.split(",")).items():
        best = math.inf
        for _ in range(BATCHES):  # the mean of a batch: a single plan is a few microseconds
            start = time.perf_counter()
            for _ in range(args.repeats):
                plan_request(questions, "auto", PackLimits(), cost, PASS_DEPTH)
            best = min(best, (time.perf_counter() - start) / args.repeats)
        tokens, candidates = sum(len(c) for q in questions for c in q), sum(len(q) for q in questions)
        print(f"| {name} | {tokens} | {candidates} | {1e3 * best:.3f} |")


if __name__ == "__main__":
    main()

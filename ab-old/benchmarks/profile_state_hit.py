"""Where a state-cache hit's time goes on the GPU (issue 17): one question about a long cached
state against the same question with no state, 27B shape, synthetic weights, CUDA graphs.

For each state length: a first request on the state (another question) fills the cache; then
questions never asked before on that state (hits: only the question and candidates run), each
beside the same question with `"state": ""` on an engine without a cache; medians of 5
interleaved, then one torch.profiler run of each with device time per kernel family
(profile_requests.FAMILIES).

    PYTHONPATH=. python3 benchmarks/profile_state_hit.py --model .openjev/demo-model [--out hit.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from profile_requests import host_profile, profiled

from openjev.tools.bench.main import longest_tokens_fn
from openjev.worker.cache.sizing import build_state_cache
from openjev.worker.cuda.runner import CudaRunner
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.cost import default_cost_model

FILL = {"type": "noul", "instructions": "Does this message describe a duplicate charge?"}
ASK = {
    "type": "score",
    "instructions": "Assess the urgency using only the given evidence.",
    "criteria": ["Routine.", "Low.", "Moderate.", "Elevated.", "High.", "Severe.", "Urgent.", "Critical."],
}
SENTENCE = "The customer writes that the invoice for order {n} shows a charge they do not recognise. "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--shape", default="27b")
    p.add_argument("--sentences", type=int, nargs="+", default=[0, 40, 120, 240], help="state lengths (sentences)")
    p.add_argument("--host", action="store_true", help="also cProfile the host work of the last state's arms")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    meta, candidates_of, _ = longest_tokens_fn(args.model)
    runner = CudaRunner.synthetic(args.shape, seed=0, graph_capture_after=1)
    cache = build_state_cache(runner, 16 << 30, "profile")
    engine = Engine(runner, cost_model=default_cost_model("cuda"), state_cache=cache)
    plain = Engine(runner, cost_model=default_cost_model("cuda"))
    asked = iter(range(10**6))

    def ask() -> dict:  # a question never asked before: no deposit of an earlier one matches it
        return ASK | {"instructions": f"{ASK['instructions']} Ticket {next(asked)}."}

    def work(state: str, question: dict) -> list[QuestionWork]:
        ids = candidates_of({"state": state, "questions": {"q": question}})[0]
        return [QuestionWork(question["type"], tuple(tuple(t) for t in ids))]

    def once(arm: str, w) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        (engine if arm == "hit" else plain).execute(w, temperature=meta.temperature, policy="auto")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    lines = [
        f"# State-cache hit profile, {datetime.date.today().isoformat()}",
        "",
        f"- card {torch.cuda.get_device_name()}; {args.shape} shape, synthetic weights, policy auto, graphs "
        "captured on second sight; command: `PYTHONPATH=benchmarks:. python3 benchmarks/profile_state_hit.py "
        "--model .openjev/demo-model`",
        "",
        "| state tokens | arm | median ms | computed tokens | hit tokens | device ms | top families (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in args.sentences:
        state = "".join(SENTENCE.format(n=i) for i in range(n)) or "(empty)"
        tokens = len(work(state, ASK)[0].candidates[0]) - len(work("", ASK)[0].candidates[0])
        engine.execute(work(state, FILL), temperature=meta.temperature, policy="auto")  # fills the cache
        samples: dict[str, list[float]] = {"hit": [], "no state": []}
        for k in range(7):  # the first two capture graphs
            q = ask()
            for arm, w in (("hit", work(state, q)), ("no state", work("", q))):
                seconds = once(arm, w)
                if k >= 2:
                    samples[arm].append(seconds)
        q = ask()
        for name, w in (("hit", work(state, q)), ("no state", work("", q))):
            eng = engine if name == "hit" else plain
            result = eng.execute(w, temperature=meta.temperature, policy="auto")
            q2 = ask()  # the profiled run: one more fresh question
            w = work(state, q2) if name == "hit" else work("", q2)
            per, device, _, _ = profiled(eng, w, meta.temperature)
            top = ", ".join(
                f"{f.split(' (')[0]} {1e3 * s:.1f}" for f, s in sorted(per.items(), key=lambda kv: -kv[1])[:4]
            )
            lines.append(
                f"| {tokens} | {name} | {1e3 * statistics.median(samples[name]):.1f} | "
                f"{result.num_computed_tokens} | {result.cache_hit_tokens} | {1e3 * device:.1f} | {top} |"
            )
        print(lines[-2], lines[-1], sep="\n", flush=True)
    if args.host:
        for name, eng, st in (("hit", engine, state), ("no state", plain, "")):
            lines += ["", f"Host work of 3 more {name} requests (cProfile of the scheduler thread):", "```"]
            lines += host_profile(eng, [work(st, ask()) for _ in range(3)], meta.temperature).splitlines() + ["```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

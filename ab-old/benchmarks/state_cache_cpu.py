"""CPU benchmark of the state cache: a question about a state an earlier request sent, against
the same question about a state never seen.

    .venv/bin/python benchmarks/state_cache_cpu.py [--repeats 9] [--threads 1]

The real engine and torch runner (fp32) on the demo export, requests rendered and tokenized as
the frontend does: a ~1,500-token workload state and pairs of workload questions (an earlier
call asks question A, the timed call question B). Per repeat and pair, three arms, interleaved
in rotating order after one warm-up block:
- seen:   cache on; the cache is emptied, the earlier call (A) runs, then B is timed;
- unseen: cache on; the cache is emptied, then B is timed (the state was never sent);
- off:    no cache; B is timed.
Prints a table (median and interquartile range over repeats and pairs; seen/unseen per pair,
then the median of those ratios) and writes the raw timings to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from openjev.contract.request import parse_request
from openjev.tokenizer import PromptTokenizer
from openjev.tools.demo_model import build_demo_model
from openjev.worker.cache.sizing import CPU_DEFAULT_BYTES, build_state_cache
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.model.runner import TorchRunner
from openjev.worker.planner import CPU_COST_MODEL

REPO = Path(__file__).resolve().parents[1]
ARMS = ("seen", "unseen", "off")


def to_work(tokenizer: PromptTokenizer, obj: dict) -> list[QuestionWork]:
    compiled = parse_request(obj, accepted_models=())
    return [QuestionWork(q.kind, tuple(map(tuple, tokenizer.encode(q.prompts)))) for q in compiled.questions]


def workload_inputs(tokenizer: PromptTokenizer, target_tokens: int, num_pairs: int):
    """The workload state closest to target_tokens (rendered with a question), and up to
    num_pairs ordered pairs (A, B) of the workload's distinct single questions (by kind and
    instructions: the workload has three, so at most six pairs)."""
    rows = [json.loads(line)["request"] for line in (REPO / "benchmarks" / "workload.jsonl").read_text().splitlines()]
    distinct: dict[tuple[str, str], dict] = {}
    for r in rows:
        if len(r["questions"]) == 1:
            (q,) = r["questions"].values()
            distinct.setdefault((q["type"], q.get("instructions", "")), r["questions"])
    questions = list(distinct.values())
    states = {json.dumps(r["state"]): r["state"] for r in rows if r["state"] not in ("", None)}

    def length(state) -> int:
        work = to_work(tokenizer, {"state": state, "questions": questions[0]})
        return min(len(c) for q in work for c in q.candidates)

    near = sorted(states.values(), key=lambda s: abs(len(json.dumps(s)) - 4.6 * target_tokens))[:8]
    state = min(near, key=lambda s: abs(length(s) - target_tokens))
    pairs = [(a, b) for a in questions for b in questions if a is not b][:num_pairs]
    return state, length(state), pairs


def common_prefix(pair: tuple[list[QuestionWork], list[QuestionWork]]) -> int:
    """Tokens the timed call's first prompt shares with the earlier call's first prompt."""
    a, b = pair[0][0].candidates[0], pair[1][0].candidates[0]
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--pairs", type=int, default=6, help="question pairs (A asked first, B timed)")
    parser.add_argument("--state-tokens", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    model_dir = build_demo_model(args.model_dir, seed=0)
    runner = TorchRunner(model_dir, num_threads=args.threads)
    tokenizer = PromptTokenizer.from_export(model_dir)
    cache = build_state_cache(runner, CPU_DEFAULT_BYTES, "bench")
    assert cache is not None
    cached, plain = Engine(runner, cost_model=CPU_COST_MODEL, state_cache=cache), Engine(runner)
    temperature = runner.meta.temperature
    state, state_tokens, pairs = workload_inputs(tokenizer, args.state_tokens, args.pairs)
    works = [
        (
            to_work(tokenizer, {"state": state, "questions": a}),
            to_work(tokenizer, {"state": state, "questions": b}),
        )
        for a, b in pairs
    ]

    times: dict[str, list[list[float]]] = {arm: [[] for _ in pairs] for arm in ARMS}
    facts: dict[str, list[dict]] = {arm: [{} for _ in pairs] for arm in ARMS}
    for block in range(args.repeats + 1):  # block 0 warms up
        for p, (first, second) in enumerate(works):
            order = ARMS[(block + p) % 3 :] + ARMS[: (block + p) % 3]
            for arm in order:
                cache.clear()
                if arm == "seen":
                    cached.execute(first, temperature=temperature)
                engine = plain if arm == "off" else cached
                started = time.perf_counter()
                result = engine.execute(second, temperature=temperature)
                seconds = time.perf_counter() - started
                if block:
                    times[arm][p].append(seconds)
                facts[arm][p] = {
                    "tokens_submitted": result.num_submitted_tokens,
                    "tokens_computed_by_plan": result.num_computed_tokens,
                    "cache_hit_tokens": result.cache_hit_tokens,
                    "passes": result.num_launches,
                    "policy": result.executed_policy,
                }
                if arm == "seen" and block:
                    assert result.cache_hit_tokens > 0, "the earlier call left no state to hang from"

    def q(values, f):
        return float(np.quantile(np.asarray(values) * 1e3, f))

    print(
        f"# {datetime.date.today()}  {platform.processor() or platform.machine()}  "
        f"threads={args.threads} repeats={args.repeats}"
    )
    print(f"# state: {state_tokens} tokens (rendered with the first question); {len(pairs)} question pairs")
    print(
        "| earlier -> timed question | shared prefix | arm | median ms | IQR ms | vs unseen "
        "| tokens (plan) | cache hit tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for p, (_a, b) in enumerate(pairs):
        name = f"{next(iter(_a.values()))['type']} -> {next(iter(b.values()))['type']}"
        shared = common_prefix(works[p])
        unseen = statistics.median(times["unseen"][p])
        ratios.append(statistics.median(times["seen"][p]) / unseen)
        for arm in ARMS:
            ms = times[arm][p]
            f = facts[arm][p]
            print(
                f"| {name} | {shared} | {arm} | {statistics.median(ms) * 1e3:.1f} "
                f"| {q(ms, 0.25):.1f}-{q(ms, 0.75):.1f} "
                f"| {statistics.median(ms) / unseen:.2f}x | {f['tokens_computed_by_plan']} | {f['cache_hit_tokens']} |"
            )
    print(
        f"seen / unseen, median over pairs: {statistics.median(ratios):.2f}x "
        f"(per pair: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"state-cache-cpu-{datetime.date.today()}.json"
    path.write_text(
        json.dumps(
            {
                "date": str(datetime.date.today()),
                "machine": platform.processor() or platform.machine(),
                "threads": args.threads,
                "repeats": args.repeats,
                "state_tokens": state_tokens,
                "pairs": [{"first": a, "timed": b} for a, b in pairs],
                "seconds": times,
                "facts": facts,
                "seen_over_unseen": ratios,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

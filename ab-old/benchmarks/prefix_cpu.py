"""CPU benchmark of the prefix policies: latency and tokens computed, off vs each policy.

    .venv/bin/python benchmarks/prefix_cpu.py [--repeats 15] [--threads 2] [--fit]

Runs the real engine + TorchRunner (fp32) on the embedded demo export (built into
.openjev/demo-model if missing), with requests rendered and tokenized as the frontend does.
Arms are interleaved in repeated blocks (the order rotates every block) so drift and noise from
other processes hit every arm alike; the table gives the median and the interquartile range of
the repeats. --fit also times single launches over a grid of shapes and fits the CPU cost model
(seconds per launch / token / attention pair) by least squares.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np

from openjev.contract.literals import PREFIX_POLICIES
from openjev.contract.request import parse_request
from openjev.tokenizer import PromptTokenizer
from openjev.tools.demo_model import build_demo_model
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.model.runner import TorchRunner
from openjev.worker.planner import CPU_COST_MODEL
from openjev.worker.runner_api import SegmentRun

WORDS = (
    "the customer order charge refund account invoice payment service login error delivery "
    "package late damaged team urgent support ticket network outage billing security access "
    "report issue duplicate cancel subscription plan was is not again twice today because"
).split()

CONTRACT_EXAMPLE = json.loads((Path(__file__).resolve().parents[1] / "examples" / "contract_example.json").read_text())


def long_state_request(num_words: int) -> dict:
    rng = random.Random(7)
    state = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return {
        "state": state,
        "questions": {
            "route": {
                "type": "choice",
                "instructions": "Which team should handle this issue?",
                "criteria": {
                    "billing": "Charges, invoices, refunds.",
                    "security": "Unauthorized access.",
                    "technical": "Outages and malfunctions.",
                },
            }
        },
    }


def multi_question_request(num_words: int, num_questions: int) -> dict:
    request = long_state_request(num_words)
    template = CONTRACT_EXAMPLE["questions"]
    kinds = list(template.values())
    request["questions"] = {
        f"q{i}": dict(kinds[i % 3], instructions=f"{kinds[i % 3]['instructions']} ({i})") for i in range(num_questions)
    }
    return request


def to_work(tokenizer: PromptTokenizer, obj: dict) -> list[QuestionWork]:
    compiled = parse_request(obj, accepted_models=())
    return [QuestionWork(q.kind, tuple(map(tuple, tokenizer.encode(q.prompts)))) for q in compiled.questions]


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def bench_case(engine: Engine, name: str, work: list[QuestionWork], repeats: int, temperature: float) -> list[str]:
    arms = list(PREFIX_POLICIES)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    last = {}
    for block in range(repeats + 2):  # two warm-up blocks
        order = arms[block % len(arms) :] + arms[: block % len(arms)]
        for arm in order:
            started = time.perf_counter()
            last[arm] = engine.execute(work, temperature=temperature, policy=arm)
            if block >= 2:
                times[arm].append(time.perf_counter() - started)
    off_ms = statistics.median(times["off"]) * 1e3
    rows = []
    for arm in arms:
        r = last[arm]
        ms = [t * 1e3 for t in times[arm]]
        median = statistics.median(ms)
        rows.append(
            f"| {name} | {arm} | {r.executed_policy} | {median:.1f} "
            f"| {quantile(ms, 0.25):.1f}-{quantile(ms, 0.75):.1f} "
            f"| {off_ms / median:.2f}x | {r.num_computed_tokens} | {r.num_saved_tokens} | {r.num_launches} |"
        )
    return rows


def fit_cost_model(runner: TorchRunner, repeats: int) -> None:
    """Time single launches over (sequences, length, context) and least-squares fit
    seconds = a * launches + b * tokens + c * attention pairs."""
    rng = random.Random(3)
    ids = lambda n: [rng.randrange(200_000) for _ in range(n)]  # noqa: E731
    rows, seconds = [], []
    parents = {}
    for context in (0, 1024, 3072):
        if context:
            [res] = runner.run_launch([SegmentRun(ids(context), 0, None, True, False)])
            parents[context] = res.state
    for num_seqs in (1, 4, 16):
        for length in (8, 32, 128, 512, 2048):
            for context in (0, 1024, 3072):
                if num_seqs * length > 4096:
                    continue
                runs = [SegmentRun(ids(length), context, parents.get(context), False, True) for _ in range(num_seqs)]
                runner.run_launch(runs)  # warm
                samples = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    runner.run_launch(runs)
                    samples.append(time.perf_counter() - started)
                pairs = num_seqs * (length * context + length * (length + 1) // 2)
                rows.append([1.0, num_seqs * length, pairs])
                seconds.append(statistics.median(samples))
    a = np.asarray(rows, dtype=np.float64)
    y = np.asarray(seconds)
    # Relative error is what matters across a 1000x range of launch times: weight rows by 1/y.
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    pred = a @ coef
    print(
        f"fit: seconds_per_launch={coef[0]:.3e} seconds_per_token={coef[1]:.3e} "
        f"seconds_per_attention_pair={coef[2]:.3e}; max relative error {np.max(np.abs(pred - y) / y):.2f} "
        f"over {len(y)} launch shapes"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--fit", action="store_true", help="also fit the CPU cost model")
    args = parser.parse_args()

    model_dir = build_demo_model(args.model_dir, seed=0)
    runner = TorchRunner(model_dir, num_threads=args.threads)
    tokenizer = PromptTokenizer.from_export(model_dir)
    engine = Engine(runner, cost_model=CPU_COST_MODEL)
    cases = [
        ("3 candidates, long shared state", to_work(tokenizer, long_state_request(2950))),
        ("contract example (3/1/3)", to_work(tokenizer, CONTRACT_EXAMPLE)),
        ("8 questions over one state", to_work(tokenizer, multi_question_request(700, 8))),
    ]
    print(
        f"# {datetime.date.today()}  {platform.processor() or platform.machine()}  "
        f"threads={args.threads} repeats={args.repeats}"
    )
    for name, work in cases:
        lengths = [len(c) for q in work for c in q.candidates]
        print(f"# {name}: {len(work)} questions, {len(lengths)} candidates, {min(lengths)}-{max(lengths)} tokens")
    print("| request | policy | executed | median ms | IQR ms | vs off | tokens computed | saved | launches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, work in cases:
        for row in bench_case(engine, name, work, args.repeats, runner.meta.temperature):
            print(row, flush=True)
    if args.fit:
        fit_cost_model(runner, max(3, args.repeats // 3))


if __name__ == "__main__":
    main()

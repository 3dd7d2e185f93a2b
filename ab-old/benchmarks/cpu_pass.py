"""In-process CPU pass timings: the eight requests of benchmarks/concurrency_cpu.py as the
service plans them (a choice request: its candidates' common prefix, then each tail as an
in-pass child; a noul request: one segment), through TorchRunner on one thread. Times one pass
of all eight and the eight alone in turn, alternately, as the thread's CPU time (other jobs on
the cores inflate it less than wall time).

    .venv/bin/python benchmarks/cpu_pass.py [--model .openjev/demo-model] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from concurrency_cpu import requests

from openjev.contract.request import parse_request
from openjev.tokenizer import PromptTokenizer
from openjev.worker.model.runner import TorchRunner
from openjev.worker.runner_api import SegmentRun


def planned(tokenizer: PromptTokenizer, body: dict, first: int) -> list[SegmentRun]:
    """One request's runs; first: the index of its first run in the pass (for in-pass parents)."""
    (question,) = parse_request(body, accepted_models=()).questions
    candidates = tokenizer.encode(question.prompts)
    if len(candidates) == 1:
        return [SegmentRun(tuple(candidates[0]), 0, None, keep_state=False, read_head=True)]
    shared = next(i for i in range(min(map(len, candidates))) if len({c[i] for c in candidates}) > 1)
    prefix = SegmentRun(tuple(candidates[0][:shared]), 0, None, keep_state=False, read_head=False)
    return [prefix] + [
        SegmentRun(tuple(c[shared:]), shared, None, keep_state=False, read_head=True, parent_in_pass=first)
        for c in candidates
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    runner = TorchRunner(args.model, num_threads=1)
    tokenizer = PromptTokenizer.from_export(args.model)
    alone = [planned(tokenizer, body, 0) for body in requests()]
    together: list[SegmentRun] = []
    for body in requests():
        together += planned(tokenizer, body, len(together))
    shared = [r.head_score for r in runner.run_launch(together) if r.head_score is not None]
    assert shared == [r.head_score for runs in alone for r in runner.run_launch(runs) if r.head_score is not None]
    one_pass, in_turn = [], []
    for _ in range(args.repeats):
        started = time.thread_time()
        runner.run_launch(together)
        one_pass.append(time.thread_time() - started)
        started = time.thread_time()
        for runs in alone:
            runner.run_launch(runs)
        in_turn.append(time.thread_time() - started)
    for name, times in (("one pass of all eight", one_pass), ("the eight alone in turn", in_turn)):
        print(f"{name}: median {statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f})")


if __name__ == "__main__":
    main()

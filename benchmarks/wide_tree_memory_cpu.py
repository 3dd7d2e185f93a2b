"""Peak memory of one wide tree on the CPU runner: a choice question of `--candidates` candidates
under a `--state`-token prompt, run once in a fresh process per size (the peak RSS is the
process's), through the engine as the worker runs it. Prints a table: candidates, state tokens,
seconds, peak RSS and its growth over the loaded model.

    python3 benchmarks/wide_tree_memory_cpu.py [--model .openjev/demo-model] [--sizes 128x8000,255x16000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path


def one(model: Path, candidates: int, state_tokens: int) -> dict:
    from openjev.worker.engine import Engine, QuestionWork
    from openjev.worker.model.runner import TorchRunner

    engine = Engine(TorchRunner(model))
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rng = random.Random(0)
    state = [rng.randrange(1000, 5000) for _ in range(state_tokens)]
    work = [QuestionWork("choice", tuple(tuple(state + [1000 + i, 7]) for i in range(candidates)))]
    started = time.perf_counter()
    engine.execute(work, temperature=2.0, policy="shared")
    seconds = time.perf_counter() - started
    engine.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_mb": peak / 1024, "growth_mb": (peak - loaded) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--sizes", default="128x8000,255x16000", help="CANDIDATESxSTATE_TOKENS, comma-separated")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process's single size
    args = parser.parse_args()
    if args.one:
        candidates, state = map(int, args.one.split("x"))
        print(json.dumps(one(args.model, candidates, state)), flush=True)
        os._exit(0)  # an interpreter exit here aborted in torch's teardown once the figures were out
    print("| candidates | state tokens | seconds | peak RSS MB | growth over the loaded model MB |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--model", str(args.model), "--one", size],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        candidates, state = size.split("x")
        print(f"| {candidates} | {state} | {got['seconds']:.1f} | {got['peak_mb']:.0f} | {got['growth_mb']:.0f} |")


if __name__ == "__main__":
    main()

"""One launch of a GDN recurrence variant on 27B shapes (one segment of T tokens, an initial
state; the inputs of kernels_gpu.py), three times, for a profiler to look at:
`ncu --kernel-name regex:gdn_recurrent python3 benchmarks/gdn_probe.py`. With `--request`, a
workload request run three times through the engine on the synthetic 27B runner (graphs)
instead, so the profiler sees the recurrence inside a pass.

    python3 benchmarks/gdn_probe.py [--tokens 4096] [--variant s8c32x2 | --case gdn_chunked_w8]
    python3 benchmarks/gdn_probe.py --request noul:513-2048 --model .openjev/demo-model

The inputs are seeded; `--save PATH` saves the last run's output tensors (torch.save), so that two
builds can be compared bit for bit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from kernels_gpu import cases

from openjev.worker.cuda import kernels as K


def in_pass(spec: str, model: Path) -> None:
    from profile_requests import pick

    from openjev.tools.bench import workload
    from openjev.tools.bench.main import longest_tokens_fn
    from openjev.worker.cuda.runner import CudaRunner
    from openjev.worker.engine import Engine, QuestionWork
    from openjev.worker.planner.cost import default_cost_model

    meta, candidates_of, _ = longest_tokens_fn(model)
    case = pick(workload.read_jsonl(Path(__file__).parent / "workload.jsonl"), *spec.split(":"))
    ids = candidates_of(case.request)
    kinds = [q["type"] for q in case.request["questions"].values()]
    work = [QuestionWork(k, tuple(tuple(t) for t in q)) for k, q in zip(kinds, ids, strict=True)]
    engine = Engine(CudaRunner.synthetic("27b", seed=0, graph_capture_after=1), cost_model=default_cost_model("cuda"))
    for _ in range(3):
        engine.execute(work, temperature=meta.temperature, policy="auto")
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variant", default=K.GDN_DEFAULT)
    p.add_argument("--case", default="", help="any kernels_gpu.py case name instead (e.g. gdn_chunked_w8)")
    p.add_argument("--request", default="", help="kind:group of a workload request (benchmarks/profile_requests.py)")
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--save", type=Path, help="save the last run's outputs here")
    args = p.parse_args()
    if args.request:
        in_pass(args.request, args.model)
        return
    torch.manual_seed(0)
    run = {name: fn for name, fn, *_ in cases(args.tokens)}[args.case or f"gdn_recurrent_{args.variant}"]
    for _ in range(3):  # the first compiles; the profiler looks at every launch it is told to
        result = run()
    torch.cuda.synchronize()
    if args.save:
        tensors = result if isinstance(result, tuple | list) else (result,)
        torch.save([t.cpu() for t in tensors if isinstance(t, torch.Tensor)], args.save)


if __name__ == "__main__":
    main()

"""The worker's memory under requests of the largest size it takes, sent straight to its port,
for the held-token budget (`--max-held-tokens`, default twice `--max-request-tokens`) and without
one (a budget of 2**40 tokens: the worker before the budget).

Each request is 256 choice candidates of 16,384 token ids (4 Mi tokens, the default
`--max-request-tokens`), in 16 messages of 16 candidates. Two scenarios, each on a fresh worker
(a process's peak memory only grows), arms alternating within each block:
- uncommitted: `--streams` Execute streams send all their candidates and never commit; once every
  one has sent everything or been refused, the worker's resident memory is read, then they are
  cancelled;
- planning: `--requests` committed requests at once under policy `off` (planned on their own
  gRPC threads), each cancelled by its deadline (`--deadline` s) while it runs; the worker's peak
  resident memory.

    .venv/bin/python benchmarks/worker_memory.py [--model .openjev/demo-model] [--blocks 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from openjev.tools import launch
from openjev.tools.soak import rss_bytes
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

CANDIDATES, LENGTH, PER_MESSAGE = 256, 16384, 16
ARMS = {"budget": [], "no budget": ["--max-held-tokens", str(1 << 40)]}


def batches() -> list[wire.ExecuteRequest]:
    """One request's candidates (each its own ids: under `off` nothing is shared anyway)."""
    out = []
    for first in range(0, CANDIDATES, PER_MESSAGE):
        candidates = [
            wire.Candidate(
                question_index=0, candidate_index=c, token_ids=[1000 + (c * 7 + i) % 200000 for i in range(LENGTH)]
            )
            for c in range(first, first + PER_MESSAGE)
        ]
        out.append(wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=candidates)))
    return out


HEADER = wire.ExecuteRequest(
    header=wire.ExecuteHeader(
        prefix_policy=api.PREFIX_POLICY_OFF,
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=255)]
        + [wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)],
    )
)


def renumbered(messages: list[wire.ExecuteRequest]) -> list[wire.ExecuteRequest]:
    """The 256 candidates as 255 of a choice question and one noul question (a choice takes 255)."""
    out = []
    for message in messages:
        copy = wire.ExecuteRequest()
        copy.CopyFrom(message)
        for candidate in copy.batch.candidates:
            if candidate.candidate_index == 255:
                candidate.question_index, candidate.candidate_index = 1, 0
        out.append(copy)
    return out


def mib(pid: int, field: str) -> float:
    return rss_bytes(pid, field) / 2**20


def uncommitted(stub, body: list, streams: int):
    """`streams` calls that send everything and wait uncommitted until `release` is set: (codes,
    calls, release, readers) once each has sent everything or ended."""
    release = threading.Event()
    sent = [threading.Event() for _ in range(streams)]
    codes: list[str] = [""] * streams
    calls = []

    def messages(index: int):
        yield HEADER
        yield from body
        sent[index].set()
        release.wait()

    def read(index: int) -> None:
        try:
            list(calls[index])
            codes[index] = "OK"
        except grpc.RpcError as error:
            codes[index] = error.code().name
            sent[index].set()

    readers = []
    for index in range(streams):
        calls.append(stub.Execute(messages(index), timeout=120))
        readers.append(threading.Thread(target=read, args=(index,)))
        readers[-1].start()
    for event in sent:
        event.wait(120)
    time.sleep(2)  # what was sent is read and held (or refused) by now
    return codes, calls, release, readers


def planning(stub, body: list, requests: int, deadline: float) -> list[str]:
    def one(_: int) -> str:
        try:
            list(stub.Execute(iter([HEADER, *body, wire.ExecuteRequest(commit=wire.Commit())]), timeout=deadline))
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(one, range(requests)))


def one_block(model: Path, workdir: Path, arm: str, scenario: str, body: list, args) -> dict:
    worker = launch.start_worker(model, workdir, [*ARMS[arm], "--state-cache-bytes", "0"])
    try:
        pid = worker.popen.pid
        with grpc.insecure_channel(worker.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            before_rss, before_peak = mib(pid, "VmRSS"), mib(pid, "VmHWM")
            if scenario == "uncommitted":
                codes, calls, release, readers = uncommitted(stub, body, args.streams)
                held = mib(pid, "VmRSS") - before_rss
                for call in calls:
                    call.cancel()
                release.set()
                for reader in readers:
                    reader.join(30)
            else:
                codes = planning(stub, body, args.requests, args.deadline)
                held = float("nan")
            return {"codes": codes, "held": held, "peak": mib(pid, "VmHWM") - before_peak}
    finally:
        worker.stop()


def summary(codes: list[str]) -> str:
    return ", ".join(f"{codes.count(c)} {c}" for c in sorted(set(codes)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16, help="uncommitted streams at once")
    parser.add_argument("--requests", type=int, default=4, help="committed requests at once")
    parser.add_argument("--deadline", type=float, default=20.0, help="seconds each committed request may run")
    args = parser.parse_args()
    body = renumbered(batches())
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            for scenario in ("uncommitted", "planning"):
                arms = list(ARMS) if block % 2 == 0 else list(reversed(ARMS))
                for arm in arms:
                    workdir = Path(tmp) / f"{block}-{scenario}-{arm.replace(' ', '-')}"
                    workdir.mkdir()
                    result = one_block(args.model, workdir, arm, scenario, body, args)
                    results.setdefault((scenario, arm), []).append(result)
                    print(
                        f"block {block} {scenario:11} {arm:9}: {summary(result['codes'])}; "
                        f"peak +{result['peak']:.0f} MiB, resident +{result['held']:.0f} MiB",
                        flush=True,
                    )
    print()
    print("peak: growth of the worker's peak resident memory (VmHWM) over its peak after start-up;")
    print("resident: its resident memory while the uncommitted streams wait, over that before them")
    print(f"{'scenario':11} | {'arm':9} | {'calls (in each block)':44} | peak MiB, median [min-max] | resident MiB")
    for (scenario, arm), rows in results.items():
        peaks = [r["peak"] for r in rows]
        each = [summary(r["codes"]) for r in rows]
        calls = each[0] if len(set(each)) == 1 else "; ".join(each)  # one where every block had the same
        peak = f"{statistics.median(peaks):.0f} [{min(peaks):.0f}-{max(peaks):.0f}]"
        resident = f"{statistics.median(r['held'] for r in rows):.0f}" if scenario == "uncommitted" else "-"
        print(f"{scenario:11} | {arm:9} | {calls:44} | {peak:26} | {resident}")


if __name__ == "__main__":
    main()

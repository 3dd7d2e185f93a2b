"""Agent sessions through a real frontend and worker, state cache off and on in the same run.

python -m openjev.tools.bench.agent_sessions --model .openjev/demo-model --out OUT --agents 4 \
    --max-requests 6 --max-state-tokens 1500
(on a GPU) ... --worker-args "--synthetic 27b"

Two frontend + worker pairs: the cache-off worker (`--state-cache-bytes 0`) starts first, then
the cache-on one (`--cache-bytes`, or the worker's default budget, which on a GPU is measured from
the memory left once both have loaded). Per block, the sessions (`sessions.py`) run round-robin
at concurrency 1, each agent's requests in sequence; every step goes to both workers and its
question with no state to the cache-off worker, the three in a fresh random order, so slow drifts
land on all arms. Each block tags its states anew, so its first requests miss. One warm-up block
is left out of the report. After each cache-on request the worker's Prometheus counters give its
hit tokens; after each block, the cache's bytes against its budget. Peak memory at the end: RSS
of each worker (VmHWM) and, on a GPU, the peak device memory from the worker's exit log line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from openjev.tools import launch
from openjev.tools.bench import prepare, sessions, worker_log, workload
from openjev.tools.bench.harness import Arm, _Client

REPO = Path(__file__).resolve().parents[2]
CACHE = "openjev_worker_state_cache_"
COUNTERS = ("hit_tokens", "hits", "inserts", "evictions")  # each a `_total` sample


class CacheWatch:
    """The cache-on worker's state-cache series, read after each of its requests: the hit tokens
    of that request, the largest `bytes` seen, the counters' growth since the watch began."""

    def __init__(self, url: str):
        self.url = url
        self.first = self.last = self._read()
        self.bytes_max = 0.0

    def _read(self) -> dict[str, float]:
        got = scrape(self.url)
        return {name: got.get(f"{CACHE}{name}_total", 0.0) for name in COUNTERS} | {
            "bytes": got.get(f"{CACHE}bytes", 0.0),
            "budget_bytes": got.get(f"{CACHE}budget_bytes", 0.0),
        }

    def after_request(self) -> int:
        now = self._read()
        hit = int(now["hit_tokens"] - self.last["hit_tokens"])
        self.last, self.bytes_max = now, max(self.bytes_max, now["bytes"])
        return hit

    def facts(self) -> dict:
        grown = {name: self.last[name] - self.first[name] for name in COUNTERS}
        return {
            "bytes_max": self.bytes_max,
            "bytes_now": self.last["bytes"],
            "budget_bytes": self.last["budget_bytes"],
        } | grown


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="export directory (tokenizer, metadata)")
    p.add_argument("--workload", type=Path, default=REPO / "benchmarks" / "workload.jsonl")
    p.add_argument("--out", type=Path, required=True, help="results folder (report.md, results.json)")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=4, help="requests per session, at least")
    p.add_argument("--max-requests", type=int, default=8, help="requests per session, at most")
    p.add_argument("--min-state-tokens", type=int, default=500)
    p.add_argument("--max-state-tokens", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=3, help="timed blocks after one warm-up block")
    p.add_argument("--cache-bytes", type=int, default=None, help="the cache-on worker's budget (default: its own)")
    p.add_argument("--worker-args", default="", help="extra flags for both workers, e.g. '--synthetic 27b'")
    p.add_argument("--start-timeout", type=float, default=launch.WORKER_START_SECONDS)
    p.add_argument("--timeout", type=float, default=600.0, help="per request")
    return p


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def peak_rss_bytes(pid: int) -> int | None:
    """The process's resident high-water mark (Linux); None where /proc has no such line."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _commit() -> str:
    # the device machine's copy of the tree may not know its commit: the caller names it
    if os.environ.get("OPENJEV_COMMIT"):
        return os.environ["OPENJEV_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    except OSError:
        return ""
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    worker_args = shlex.split(args.worker_args)
    if any(a.startswith("--state-cache-bytes") for a in worker_args):
        raise SystemExit("set the cache-on worker's budget with --cache-bytes; the other arm is off by definition")
    args.out.mkdir(parents=True, exist_ok=True)
    _meta, _candidates, longest = prepare.longest_tokens_fn(args.model)
    built = sessions.build_sessions(
        workload.read_jsonl(args.workload),
        longest,
        agents=args.agents,
        min_requests=args.min_requests,
        max_requests=args.max_requests,
        min_state_tokens=args.min_state_tokens,
        max_state_tokens=args.max_state_tokens,
        seed=args.seed,
    )
    steps = sessions.interleaved(built)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    say(
        f"{len(built)} sessions, {len(steps)} requests a block; states " + ", ".join(str(s.state_tokens) for s in built)
    )
    workdir = Path(tempfile.mkdtemp(prefix="openjev-sessions-"))
    ports = {"off": launch.free_port(), "on": launch.free_port()}
    flags = {
        "off": ["--state-cache-bytes", "0"],
        "on": [] if args.cache_bytes is None else ["--state-cache-bytes", str(args.cache_bytes)],
    }
    pairs: dict[str, launch.Pair] = {}
    timings: list[sessions.Timing] = []
    run: dict = {"cache": {}, "memory": {}}
    try:
        for name in ("off", "on"):  # off first: on a GPU the on worker's default budget sees both loaded
            pairs[name] = launch.start_pair(
                args.model,
                workdir / name,
                worker_args=[*worker_args, *flags[name], "--metrics-port", str(ports[name])],
                worker_timeout_seconds=args.start_timeout,
            )
            say(f"{name}: worker SERVING after {pairs[name].worker.serving_seconds:.1f} s")
        url = f"http://127.0.0.1:{ports['on']}/metrics"
        clients = {
            "off": _Client(Arm("off", pairs["off"].frontend.address, None)),
            "on": _Client(Arm("on", pairs["on"].frontend.address, None)),
        }
        clients["nostate"] = _Client(Arm("nostate", pairs["off"].frontend.address, None))
        rng = random.Random(args.seed)
        watch = CacheWatch(url)
        for block in range(-1, args.blocks):
            for agent, k in steps:
                session = built[agent]
                texts = {
                    "off": session.request(k, f"{args.seed}-{block}-{agent}"),
                    "nostate": sessions.no_state(session.questions[k]),
                }
                texts["on"] = texts["off"]
                for arm in rng.sample(list(clients), len(clients)):
                    case = workload.Case(f"a{agent}-r{k}", "session", arm, texts[arm])
                    sample = clients[arm].send(case, json.dumps(texts[arm], ensure_ascii=False), block, args.timeout)
                    hit = watch.after_request() if arm == "on" else 0
                    if block >= 0:
                        timings.append(
                            sessions.Timing(arm, block, agent, k, sample.latency_seconds, sample.status, hit)
                        )
            run["cache"] = c = watch.facts()
            save(args, argv, built, len(steps), timings, run)  # a run cut short keeps its blocks
            say(f"block {block}: cache {c['bytes_now'] / 2**20:.1f} MiB of {c['budget_bytes'] / 2**20:.0f}")
        for client in clients.values():
            client.channel.close()
        for name, pair in pairs.items():
            run["memory"][name] = {"rss_peak_bytes": peak_rss_bytes(pair.worker.popen.pid)}
    finally:
        for pair in pairs.values():
            pair.stop()
    for name, pair in pairs.items():
        device = worker_log.exit_stats(pair.worker.log_text()).get("device_bytes")
        run["memory"].setdefault(name, {})["device_peak_bytes"] = device
        run["memory"][name]["serving_seconds"] = pair.worker.serving_seconds
    print(save(args, argv, built, len(steps), timings, run))


def save(args, argv, built, per_block: int, timings: list[sessions.Timing], run: dict) -> str:
    """Writes report.md and results.json under --out; returns the report."""
    summary = sessions.summarize(timings)
    report = sessions.render(summary, _header(args, argv, built, per_block), _memory_lines(run))
    (args.out / "report.md").write_text(report)
    payload = {
        "summary": summary,
        "run": run,
        "sessions": [{"agent": s.agent, "state_tokens": s.state_tokens, "questions": list(s.questions)} for s in built],
        "timings": [t.__dict__ for t in timings],
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=0))
    return report


def _header(args, argv, built, per_block: int) -> list[str]:
    command = " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lengths = ", ".join(f"{s.state_tokens}x{len(s.questions)}" for s in built)
    return [
        f"# Agent sessions {datetime.date.today().isoformat()}",
        "",
        f"- command: `python -m openjev.tools.bench.agent_sessions {command}`",
        f"- machine: {platform.processor() or platform.machine()}; commit {_commit() or 'unknown'}; "
        f"worker flags: `{args.worker_args or '(none)'}`; cache-on budget: "
        + (f"{args.cache_bytes} bytes" if args.cache_bytes is not None else "the worker's default"),
        f"- {len(built)} agents (state tokens x requests: {lengths}), seed {args.seed}; {per_block} session "
        f"requests a block, round-robin at concurrency 1; {args.blocks} timed blocks after one warm-up block; "
        'each step sent to the cache-off and cache-on workers and its question with no state (`"state": ""`) '
        "to the cache-off worker, in a random order",
    ]


def _memory_lines(run: dict) -> list[str]:
    c = run["cache"]
    lines = []
    if c.get("budget_bytes"):
        inside = "inside" if c["bytes_max"] <= c["budget_bytes"] else "OVER"
        lines.append(
            f"Cache (cache-on worker, read after each of its requests): at most {c['bytes_max'] / 2**20:.1f} MiB "
            f"of a {c['budget_bytes'] / 2**20:.0f} MiB budget ({inside} it); warm-up included: "
            f"{c['inserts']:.0f} inserts, {c['evictions']:.0f} evictions, {c['hits']:.0f} requests with a hit."
        )
    for name, m in run["memory"].items():
        parts = []
        if m.get("rss_peak_bytes"):
            parts.append(f"peak RSS {m['rss_peak_bytes'] / 2**30:.2f} GiB")
        if m.get("device_peak_bytes"):
            parts.append(f"peak device memory {m['device_peak_bytes'] / 2**30:.1f} GiB")
        if m.get("serving_seconds"):
            parts.append(f"SERVING after {m['serving_seconds']:.1f} s")
        lines.append(f"- worker, cache {name}: " + (", ".join(parts) or "no memory figure"))
    return lines


if __name__ == "__main__":
    main()

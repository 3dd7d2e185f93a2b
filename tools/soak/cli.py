"""The command line: options into a Hostile mix, the soak's own worker + frontend pair (or a
running frontend with --addr), the run, the report as text and JSON, a nonzero exit on failure."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from openjev.config import fraction
from openjev.frontend.service import DEFAULT_MAX_REQUEST_TOKENS
from openjev.tools.soak.hostile import HOSTILE_PARTS, Hostile, WorkerControl
from openjev.tools.soak.report import failures, format_report
from openjev.tools.soak.run import run_load


def start_soak_pair(model: Path, workdir: Path, hostile: Hostile | None) -> tuple[Any, WorkerControl, dict[str, int]]:
    """The soak's own worker + frontend on loopback: the worker on a fixed port (so it can come
    back on it after a kill), metrics on both, the hostile mix's limits. Returns the pair, the
    worker's control and the metrics ports."""
    from openjev.tools import launch

    metrics = {"frontend": launch.free_port(), "worker": launch.free_port()}
    worker_args = ["--listen", f"127.0.0.1:{launch.free_port()}", "--metrics-port", str(metrics["worker"])]
    frontend_args = ["--metrics-port", str(metrics["frontend"])]
    if hostile is not None:
        worker_args += ["--commit-timeout-seconds", str(hostile.commit_timeout_seconds)]
        frontend_args += [
            "--worker-refresh-seconds",
            "0.5",
            "--worker-deadline-seconds",
            str(max(1.0, hostile.request_bound_seconds - 10)),
            "--max-request-tokens",
            str(hostile.max_request_tokens),
            "--max-rendered-bytes",
            str(hostile.max_rendered_bytes),
        ]
    pair = launch.start_pair(model, workdir, worker_args=worker_args, frontend_args=frontend_args)
    return pair, WorkerControl(model, workdir, worker_args, pair.worker), metrics


def _parser() -> argparse.ArgumentParser:
    from openjev.tools import soak  # the usage text is the package's docstring

    p = argparse.ArgumentParser(prog="python -m openjev.tools.soak", description=soak.__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start a worker + frontend on loopback serving this export")
    where.add_argument("--addr", help="use a running frontend at HOST:PORT instead (no RSS, log check or kills)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2000, help="at most this many requests")
    p.add_argument("--duration", type=float, default=60.0, help="at most this many seconds")
    p.add_argument(
        "--invalid-fraction", type=fraction, default=0.3, help="share of requests the contract refuses, 0 to 1"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hostile",
        default=",".join(HOSTILE_PARTS),
        help="the hostile mix, comma-separated parts of idle,oversized,cancel,kill, or none "
        "(kill and the worker's idle Execute streams need --model)",
    )
    defaults = Hostile()
    p.add_argument("--kills", type=int, default=defaults.kills, help="kill -9 of the worker during the run")
    p.add_argument("--watch-streams", type=int, default=defaults.watch_streams)
    p.add_argument("--reflection-streams", type=int, default=defaults.reflection_streams)
    p.add_argument("--execute-streams", type=int, default=defaults.execute_streams)
    p.add_argument("--commit-timeout-seconds", type=float, default=defaults.commit_timeout_seconds)
    p.add_argument("--max-rendered-bytes", type=int, default=defaults.max_rendered_bytes, help="the frontend's")
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help=f"the frontend's (default: {defaults.max_request_tokens}, what the soak's own pair runs with; "
        "with --addr the frontend's own default)",
    )
    p.add_argument("--request-bound-seconds", type=float, default=defaults.request_bound_seconds)
    p.add_argument("--memory-bound-mib", type=float, default=defaults.memory_bound_mib)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    return p


def _hostile(args: argparse.Namespace) -> Hostile | None:
    """The mix the options ask for (None: --hostile none)."""
    chosen = tuple(x for x in args.hostile.split(",") if x and x != "none")
    if set(chosen) - set(HOSTILE_PARTS):
        raise SystemExit(f"--hostile: unknown part(s) {sorted(set(chosen) - set(HOSTILE_PARTS))}")
    defaults = Hostile()
    tokens_limit = args.max_request_tokens
    if tokens_limit is None:  # the soak's own pair runs with 32768; another frontend with its default
        tokens_limit = DEFAULT_MAX_REQUEST_TOKENS if args.addr else defaults.max_request_tokens
    return (
        Hostile(
            parts=chosen,
            watch_streams=args.watch_streams,
            reflection_streams=args.reflection_streams,
            execute_streams=args.execute_streams,
            commit_timeout_seconds=args.commit_timeout_seconds,
            kills=args.kills,
            max_rendered_bytes=args.max_rendered_bytes,
            max_request_tokens=tokens_limit,
            request_bound_seconds=args.request_bound_seconds,
            memory_bound_mib=args.memory_bound_mib,
        )
        if chosen
        else None
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.duration <= 0:
        raise SystemExit("--clients, --requests and --duration must be positive")
    hostile = _hostile(args)
    kwargs = dict(
        clients=args.clients,
        requests=args.requests,
        duration=args.duration,
        invalid_fraction=args.invalid_fraction,
        seed=args.seed,
        hostile=hostile,
        memory_bound_mib=args.memory_bound_mib,
    )
    if args.addr:
        report = run_load(args.addr, **kwargs)
    else:
        from openjev.tools import launch

        workdir = Path(tempfile.mkdtemp(prefix="openjev-soak-"))
        pair, worker, metrics = start_soak_pair(args.model, workdir, hostile)
        try:
            report = run_load(
                pair.frontend.address,
                pids={"worker": pair.worker.popen.pid, "frontend": pair.frontend.popen.pid},
                frontend_log=pair.frontend.log_path,
                worker=worker,
                metrics_ports=metrics,
                **kwargs,
            )
        finally:
            pair.frontend.stop()
            worker.stop()
            # a worker a kill's restart started after `worker` was read (the run ended, or Ctrl-C,
            # meanwhile): it was left running
            launch.stop_leftovers()
    print(format_report(report))
    print(json.dumps(report.as_dict(), sort_keys=True))
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    problems = failures(report)
    if problems:
        raise SystemExit("soak failed: " + "; ".join(problems))

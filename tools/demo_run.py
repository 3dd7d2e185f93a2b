"""`make run`: start a worker and a frontend, answer one request, print it, stop both."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import grpc

from openjev.client import Client
from openjev.contract.render import dumps_exact
from openjev.tools import launch
from openjev.tools.stop_signals import exit_on_stop_signals


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openjev.tools.demo_run")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--request", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # each server runs in a session of its own, so no signal reaches them: both were left running
    exit_on_stop_signals()
    try:  # before starting anything
        request = args.request.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"error: cannot read request {args.request}: {error}") from None
    workdir = Path(tempfile.mkdtemp(prefix="openjev-run-"))
    print(f"starting worker and frontend (logs in {workdir}) ...", file=sys.stderr)
    pair = launch.start_pair(args.model, workdir)
    try:
        print(
            f"frontend {pair.frontend.address}, worker {pair.worker.address}; request {args.request}:", file=sys.stderr
        )
        with Client(pair.frontend.address) as client:
            try:
                response = client.decide(request, timeout=120)
            except grpc.RpcError as error:  # the servers' answer, as `openjev decide` prints it
                raise SystemExit(f"error: {error.code().name}: {error.details()}") from None
        print(dumps_exact(response, sort_keys=False, indent=1))  # integers of any size, as answered
    finally:
        pair.stop()
        print("stopped worker and frontend", file=sys.stderr)


if __name__ == "__main__":
    main()

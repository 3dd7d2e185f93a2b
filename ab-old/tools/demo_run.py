"""`make run`: start a worker and a frontend, answer one request, print it, stop both."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from openjev.client import Client
from openjev.tools import launch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m openjev.tools.demo_run")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--request", type=Path, required=True)
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="openjev-run-"))
    print(f"starting worker and frontend (logs in {workdir}) ...", file=sys.stderr)
    pair = launch.start_pair(args.model, workdir)
    try:
        print(
            f"frontend {pair.frontend.address}, worker {pair.worker.address}; request {args.request}:", file=sys.stderr
        )
        with Client(pair.frontend.address) as client:
            response = client.decide(args.request.read_text(encoding="utf-8"), timeout=120)
        print(json.dumps(response, indent=1, ensure_ascii=False))
    finally:
        pair.stop()
        print("stopped worker and frontend", file=sys.stderr)


if __name__ == "__main__":
    main()

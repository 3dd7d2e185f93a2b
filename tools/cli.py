"""`openjev`: the command-line client.

  openjev decide REQUEST.json [--addr HOST:PORT] [--tls-ca CA.pem] [--policy P]
                                                                 print the contract response JSON
  openjev tokenize REQUEST.json --model DIR                      print token ids per question and candidate
  openjev bench --model DIR --out DIR [...]                      the benchmark (openjev.tools.bench.main)
Errors print the gRPC status and message and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from openjev.contract.literals import PREFIX_POLICIES
from openjev.contract.render import dumps_exact


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:  # a missing file or a folder: one line, as for a server's refusal
        raise SystemExit(f"error: cannot read {what} {path}: {error.strerror}") from None


def _read(path: str) -> str:
    data = sys.stdin.buffer.read() if path == "-" else _read_file(Path(path), "request")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # what the server answers a body that is not UTF-8 (docs/contract.md)
        raise SystemExit("error: INVALID_ARGUMENT: request body must be valid JSON") from None


def cmd_decide(args) -> int:
    from openjev.client import Client

    credentials = None
    if args.tls_ca is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=_read_file(args.tls_ca, "CA"))
    with Client(args.addr, credentials) as client:
        try:
            response = client.decide(_read(args.request), policy=args.policy, timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print(dumps_exact(response, sort_keys=False, indent=1))
    return 0


def cmd_tokenize(args) -> int:
    from openjev.contract.errors import ContractError
    from openjev.contract.request import parse_request_json
    from openjev.export import load_export_meta_or_exit
    from openjev.frontend.batches import iter_candidate_batches
    from openjev.tokenizer import PromptTokenizer

    meta = load_export_meta_or_exit(args.model, "openjev tokenize")
    try:
        request = parse_request_json(_read(args.request), accepted_models=meta.accepted_model_names)
        ids: list[list[list[int] | None]] = [[None] * len(q.prompts) for q in request.questions]
        tokenizer = PromptTokenizer.from_export(args.model)
        for batch in iter_candidate_batches(request, tokenizer, meta.max_length):
            for c in batch:
                ids[c.question_index][c.candidate_index] = list(c.token_ids)
    except ContractError as error:
        print(f"error: INVALID_ARGUMENT: {error.message}", file=sys.stderr)
        return 1
    print(json.dumps(ids))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openjev", description="Open-Jev decision service client")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", help="send a contract request JSON, print the response JSON")
    d.add_argument("request", help="request JSON file ('-' for stdin)")
    d.add_argument("--addr", default="127.0.0.1:50051", help="frontend address")
    d.add_argument("--tls-ca", type=Path, default=None, help="TLS, trusting this CA (PEM); default plaintext")
    d.add_argument("--policy", choices=PREFIX_POLICIES, default=None, help="prefix policy for this request")
    d.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    d.set_defaults(func=cmd_decide)
    t = sub.add_parser("tokenize", help="print the token ids of a request's candidate prompts")
    t.add_argument("request", help="request JSON file ('-' for stdin)")
    t.add_argument("--model", required=True, type=Path, help="Open-Jev export directory")
    t.set_defaults(func=cmd_tokenize)
    sub.add_parser("bench", help="run the benchmark (see `openjev bench --help`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag its own (argparse's REMAINDER refuses ones before a positional)
        from openjev.tools.bench.main import main as bench

        bench(argv[1:])
        sys.exit(0)
    args = parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()

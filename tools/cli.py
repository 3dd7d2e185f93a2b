"""`openjev`: the command-line client.

  openjev decide REQUEST.json [--addr HOST:PORT] [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem]
                 [--tls-server-name NAME]] [--token-file FILE] [--policy P] [--timeout SECONDS]
                                                                 print the contract response JSON
  openjev tokenize REQUEST.json --model DIR                      print token ids per question and candidate
  openjev bench --model DIR --out DIR [...]                      the benchmark (openjev.tools.bench.main)
Errors print the gRPC status and message and exit non-zero.

`decide` sends a bearer token (`authorization: Bearer <token>`, for a frontend with
`--auth-token-file` or `OPENJEV_AUTH_TOKENS`) read from `--token-file` (its first line that is not
blank or a `#` comment) or else from the `OPENJEV_TOKEN` variable; never from a flag's value,
which would show in the process list. `--tls-cert`/`--tls-key` present a client certificate to a
frontend that requires one (`--tls-client-ca`); `--tls-server-name` names the frontend's
certificate when it does not name the address dialled (a certificate for a Service's DNS name,
called by IP).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from openjev import logs

logs.quiet_grpc_core()  # before grpc's first import: its variable is read then (one line a failed handshake)

import grpc

from openjev import security
from openjev.client import MAX_DEADLINE_SECONDS
from openjev.config import dial_address
from openjev.contract.literals import PREFIX_POLICIES
from openjev.contract.render import dumps_exact
from openjev.interceptors import REQUEST_ID_KEY, valid_request_id

TOKEN_ENV = "OPENJEV_TOKEN"
MAX_TIMEOUT_SECONDS = MAX_DEADLINE_SECONDS  # a larger --timeout would fail at once (client.py)


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:  # a missing file or a folder: one line, as for a server's refusal
        raise SystemExit(f"error: cannot read {what} {path}: {error.strerror}") from None


def _read(path: str) -> str:
    if path == "-" and sys.stdin is None:  # started with stdin closed
        raise SystemExit("error: no standard input to read the request from")
    data = sys.stdin.buffer.read() if path == "-" else _read_file(Path(path), "request")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # what the server answers a body that is not UTF-8 (docs/contract.md)
        raise SystemExit("error: INVALID_ARGUMENT: request body must be valid JSON") from None


def _seconds(text: str) -> float:
    """--timeout: a positive finite number of seconds (inf, nan, 0, negatives and overflows such
    as 1e309 would each fail at once with a misleading DEADLINE_EXCEEDED)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_SECONDS):
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number of seconds up to {MAX_TIMEOUT_SECONDS:.0f}, not {text!r}"
        )
    return value


def _token(args) -> str | None:
    """The bearer token: the first token of --token-file (read as the frontend reads its
    --auth-token-file: blank lines and # comments skipped), else $OPENJEV_TOKEN (empty: unset),
    else none. No error shows the token."""
    if args.token_file is None:
        token = os.environ.get(TOKEN_ENV, "").strip() or None
        source = f"${TOKEN_ENV}"
    else:
        from openjev.security import SecurityError, load_tokens

        source = f"auth token file {args.token_file}"
        try:
            token = load_tokens(args.token_file, environ={})[0].decode("utf-8")
        except SecurityError as error:  # unreadable, empty, or only comments
            raise SystemExit(f"error: {error}") from None
    from openjev.client import sendable_token

    if token is not None and not sendable_token(token):
        raise SystemExit(f"error: the token of {source} is not printable ASCII (gRPC metadata cannot carry it)")
    return token


def cmd_decide(args) -> int:
    from openjev.client import Client

    credentials, options = security.client_tls(args, args.usage_error, _read_file)
    with Client(args.addr, credentials, token=_token(args), options=options) as client:
        try:
            response = client.decide(_read(args.request), policy=args.policy, timeout=args.timeout)
        except grpc.RpcError as error:
            # the id the frontend gave the call, which its log lines carry: what to quote to its operator
            given = dict(error.trailing_metadata() or ()).get(REQUEST_ID_KEY)
            known = f" (request id {given})" if isinstance(given, str) and valid_request_id(given) else ""
            print(f"error: {error.code().name}: {error.details()}{known}", file=sys.stderr)
            return 1
    _write(dumps_exact(response, sort_keys=False, indent=1))
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
    _write(json.dumps(ids))
    return 0


def _write(text: str) -> None:
    """UTF-8 whatever the terminal's encoding, as the input is read (print() encoded with the
    locale's and lost a computed answer to UnicodeEncodeError). An output that cannot be written
    (a full disk, a closed stdout) is one error line, not a traceback."""
    if sys.stdout is None:
        raise SystemExit("error: cannot write the output: standard output is closed")
    try:
        sys.stdout.buffer.write((text + "\n").encode("utf-8"))
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as error:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would fail again
        raise SystemExit(f"error: cannot write the output: {error.strerror or error}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openjev", description="Open-Jev decision service client")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", help="send a contract request JSON, print the response JSON")
    d.add_argument("request", help="request JSON file ('-' for stdin)")
    d.add_argument("--addr", type=dial_address, default="127.0.0.1:50051", help="frontend address (HOST:PORT)")
    security.add_client_tls_arguments(d, "frontend")
    d.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"bearer token: the file's first line that is not blank or a # comment (default: ${TOKEN_ENV})",
    )
    d.add_argument("--policy", choices=PREFIX_POLICIES, default=None, help="prefix policy for this request")
    d.add_argument(
        "--timeout", type=_seconds, default=60.0, metavar="SECONDS", help="deadline (positive, finite; default 60)"
    )
    d.set_defaults(func=cmd_decide, usage_error=d.error)
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
    try:
        code = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: the call is cancelled with the process; no traceback
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    sys.exit(code)


if __name__ == "__main__":
    main()

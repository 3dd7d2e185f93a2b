"""Flags with environment-variable equivalents, printed once at start.

Every long flag `--some-flag` of a server can also be set as `OPENJEV_SOME_FLAG` (set empty: as
if unset; an on/off flag takes 1/0, true/false, yes/no or on/off); the flag wins, also over a
variable with a bad value.
A bad value, from a flag or the environment, ends the program with one line naming it (exit
status 2), never a traceback; `positive_int` and friends are the value checks the flags share.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from openjev import logs


def env_name(dest: str) -> str:
    return "OPENJEV_" + dest.upper()


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr: `prog: error: message`."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _number(kind, text: str, ok, wanted: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not ok(value) or value != value:  # value != value: NaN
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def message_bytes(text: str) -> int:
    """A gRPC message size limit: gRPC's channel options are 32-bit (2**31 ended the start in a
    traceback from inside gRPC)."""
    return _number(int, text, lambda v: 1 <= v <= 2**31 - 1, "an integer from 1 to 2147483647")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < float("inf"), "a number > 0")


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def fraction(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def port_number(text: str) -> int:
    return _number(int, text, lambda v: 0 <= v <= 65535, "a port number 0..65535")


def with_port(text: str, lowest: int) -> str:
    """The host of SOMETHING:PORT with a port in lowest..65535 (the host unchecked)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not lowest <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port {lowest}..65535, got {text!r}")
    return host


def host_port(text: str, lowest: int = 0) -> str:
    """HOST:PORT ([IPv6]:PORT too) with a port in lowest..65535; gRPC would take a port past it
    modulo 65536 and a missing one as 443, and serve or dial there without a word."""
    host = with_port(text, lowest)
    # a URL's scheme or a bare IPv6 address passed, and every call failed UNAVAILABLE
    # ("Misformatted domain name") instead of a usage error
    if "/" in host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (no scheme; an IPv6 address in brackets, [::1]:PORT), got {text!r}"
        )
    return text


def new_file(text: str) -> Path:
    """A file to write later (--port-file): its folder must exist now, so a typo fails at start,
    not after the model has loaded."""
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent} is not a folder")
    return path


def otlp_endpoint(text: str) -> str:
    """http(s)://HOST:PORT or empty (off): the exporter takes anything and exports nothing to a
    malformed one, without a word."""
    if text:
        scheme, sep, rest = text.partition("://")
        if "@" in rest:  # user:password@ would be written to the log with the config line
            raise argparse.ArgumentTypeError(
                "credentials in the URL are not taken (the config line logs it); "
                "give them to the exporter as OTEL_EXPORTER_OTLP_HEADERS"
            )
        try:
            if scheme not in ("http", "https") or not sep:
                raise argparse.ArgumentTypeError(scheme)
            dial_address(rest.rstrip("/"))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected http://HOST:PORT or https://HOST:PORT, got {text!r}") from None
    return text


def dial_address(text: str) -> str:
    """HOST:PORT to connect to (port 1..65535)."""
    return host_port(text, lowest=1)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


ON_WORDS, OFF_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class _BadVariable:
    """An action's default while its variable's value is bad: refused unless the flag is given."""

    def __init__(self, message: str):
        self.message = message

    def __str__(self) -> str:  # what --help prints as its default (it exits before the refusal)
        return f"<{self.message}>"


def _from_env(action: argparse.Action, value: str):
    """The variable's value as the action's default; ValueError naming what was expected."""
    if isinstance(action, argparse._StoreTrueAction):  # an on/off flag: anything else is a mistake
        word = value.strip().lower()
        if word not in ON_WORDS + OFF_WORDS:
            raise ValueError(f"expected one of {', '.join(ON_WORDS + OFF_WORDS)}, got {value!r}")
        return word in ON_WORDS
    try:
        converted = action.type(value) if callable(action.type) else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
        raise ValueError(str(error)) from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def parse_with_env(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, each defaulting to its OPENJEV_* variable. A bad variable is refused (one line,
    exit 2) only where its flag is not given: the flag wins, as over a good one."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = env_name(action.dest)
        value = os.environ.get(name)
        if not value or value.isspace():  # unset, or set empty (how a deployment blanks an inherited value)
            continue
        try:
            action.default = _from_env(action, value)
        except ValueError as error:
            action.default = _BadVariable(f"environment variable {name}: {error}")
        action.required = False
    args = parser.parse_args(argv)
    for value in vars(args).values():
        if isinstance(value, _BadVariable):  # its flag was not given
            parser.error(value.message)
    return args


# A flag whose name has one of these words is logged as "<redacted>": today only paths (the TLS
# keys', the token file's), no secret themselves, but a future credential flag is covered without
# anyone remembering this function.
SECRET_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials", "key", "apikey"}


def is_secret(dest: str) -> bool:
    return bool(SECRET_WORDS & set(dest.lower().split("_")))


def log_config(name: str, args: argparse.Namespace) -> None:
    logs.get(name).info(
        "config",
        **{
            k: "<redacted>" if is_secret(k) and v is not None else str(v) if isinstance(v, Path) else v
            for k, v in sorted(vars(args).items())
        },
    )


def add_server_flags(p: argparse.ArgumentParser, *, client: str, watch_streams: int = 32) -> None:
    """The flags both servers take: call caps of the idle-prone kinds, shutdown, port file,
    metrics, TLS (or --plaintext, asked for), tracing, logging. client: who connects (named in the help);
    watch_streams: the default cap of health Watch streams."""
    p.add_argument(
        "--max-watch-streams", type=positive_int, default=watch_streams, help="concurrent health Watch streams"
    )
    p.add_argument("--max-reflection-streams", type=positive_int, default=8, help="concurrent reflection streams")
    p.add_argument("--grace-seconds", type=non_negative_float, default=10.0, help="drain time on SIGTERM")
    p.add_argument(
        "--port-file", type=new_file, default=None, help="write the bound port here once serving (for --listen HOST:0)"
    )
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        help="serve Prometheus metrics at http://LISTEN_HOST:PORT/metrics (0: off)",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate of this server's port (TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", type=Path, default=None, help=f"require {client} certificates signed by this CA (mTLS)"
    )
    p.add_argument(
        "--plaintext",
        action="store_true",
        help="allow plaintext where no certificate is given (a warning is logged); without it a server "
        "given no certificate refuses to start",
    )
    p.add_argument(
        "--otlp-endpoint",
        type=otlp_endpoint,
        default="",
        help="export OpenTelemetry traces over OTLP/gRPC, e.g. http://HOST:4317 (empty: off)",
    )
    p.add_argument("--log-level", type=log_level, default="info", help=f"one of {', '.join(LOG_LEVELS)}")

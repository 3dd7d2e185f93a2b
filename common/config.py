"""Flags with environment-variable equivalents, printed once at start.

Every long flag `--some-flag` of a server can also be set as `OPENJEV_SOME_FLAG`; the flag wins.
A bad value, from a flag or the environment, ends the program with one line naming it (exit
status 2), never a traceback; `positive_int` and friends are the value checks the flags share.
"""

from __future__ import annotations

import argparse
import os
import sys

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


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: 0 < v < float("inf"), "a number > 0")


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def port_number(text: str) -> int:
    return _number(int, text, lambda v: 0 <= v <= 65535, "a port number 0..65535")


def parse_with_env(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = env_name(action.dest)
        value = os.environ.get(name)
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
            continue
        try:
            action.default = action.type(value) if callable(action.type) else value
        except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
            parser.error(f"environment variable {name}: {error}")
        if action.choices is not None and action.default not in action.choices:
            parser.error(f"environment variable {name}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        action.required = False
    return parser.parse_args(argv)


# A flag whose name has one of these words is logged as "<redacted>" (none today; a future
# credential flag is covered without anyone remembering this function).
SECRET_WORDS = {"secret", "password", "passwd", "token", "credential", "credentials", "key", "apikey"}


def is_secret(dest: str) -> bool:
    return bool(SECRET_WORDS & set(dest.lower().split("_")))


def log_config(name: str, args: argparse.Namespace) -> None:
    logs.get(name).info(
        "config", **{k: "<redacted>" if is_secret(k) and v is not None else v for k, v in sorted(vars(args).items())}
    )

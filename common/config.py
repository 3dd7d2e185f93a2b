"""Flags with environment-variable equivalents, printed once at start.

Every long flag `--some-flag` of a server can also be set as `OPENJEV_SOME_FLAG`; the flag wins.
"""

from __future__ import annotations

import argparse
import os

from openjev import logs


def env_name(dest: str) -> str:
    return "OPENJEV_" + dest.upper()


def parse_with_env(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(env_name(action.dest))
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            action.default = action.type(value) if callable(action.type) else value
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

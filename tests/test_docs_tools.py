"""docs/tools.md's tables match the tools' parsers: each section's table names exactly the
parser's long options and positional arguments, marks the required ones required, gives the
parser's default where it gives one value in backticks (or says none, empty or off), and names
every choice the parser has."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from openjev import healthcheck
from openjev.tools import cli, compose_overrides, compose_test, demo_model, demo_run
from openjev.tools.bench import agent_sessions, gates, graphs
from openjev.tools.bench import main as bench_main
from openjev.tools.soak import cli as soak_cli
from openjev.worker.cuda import offline_compile

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "docs" / "tools.md"


def _subcommand(name: str) -> Callable[[], argparse.ArgumentParser]:
    def make() -> argparse.ArgumentParser:
        sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[name]

    return make


# The first code span of a section's heading -> the function that builds its tool's parser.
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "openjev decide": _subcommand("decide"),
    "openjev tokenize": _subcommand("tokenize"),
    "python -m openjev.tools.demo_model": demo_model.parser,
    "python -m openjev.tools.demo_run": demo_run.parser,
    "openjev bench": bench_main.parser,
    "python -m openjev.tools.bench.gates": gates.parser,
    "python -m openjev.tools.bench.agent_sessions": agent_sessions.parser,
    "PYTHONPATH=. python3 -m openjev.tools.bench.graphs": graphs.parser,
    "python -m openjev.tools.soak": soak_cli._parser,
    "python -m openjev.healthcheck": healthcheck.parser,
    "python -m openjev.tools.compose_test": compose_test.parser,
    "python -m openjev.tools.compose_overrides": compose_overrides.parser,
    "python -m openjev.worker.cuda.offline_compile": offline_compile.parser,
}
# Variables some parsers take a default from when they are built.
ENV_DEFAULTS = ("OPENJEV_BASE_IMAGE", "OPENJEV_COMPOSE_GPU_IMAGE")


def sections() -> dict[str, list[tuple[str, str, str]]]:
    """Heading's first code span -> (flag cell, default cell, meaning cell) of each table row
    whose first cell starts with a backticked name."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    rows: list[tuple[str, str, str]] | None = None
    for line in TOOLS.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"## .*?`([^`]+)`", line)
        if heading:
            rows = found.setdefault(heading.group(1), [])
        elif rows is not None and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append((cells[0], cells[1], cells[2]))
    return found


SECTIONS = sections()


def names(flag_cell: str) -> list[str]:
    """The backticked names of a flag cell: `--exact`, `--no-exact` -> both; `request` -> request."""
    return re.findall(r"`([^`\s]+)`", flag_cell)


def tabled(action: argparse.Action) -> bool:
    return not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))


def keys(action: argparse.Action) -> list[str]:
    """What a table row names an action by: its long options, or a positional's dest."""
    if not action.option_strings:
        return [action.dest]
    return [o for o in action.option_strings if o.startswith("--")]


def by_name(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {key: a for a in parser._actions if tabled(a) for key in keys(a)}


@pytest.fixture
def build(monkeypatch):
    for name in ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    return lambda section: PARSERS[section]()


def test_every_tool_has_a_table():
    assert set(SECTIONS) == set(PARSERS), "sections of docs/tools.md and the parsers listed here differ"
    for section, rows in SECTIONS.items():
        assert rows, f"{section}: no table rows"


@pytest.mark.parametrize("section", list(PARSERS))
def test_the_table_lists_every_flag_and_no_other(section, build):
    listed = [name for flags, _, _ in SECTIONS[section] for name in names(flags)]
    assert len(listed) == len(set(listed)), f"{section}: a flag listed twice"
    actual = set(by_name(build(section)))
    assert set(listed) - actual == set(), f"{section}: documented, not in the parser"
    assert actual - set(listed) == set(), f"{section}: in the parser, not documented"


def parser_default(action: argparse.Action) -> str:
    """The parser's default as the table writes it: a path under the repository relative to it."""
    actual = action.default
    if isinstance(actual, Path) and actual.is_absolute() and actual.is_relative_to(REPO):
        actual = actual.relative_to(REPO)
    return str(actual)


ROWS = [(section, row) for section, rows in SECTIONS.items() for row in rows]


@pytest.mark.parametrize("section, row", ROWS, ids=[f"{s.split()[-1]}:{names(r[0])[0]}" for s, r in ROWS])
def test_documented_default_matches_the_parser(section, row, build):
    flags, default, meaning = row
    parser = by_name(build(section))
    for name in names(flags):
        action = parser.get(name)
        if action is None:
            continue  # test_the_table_lists_every_flag_and_no_other says so
        assert (default == "required") == bool(action.required), f"{section} {name}: required is {action.required}"
        one = re.fullmatch(r"`([^`]+)`(?: \(.*\))?", default)
        word = re.match(r"(none|empty|off)\b", default)
        if one:
            literal, actual = one.group(1), action.default
            assert actual is not None, f"{section} {name}: documented {literal}, no default"
            if isinstance(actual, (int, float)) and not isinstance(actual, bool):
                assert float(literal) == float(actual), f"{section} {name}: {literal} vs {actual}"
            else:
                assert literal == parser_default(action), f"{section} {name}: {literal} vs {actual}"
        elif word and word.group(1) == "none":
            assert action.default is None, f"{section} {name}: documented none, default {action.default!r}"
        elif word and word.group(1) == "empty":
            assert action.default == "", f"{section} {name}: documented empty, default {action.default!r}"
        elif word and word.group(1) == "off":  # a switch: not given is not its value when given
            assert action.nargs == 0 and action.default != action.const, f"{section} {name}: not a switch off"
        for choice in action.choices or ():
            assert f"`{choice}`" in meaning, f"{section} {name}: choice {choice!r} not named"

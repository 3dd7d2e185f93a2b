"""docs/deploy.md's table of the flags operators set matches the servers' parsers: every flag it
names exists on the server(s) it names, with the default it gives (where it gives one value) and
the choices it lists (where the parser has choices)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from openjev.frontend import main as frontend_main
from openjev.worker import main as worker_main

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
PARSERS = {"frontend": frontend_main.parser(), "worker": worker_main.parser()}


def table_rows() -> list[tuple[str, str, str]]:
    """(flag cell, server, default cell) of each row of the table after "The ones operators set"."""
    text = DEPLOY.read_text(encoding="utf-8")
    start = text.index("The ones operators set")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells[0].startswith("`--"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def actions(server: str) -> dict[str, argparse.Action]:
    return {option: a for a in PARSERS[server]._actions for option in a.option_strings}


ROWS = table_rows()
# Rows whose default cell is prose: the parser's default each stands for, per server (None: the
# value is derived at start-up, from the flags named in the cell or the machine).
PROSE_DEFAULTS = {
    "--model": {"frontend": None, "worker": None},  # (required)
    "--listen": {"frontend": "127.0.0.1:50051", "worker": "127.0.0.1:50052"},
    "--max-message-bytes": {"frontend": 64 * 2**20},
    "--shared-launch-tokens": {"worker": None},
    "--max-held-tokens": {"worker": None},
    "--state-cache-bytes": {"worker": None},
    "--threads": {"worker": None},
}


def test_the_table_is_found():
    assert len(ROWS) >= 20, ROWS


@pytest.mark.parametrize("flags, server, default", ROWS, ids=[r[0].split("`")[1].split()[0] for r in ROWS])
def test_documented_flag_matches_the_parser(flags, server, default):
    servers = ["frontend", "worker"] if server == "both" else [server]
    for name in re.findall(r"`(--[a-z-]+)", flags):
        for s in servers:
            action = actions(s).get(name)
            assert action is not None, f"{name}: docs/deploy.md says {server}, the {s} has no such flag"
            listed = re.search(r"`--[a-z-]+ ([a-z0-9]+(?:\\\|[a-z0-9]+)+)`", flags)
            if listed and action.choices is not None:
                assert set(listed.group(1).split("\\|")) == set(action.choices), name
            one = re.fullmatch(r"`([^`]+)`(?: \([a-z ]+\))?", default)
            if one and one.group(1).startswith("--"):  # another flag's value: None in the parser
                assert action.default is None and one.group(1) in actions(s), f"{name}: defaults to {one.group(1)}"
            elif one:
                documented, actual = one.group(1), action.default
                assert actual is not None, f"{name} on the {s}: documented {documented}, no default"
                if isinstance(actual, (int, float)) and not isinstance(actual, bool):
                    assert float(documented) == float(actual), f"{name} on the {s}: {documented} vs {actual}"
                else:
                    assert documented == str(actual), f"{name} on the {s}: {documented} vs {actual}"
            elif default in ("none", "empty (off)", "off"):
                assert action.default in (None, "", False, 0), (
                    f"{name}: documented {default}, default {action.default!r}"
                )
            else:  # a default no pattern above reads is compared through PROSE_DEFAULTS, never skipped
                assert s in PROSE_DEFAULTS.get(name, {}), f"{name} on the {s}: {default!r} checked nowhere"
                assert action.default == PROSE_DEFAULTS[name][s], f"{name} on the {s}: {action.default!r}"

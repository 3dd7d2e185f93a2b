"""Copies of the demo export for tests: its files with the weights linked (a case changes what it
tests), or under other metadata (another model id, revision or temperature), with the same
tokenizer and weights: a worker of another model for tests of what a frontend refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def copied_export(demo_model: Path, into: Path) -> Path:
    """The demo export's small files copied to `into`, its weights linked (a case that changes
    them replaces the link)."""
    shutil.copytree(demo_model, into, ignore=shutil.ignore_patterns("model.safetensors", ".*"))
    (into / "model.safetensors").symlink_to(demo_model / "model.safetensors")
    return into


def other_export(demo_model: Path, into: Path, **fields) -> Path:
    """A copy of the export at `into` (its files linked) whose open_jev_export.json has `fields`."""
    into.mkdir()
    for item in demo_model.iterdir():
        if item.name != "open_jev_export.json":
            (into / item.name).symlink_to(item.resolve())
    export = json.loads((demo_model / "open_jev_export.json").read_text())
    export.update(fields)
    (into / "open_jev_export.json").write_text(json.dumps(export))
    return into

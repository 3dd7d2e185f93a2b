"""The demo export under other metadata (another model id, revision or temperature), with the
same tokenizer and weights: a worker of another model for tests of what a frontend refuses."""

from __future__ import annotations

import json
from pathlib import Path


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

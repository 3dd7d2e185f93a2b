"""The trained head's score computed straight from an export's files, for tests that check the
served score: read open_jev_export.json with `json`, a plain Python dot product plus the bias.
Nothing here goes through openjev's export loader or its ops, so a loader that misreads the head
(its order, its bias) cannot agree with itself."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

META_FILE = "open_jev_export.json"


def export_json(directory: Path) -> dict:
    """The export's metadata as written on disk."""
    return json.loads((Path(directory) / META_FILE).read_text())


def reference_head_score(directory: Path, hidden: Iterable[float]) -> float:
    """hidden (the last token's final-normed state, any sequence of numbers, e.g. a 1-D tensor)
    . head_weight + head_bias, both as the export's json holds them, summed exactly in float64."""
    meta = export_json(directory)
    weight = [float(w) for w in meta["head_weight"]]
    values = [float(h) for h in hidden]
    assert len(values) == len(weight), f"hidden has {len(values)} entries, the head {len(weight)}"
    return math.fsum(h * w for h, w in zip(values, weight, strict=True)) + float(meta["head_bias"])

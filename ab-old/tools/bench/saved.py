"""results.json: written after every block so that a run cut short keeps what it measured, and
rendered back into report.md and its plot (also for a run cut short, or to leave out early blocks)."""

from __future__ import annotations

import json
from pathlib import Path

from openjev.tools.bench import harness, report, report_load
from openjev.tools.bench.workload import Case


def write(out: Path, results: harness.Results, run: dict) -> None:
    """run: what the run knows besides its samples (header, tokens, floors, ceilings, start-up, ...)."""
    payload = {
        "samples": [s.__dict__ for s in results.samples],
        "sweep": results.sweep,
        "first_seen": [s.__dict__ for s in results.first_seen],
        "mixed": results.mixed,
        **run,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=0))


def load(out: Path) -> tuple[dict, harness.Results]:
    saved = json.loads((out / "results.json").read_text())
    results = harness.Results(
        [harness.Sample(**s) for s in saved["samples"]],
        saved.get("sweep", []),
        [harness.Sample(**s) for s in saved.get("first_seen", [])],
        saved.get("mixed", []),
    )
    return saved, results


def render_saved(out: Path, cases: list[Case], from_block: int = 0, name: str = "report") -> str:
    """NAME.md and its latency plot from out/results.json; timed blocks before from_block (0-based)
    are left out of the concurrency-1 tables."""
    saved, results = load(out)
    results.samples = [s for s in results.samples if s.block < 0 or s.block >= from_block]
    arms = list(dict.fromkeys(s.arm for s in results.samples))
    names = {s.case for s in results.samples}
    cases = [c for c in cases if c.name in names]
    reference = "ours-auto" if "ours-auto" in arms else (arms[0] if arms else "ours-auto")
    header = saved["header"] + (
        f"\n- this report leaves out the first {from_block} timed block(s)" if from_block else ""
    )
    sections, more = report_load.sections(saved, results)
    text = report.render(
        results,
        cases,
        arms,
        reference_arm=reference,
        floors=saved.get("floors"),
        tokens={k: tuple(v) for k, v in saved["tokens"].items()},
        header=header,
        more_targets=more,
        sections=sections,
    )
    (out / f"{name}.md").write_text(text)
    if arms:
        report.plot(
            results, cases, arms, out / (f"latency-from-block{from_block}.png" if from_block else "latency.png")
        )
    return text

"""results.json: written after every block so that a run cut short keeps what it measured, and
rendered back into report.md and its plot (also for a run cut short, or to leave out early blocks)."""

from __future__ import annotations

import json
from pathlib import Path

from openjev.tools.bench import harness, report, report_load, roofline
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


def render_saved(
    out: Path,
    cases: list[Case],
    from_block: int = 0,
    name: str = "report",
    ceilings: roofline.Ceilings | None = None,
    config=None,
) -> str:
    """NAME.md and its latency plot from out/results.json; timed blocks before from_block (0-based)
    are left out of the concurrency-1 tables. ceilings: floors and shares of the ceiling at these
    instead of the run's own for the model shape `config` (runs compared at one ceiling: a card's
    measured ceiling moves between runs, and every ratio to the floor with it)."""
    saved, results = load(out)
    if ceilings:
        saved = at_ceilings(saved, ceilings, config)
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


def at_ceilings(saved: dict, ceilings: roofline.Ceilings, config) -> dict:
    """saved with its floors recomputed at other ceilings for the model shape `config`, and a
    header line saying so. The run's own floors are recomputed first: a different shape (another
    --worker-args than the run's) would not give them back, and is refused."""
    measured = saved.get("ceilings") or {}
    if not measured or not saved.get("floors"):
        raise ValueError("this run measured no ceilings (no GPU): nothing to re-render")
    own = roofline.Ceilings(measured["copy_bytes_per_second"], measured["matmul_flops_per_second"], "")
    computed = {name: t[1] for name, t in saved["tokens"].items()}
    for name, t in computed.items():
        if abs(roofline.floor_seconds(config, t, own) / saved["floors"][name] - 1) > 1e-9:
            raise ValueError(f"{name}: the run's floor does not follow from this model shape (pass its --worker-args)")
    floors = {name: roofline.floor_seconds(config, t, ceilings) for name, t in computed.items()}
    note = (
        f"\n- re-rendered at ceilings copy {ceilings.copy_bytes_per_second / 1e12:.2f} TB/s, bf16 GEMM "
        f"{ceilings.matmul_flops_per_second / 1e12:.0f} TFLOP/s (the run measured "
        f"{own.copy_bytes_per_second / 1e12:.2f} TB/s, {own.matmul_flops_per_second / 1e12:.0f} TFLOP/s)"
    )
    return saved | {"floors": floors, "ceilings": {**measured, **ceilings.__dict__}, "header": saved["header"] + note}

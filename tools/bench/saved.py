"""results.json: written after every block so that a run cut short keeps what it measured, and
rendered back into report.md and its plot (also for a run cut short, or to leave out early blocks)."""

from __future__ import annotations

import json
from pathlib import Path

from openjev.tools.bench import harness, prepare, report, report_load, roofline
from openjev.tools.bench.estimate import Split
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
    candidates_of,
    from_block: int = 0,
    name: str = "report",
    ceilings: roofline.Ceilings | None = None,
    config=None,
) -> str:
    """NAME.md and its latency plot from out/results.json; cases: the whole workload, whose split
    the estimate covers (candidates_of: the tokenizer of --model, prepare.longest_tokens_fn's);
    timed blocks before from_block (0-based) are left out of the concurrency-1 tables. ceilings:
    floors and shares of the ceiling at these instead of the run's own for the model shape
    `config` (runs compared at one ceiling: a card's measured ceiling moves between runs, and
    every ratio to the floor with it)."""
    saved, results = load(out)
    if ceilings:
        saved = at_ceilings(saved, ceilings, config)
    results.samples = [s for s in results.samples if s.block < 0 or s.block >= from_block]
    split = split_of(saved, cases, candidates_of, config) if results.samples else None
    arms = list(dict.fromkeys(s.arm for s in results.samples))
    names = {s.case for s in results.samples}
    cases = [c for c in cases if c.name in names]
    reference = "ours-auto" if "ours-auto" in arms else (arms[0] if arms else "ours-auto")
    header = saved["header"] + (
        f"\n- this report leaves out the first {from_block} timed block(s)" if from_block else ""
    )
    sweep_plot = out / ("sweep.png" if name == "report" else f"{name}-sweep.png")
    sections, more = report_load.sections(saved, results, sweep_plot)
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
        split=split,
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
    measured = saved.get("ceilings")
    if not measured:
        raise ValueError("this run measured no ceilings (no GPU): nothing to re-render")
    own = roofline.Ceilings(measured["copy_bytes_per_second"], measured["matmul_flops_per_second"], "")
    shape = "the run's floor does not follow from this model shape (pass its --worker-args)"
    # a run counts the parameters a token multiplies; one saved before 2026-12-02 counted them all
    counts = (roofline.token_matmul_parameters(config), roofline.matmul_parameters(config))
    if saved.get("matmul_parameters") not in (None, *counts):
        raise ValueError(f"matmul parameters: {shape}")
    size = _config_size(saved, config)
    for name, floor in (saved.get("floors") or {}).items():  # none in a load-only run (--blocks 0)
        if abs(roofline.size_floor_seconds(size, saved["tokens"][name][1], own) / floor - 1) > 1e-9:
            raise ValueError(f"{name}: {shape}")
    floors = {name: roofline.size_floor_seconds(size, t[1], ceilings) for name, t in saved["tokens"].items()}
    note = (
        f"\n- re-rendered at ceilings copy {ceilings.copy_bytes_per_second / 1e12:.2f} TB/s, bf16 GEMM "
        f"{ceilings.matmul_flops_per_second / 1e12:.0f} TFLOP/s (the run measured "
        f"{own.copy_bytes_per_second / 1e12:.2f} TB/s, {own.matmul_flops_per_second / 1e12:.0f} TFLOP/s)"
    )
    return saved | {
        "floors": floors,
        "ceilings": {**measured, **ceilings.__dict__},
        "measured_ceilings": measured,
        "header": saved["header"] + note,
    }


def split_of(saved: dict, cases: list[Case], candidates_of, config=None) -> Split:
    """The workload's split, with every request's floor at the saved ceilings, counted as the run
    counts its own (prepare.token_counts: tokens of the shared tree) and checked against the
    run's own tokens and floors (another tokenizer or shape would not give them back)."""
    split = [c for c in cases if c.kind in report.JEVBENCH_KINDS]
    groups: dict[str, list[str]] = {}
    for case in split:
        groups.setdefault(report.group_of(case), []).append(case.name)
    rates = saved.get("ceilings")
    if not rates or not groups:
        return Split(groups, None, "no GPU: no floors" if groups else "no split requests")
    size = _model_size(saved, config)
    if size is None:
        return Split(groups, None, "results.json does not give the model's size: pass --ceilings and --worker-args")
    tokens = prepare.token_counts(split, candidates_of)
    own = [n for n in saved["tokens"] if n in tokens]
    if any(tuple(saved["tokens"][n]) != tokens[n] for n in own):
        return Split(
            groups,
            None,
            "its token counts are not the run's: another --workload file (before 2026-12-04: "
            "826f768's), or another tokenizer in --model",
        )
    ceilings = roofline.Ceilings(rates["copy_bytes_per_second"], rates["matmul_flops_per_second"], "")
    floors = {n: roofline.size_floor_seconds(size, t[1], ceilings) for n, t in tokens.items()}
    if any(abs(floors[n] / saved["floors"][n] - 1) > 1e-9 for n in own if n in (saved.get("floors") or {})):
        return Split(groups, None, "the saved model size does not give the run's floors back")
    return Split(groups, floors)


def _config_size(saved: dict, config) -> tuple[float, int]:
    """roofline.model_size of `config`, its parameters as the run counted them where it saved them
    (a run before 2026-12-02 counted the last layer's MLP too)."""
    weight_bytes, params = roofline.model_size(config)
    return weight_bytes, int(saved.get("matmul_parameters") or params)


def _model_size(saved: dict, config) -> tuple[float, int] | None:
    """roofline.model_size of the run's shape: of `config` where given (at_ceilings checked it),
    else as the run saved it; a results.json from before weight_read_bytes was saved gives the
    bytes back through a read-bound floor (= bytes / copy rate)."""
    if config is not None:
        return _config_size(saved, config)
    params = saved.get("matmul_parameters")
    if not params:
        return None
    if "weight_read_bytes" in saved:
        return saved["weight_read_bytes"], params
    rates = saved["ceilings"]
    for name, floor in (saved.get("floors") or {}).items():
        if floor > 2.0 * params * saved["tokens"][name][1] / rates["matmul_flops_per_second"] * (1 + 1e-9):
            return floor * rates["copy_bytes_per_second"], params
    return None

"""Report sections beyond concurrency 1: first-seen requests, the concurrency sweep with its matmul
rate, the mixed run, start-up and memory. Each returns (markdown lines, target rows), a target row
being (target, measured, verdict) for the report's one targets table."""

from __future__ import annotations

import statistics
from pathlib import Path

from openjev.tools.bench.harness import Results, Sample, percentile
from openjev.tools.bench.report import _verdict

Target = tuple[str, str, str]
SWEEP_SETS = {"split": "JevBench split", "short": "split, <= 512 tokens", "": "the run's cases"}
# issue 13: share of the measured bf16 ceiling at 16 clients, per sweep set
MATMUL_TARGETS = {"short": 0.55, "split": 0.60}
TARGET_CLIENTS = 16
FIRST_SEEN_LIMIT = 1.15
MEMORY_HEADROOM = 12 * 2**30


def _ms(values: list[float]) -> str:
    if not values:
        return "- | - | -"
    mean, p50, p95 = statistics.fmean(values), percentile(values, 0.5), percentile(values, 0.95)
    return f"{1e3 * mean:.1f} | {1e3 * p50:.1f} | {1e3 * p95:.1f}"


def first_seen(samples: list[Sample], seed: int | None) -> tuple[list[str], list[Target]]:
    """Block -1 went out first after start-up; later blocks replay the same requests."""
    first = {s.case: s.latency_seconds for s in samples if s.block < 0 and s.status == "OK"}
    replays: dict[str, list[float]] = {}
    for s in samples:
        if s.block >= 0 and s.status == "OK" and s.case in first:
            replays.setdefault(s.case, []).append(s.latency_seconds)
    paired = [c for c in first if c in replays]
    # a first sight that failed (a deadline: what this target is there to catch) fails the target
    failed_first = sum(1 for s in samples if s.block < 0 and s.status != "OK")
    target_name = f"first-seen mean <= {FIRST_SEEN_LIMIT}x replayed mean"
    if not paired:
        if not failed_first:
            return [], []
        return [], [(target_name, f"{failed_first} first sights failed, none answered", "missed")]
    errors = sum(1 for s in samples if s.block >= 0 and s.status != "OK")
    blocks = len({s.block for s in samples if s.block >= 0})
    first_lat = [first[c] for c in paired]
    replay_lat = [t for c in paired for t in replays[c]]
    ratio = statistics.fmean(first_lat) / statistics.fmean(replay_lat)
    per_request = [first[c] / statistics.fmean(replays[c]) for c in paired]
    lines = [
        "",
        f"## First-seen requests (workload seed {seed}: sent once right after start-up, then replayed)",
        "",
        f"Arm {', '.join(sorted({s.arm for s in samples}))}: "
        f"{len(paired)} requests answered at first sight and replayed, {blocks} replay block(s); "
        f"{failed_first} first sights and {errors} replays failed.",
        "",
        "| | mean ms | p50 ms | p95 ms |",
        "|---|---|---|---|",
        f"| first sight | {_ms(first_lat)} |",
        f"| replayed | {_ms(replay_lat)} |",
        "",
        f"Ratio of means {ratio:.2f}x; per request (first / its replays' mean): median "
        f"{percentile(per_request, 0.5):.2f}x, p10 {percentile(per_request, 0.1):.2f}x, "
        f"p90 {percentile(per_request, 0.9):.2f}x.",
    ]
    target = (
        target_name,
        f"{1e3 * statistics.fmean(first_lat):.1f} ms / {1e3 * statistics.fmean(replay_lat):.1f} ms = {ratio:.2f}x",
        f"missed: {failed_first} first sights failed" if failed_first else _verdict(ratio, FIRST_SEEN_LIMIT, True),
    )
    return lines, [target]


def matmul_rate(row: dict, matmul_parameters: int) -> float:
    """Achieved FLOP/s of the products: 2 x parameters x tree tokens answered / wall time."""
    seconds = row.get("seconds")  # absent from rows saved before the sweep counted tokens
    return 2.0 * matmul_parameters * row.get("tree_tokens", 0) / seconds if seconds else float("nan")


def sweep(
    rows: list[dict],
    matmul_parameters: int | None,
    ceiling: float | None,
    measured: float | None = None,
    plot_file: str | None = None,
) -> tuple[list[str], list[Target]]:
    """ceiling: the bf16 rate the shares are of; measured: the run's own where `ceiling` was given;
    plot_file: the sweep's plot (plot_sweep) beside the report, linked from the section."""
    if not rows:
        return [], []
    if not ceiling:
        source = "; no GPU ceiling."
    elif measured:
        source = (
            f"; bf16 ceiling given (--ceilings): {ceiling / 1e12:.0f} TFLOP/s, this run measured {measured / 1e12:.0f}."
        )
    else:
        source = f"; bf16 ceiling measured in this run: {ceiling / 1e12:.0f} TFLOP/s."
    lines = [
        "",
        "## Concurrency sweep (closed loop: each client sends its next request when the last answers)",
        "",
        f"Matmul rate: 2 x {f'{matmul_parameters:,}' if matmul_parameters else 'unknown'} matmul parameters x "
        "tokens of the answered requests' shared trees / wall time" + source,
        "",
        "| set | arm | clients | requests | errors | req/s | mean ms | p50 ms | p95 ms | tree tokens/s | TFLOP/s "
        "| of ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    targets = []
    for row in rows:
        rate = matmul_rate(row, matmul_parameters) if matmul_parameters else float("nan")
        share = rate / ceiling if ceiling else float("nan")
        label = SWEEP_SETS.get(row.get("set", ""), row.get("set", ""))
        lines.append(
            f"| {label} | {row['arm']} | {row['clients']} | {row['requests']} | {row['errors']} "
            f"| {row['throughput_rps']:.2f} | {row['mean_ms']:.1f} | {row['p50_ms']:.1f} | {row['p95_ms']:.1f} "
            f"| {row.get('tree_tokens', 0) / row.get('seconds', float('nan')):.0f} | {rate / 1e12:.3g} | "
            + (f"{100 * share:.1f}% |" if share == share else "- |")
        )
        limit = MATMUL_TARGETS.get(row.get("set", ""))
        if limit is not None and row["clients"] == TARGET_CLIENTS:
            targets.append(
                (
                    f"matmul rate at {TARGET_CLIENTS} clients, {label}: >= {100 * limit:.0f}% of the bf16 ceiling",
                    f"{100 * share:.1f}% ({rate / 1e12:.1f} TFLOP/s, {row['throughput_rps']:.2f} req/s)"
                    if share == share
                    else "no GPU ceiling",
                    # a rejected or failed request is load the server did not carry
                    f"missed ({row['errors']} errors)" if row["errors"] else _verdict(share, limit, False),
                )
            )
    if plot_file:
        lines += ["", f"![throughput, share of the ceiling and latency by clients]({plot_file})"]
    for name in dict.fromkeys(r.get("set", "") for r in rows):
        by_level = {r["clients"]: r for r in rows if r.get("set", "") == name}
        low, high = min(by_level), max(by_level)
        if high > low and by_level[low]["throughput_rps"] > 0:
            line = (
                f"\n{SWEEP_SETS.get(name, name)}: throughput x"
                f"{by_level[high]['throughput_rps'] / by_level[low]['throughput_rps']:.2f} in requests/s"
            )
            # a level's requests are those answered within its seconds, so with more clients the
            # mix leans to short requests: tokens/s says how much more work was carried
            rates = [
                r.get("tree_tokens", 0) / r["seconds"] if r.get("seconds") else 0
                for r in (by_level[low], by_level[high])
            ]
            if rates[0] > 0:
                line += f", x{rates[1] / rates[0]:.2f} in tree tokens/s"
            lines.append(f"{line} from {low} to {high} clients.")
    return lines, targets


def plot_sweep(rows: list[dict], matmul_parameters: int | None, ceiling: float | None, path: Path) -> None:
    """Two panels by clients, a line per sweep set: the matmul rate as a share of the ceiling with
    its target (req/s where the run has no ceiling), and p50 (solid) / p95 (dashed) latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, latency_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for i, name in enumerate(dict.fromkeys(r.get("set", "") for r in rows)):
        mine = sorted((r for r in rows if r.get("set", "") == name), key=lambda r: r["clients"])
        clients, label, color = [r["clients"] for r in mine], SWEEP_SETS.get(name, name), f"C{i}"
        if ceiling and matmul_parameters:
            rate_ax.plot(clients, [100 * matmul_rate(r, matmul_parameters) / ceiling for r in mine], "o-", c=color)
            if name in MATMUL_TARGETS:
                rate_ax.axhline(
                    100 * MATMUL_TARGETS[name], ls=":", c=color, label=f"{label}: target at {TARGET_CLIENTS}"
                )
        else:
            rate_ax.plot(clients, [r["throughput_rps"] for r in mine], "o-", c=color)
        latency_ax.plot(clients, [r["p50_ms"] for r in mine], "o-", c=color, label=f"{label} p50")
        latency_ax.plot(clients, [r["p95_ms"] for r in mine], "o--", c=color, label=f"{label} p95")
    rate_ax.set_ylabel("matmul rate, % of the bf16 ceiling" if ceiling and matmul_parameters else "requests / s")
    latency_ax.set_ylabel("latency (ms, log)")
    latency_ax.set_yscale("log")
    levels = sorted({r["clients"] for r in rows})
    for ax in (rate_ax, latency_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("clients (closed loop)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Concurrency sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mixed(rows: list[dict]) -> tuple[list[str], list[Target]]:
    alone = next((r for r in rows if not r["with_long"]), None)
    beside = next((r for r in rows if r["with_long"]), None)
    if not alone or not beside:
        return [], []
    lines = [
        "",
        f"## Mixed run: {alone['short_clients']} clients looping <= 512-token requests, alone, then with one "
        "client looping 16,384-token requests beside them",
        "",
        "| short requests | requests | errors | req/s | mean ms | p50 ms | p95 ms | long requests answered "
        "| long mean ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("alone", alone), ("with long requests", beside)):
        lines.append(
            f"| {name} | {r['requests']} | {r['errors']} | {r['throughput_rps']:.2f} | {r['mean_ms']:.1f} "
            f"| {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['long_requests']} ({r['long_errors']} errors) "
            f"| {r['long_mean_ms']:.1f} |"
        )
    p50, p95 = beside["p50_ms"] / alone["p50_ms"], beside["p95_ms"] / alone["p95_ms"]
    target = (
        "short requests' p50 / p95 with 16,384-token requests alongside (issue 13: report it)",
        f"{beside['p50_ms']:.1f} / {beside['p95_ms']:.1f} ms, {p50:.2f}x / {p95:.2f}x the short requests alone",
        "reported (no numeric target)",
    )
    return lines, [target]


def service(startup: list[dict], peak_bytes: list, weight_bytes: int | None) -> tuple[list[str], list[Target]]:
    """startup: per worker, seconds from spawn to health SERVING and what it logged before serving."""
    if not startup and not weight_bytes:  # results saved before these were recorded
        return [], []
    lines, targets = ["", "## Start-up and memory", ""], []
    for i, s in enumerate(startup):
        lines.append(
            f"- {s['name']}@{i}: SERVING {s['serving_seconds']:.1f} s after spawn"
            + (f"; graphs_ready: {s['graphs_ready']}" if s.get("graphs_ready") else "; no graphs_ready line logged")
        )
        for event in s.get("events", []):
            lines.append(f"  - logged at start: `{event}`")
    if startup:
        ours = startup[0]
        ready = ours.get("graphs_ready")
        targets.append(
            (
                "start-up time to SERVING (issue 13: report it)",
                f"{ours['serving_seconds']:.1f} s" + (f", graphs_ready {ready}" if ready else ", no graphs_ready line"),
                "reported (no numeric target)",
            )
        )
    peak = peak_bytes[0] if peak_bytes else None
    if weight_bytes:
        lines.append(f"- weights on the device (bf16, embedding included): {weight_bytes / 2**30:.1f} GiB")
        limit = weight_bytes + MEMORY_HEADROOM
        targets.append(
            (
                "peak device memory <= weights + 12 GiB (torch's reserved peak)",
                f"{peak / 2**30:.1f} GiB, limit {limit / 2**30:.1f} GiB" if peak else "no GPU: not measured",
                _verdict(peak, limit, True) if peak else "not measured",
            )
        )
    return lines, targets


def sections(saved: dict, results: Results, sweep_plot: Path | None = None) -> tuple[list[str], list[Target]]:
    """Everything of saved results.json beyond the concurrency-1 blocks; sweep_plot: where to draw
    the sweep (beside the report, which links it by name)."""
    ceilings = saved.get("ceilings") or {}
    parameters, ceiling = saved.get("matmul_parameters"), ceilings.get("matmul_flops_per_second")
    if sweep_plot and results.sweep:
        plot_sweep(results.sweep, parameters, ceiling, sweep_plot)
    parts = [
        first_seen(results.first_seen, saved.get("first_seen_seed")),
        sweep(
            results.sweep,
            parameters,
            ceiling,
            (saved.get("measured_ceilings") or {}).get("matmul_flops_per_second"),
            sweep_plot.name if sweep_plot and results.sweep else None,
        ),
        mixed(results.mixed),
        service(saved.get("startup", []), saved.get("peak_memory_bytes", []), saved.get("weight_bytes")),
    ]
    return [line for lines, _ in parts for line in lines], [t for _, targets in parts for t in targets]

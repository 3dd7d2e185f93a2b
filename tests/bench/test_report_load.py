"""The report's sections beyond concurrency 1 (first-seen, sweep with its matmul rate, mixed run,
start-up and memory) and the matmul-parameter count, on hand-made numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from small_config import SMALL

from openjev.tools.bench import harness, load, report_load, roofline, worker_log, workload
from openjev.tools.bench.saved import render_saved
from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import expected_shapes

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.jsonl"


def test_matmul_parameters_of_a_small_config():
    # per layer MLP: gate, up, down = 3 * 8 * 16 = 384
    # GDN: qkv (2*4 + 8 = 16 channels) 16*8 + z 8*8 + b 2*8 + a 2*8 + out 8*8 = 288
    # attention: q with its gate (2 heads * 4 * 2 = 16) 16*8 + k 4*8 + v 4*8 + o 8*8 = 256
    assert roofline.matmul_parameters(SMALL) == 2 * 384 + 288 + 256 == 1312
    # the same as every 2-D weight but the embedding (norms, conv taps, gates are not products)
    shapes = expected_shapes(SMALL)
    products = sum(a * b for name, (a, *rest) in shapes.items() if len(rest) == 1 and "embed" not in name for b in rest)
    assert products == 1312
    assert roofline.weight_bytes_resident(SMALL) == 2 * sum(math.prod(s) for s in shapes.values())


def _sample(case: str, block: int, seconds: float) -> harness.Sample:
    return harness.Sample("ours-auto", case, block, seconds, "OK")


def test_first_seen_ratio_and_verdict():
    samples = [_sample(c, -1, 0.030) for c in "ab"] + [_sample(c, b, 0.020) for c in "ab" for b in (0, 1)]
    lines, [target] = report_load.first_seen(samples, seed=7)
    assert "| first sight | 30.0 | 30.0 | 30.0 |" in lines and "| replayed | 20.0 | 20.0 | 20.0 |" in lines
    assert target == (
        "first-seen mean <= 1.15x replayed mean",
        "30.0 ms / 20.0 ms = 1.50x",
        "missed: 30% over the limit",
    )
    fast = [_sample("a", -1, 0.021), _sample("a", 0, 0.020)]
    assert report_load.first_seen(fast, seed=7)[1][0][2] == "met"


def _row(label: str, clients: int, tree_tokens: int, seconds: float = 10.0) -> dict:
    row = {"arm": "ours-auto", "set": label, "clients": clients}
    row |= load.summary([0.010, 0.020, 0.030], seconds, 0)
    return row | {"tree_tokens": tree_tokens}


def test_a_failed_first_sight_fails_the_target():
    """A first sight that ran into its deadline is what the target is there to catch."""
    answered = [_sample(f"c{i}", b, 0.1) for i in range(3) for b in (-1, 0)]
    failed = [harness.Sample("ours-auto", "c9", -1, 120.0, "DEADLINE_EXCEEDED"), _sample("c9", 0, 0.1)]
    assert report_load.first_seen(answered + failed, seed=7)[1][0][2] == "missed: 1 first sights failed"
    assert report_load.first_seen(failed[:1], seed=7)[1] == [
        ("first-seen mean <= 1.15x replayed mean", "1 first sights failed, none answered", "missed")
    ]


def test_sweep_matmul_rate_against_the_ceiling():
    params, ceiling = 10**9, 1e15
    # 2 * 1e9 * tokens / 10 s: 3e6 tokens -> 6e14 FLOP/s (60%), 2.5e6 -> 5e14 (50%)
    rows = [_row("short", 1, 10**6), _row("short", 16, 2_500_000), _row("split", 16, 3_000_000)]
    lines, targets = report_load.sweep(rows, params, ceiling)
    assert report_load.matmul_rate(rows[2], params) == 6e14
    short, split = targets
    assert short == (
        "matmul rate at 16 clients, split, <= 512 tokens: >= 55% of the bf16 ceiling",
        "50.0% (500.0 TFLOP/s, 0.30 req/s)",
        "missed: 9% under the target",
    )
    assert split[0] == "matmul rate at 16 clients, JevBench split: >= 60% of the bf16 ceiling"
    assert split[1:] == ("60.0% (600.0 TFLOP/s, 0.30 req/s)", "met")
    assert any(
        line.startswith("| split, <= 512 tokens | ours-auto | 16 | 3 | 0 | 0.30 | 20.0 | 20.0 |") for line in lines
    )
    # requests/s and tree tokens/s from 1 to 16 clients (the same requests/s, 2.5x the tokens)
    assert (
        "\nsplit, <= 512 tokens: throughput x1.00 in requests/s, x2.50 in tree tokens/s from 1 to 16 clients." in lines
    )
    # without a GPU the rate is still shown, the verdict is not a pass
    _, [short, split] = report_load.sweep(rows, params, None)
    assert short[1:] == ("no GPU ceiling", "not measured")


def test_mixed_run_and_service_sections():
    alone = {"arm": "a", "short_clients": 4, "with_long": False, "long_requests": 0, "long_errors": 0}
    alone |= load.summary([0.010] * 19 + [0.020], 10.0, 0) | {"long_mean_ms": float("nan")}
    beside = dict(alone, with_long=True, long_requests=3, long_mean_ms=1500.0)
    beside |= load.summary([0.010] * 18 + [0.050, 0.060], 10.0, 0)
    lines, [target] = report_load.mixed([alone, beside])
    assert "| with long requests | 20 | 0 | 2.00 | 14.5 | 10.0 | 50.5 | 3 (0 errors) | 1500.0 |" in lines
    assert target[1] == "10.0 / 50.5 ms, 1.00x / 4.81x the short requests alone"

    log = "\n".join(
        json.dumps(e)
        for e in (
            {"event": "config", "level": "info"},
            {"event": "graphs_ready", "count": 12, "seconds": 31.5},
            {"event": "serving", "port": 1},
            {"event": "peak_memory", "device_bytes": 60 * 2**30},
        )
    )
    startup = worker_log.startup(log, 95.0, "worker")
    assert startup["graphs_ready"] == {"count": 12, "seconds": 31.5} and len(startup["events"]) == 2
    peak = worker_log.exit_stats(log)["device_bytes"]
    lines, [start, memory] = report_load.service([startup], [peak], 50 * 2**30)
    assert start[1] == "95.0 s, graphs_ready {'count': 12, 'seconds': 31.5}"
    target = "peak device memory <= weights + 12 GiB (torch's reserved peak)"
    assert memory == (target, "60.0 GiB, limit 62.0 GiB", "met")
    assert report_load.service([startup], [70 * 2**30], 50 * 2**30)[1][1][2] == "missed: 13% over the limit"


def test_render_saved_puts_every_part_in_one_targets_table(tmp_path):
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.kind == "noul"][:2]
    saved = {
        "samples": [_sample(c.name, b, 0.030).__dict__ for c in cases for b in (-1, 0)],
        "sweep": [_row("split", 16, 10**6)],
        "first_seen": [_sample("x", -1, 0.030).__dict__, _sample("x", 0, 0.030).__dict__],
        "mixed": [],
        "floors": None,
        "header": "# test",
        "tokens": {c.name: [10, 5] for c in cases},
        "ceilings": {"copy_bytes_per_second": 4e12, "matmul_flops_per_second": 1e15, "device": "test"},
        "matmul_parameters": 10**9,
        "weight_bytes": 50 * 2**30,
        "startup": [{"name": "worker", "serving_seconds": 12.0, "graphs_ready": None, "events": []}],
        "peak_memory_bytes": [None],
        "first_seen_seed": 7,
    }
    (tmp_path / "results.json").write_text(json.dumps(saved))
    text = render_saved(tmp_path, cases, None)  # no floors: the tokenizer is not needed
    for row in (
        "| noul mean <= 40 ms | 30.0 ms | met |",
        "| first-seen mean <= 1.15x replayed mean | 30.0 ms / 30.0 ms = 1.00x | met |",
        "| matmul rate at 16 clients, JevBench split: >= 60% of the bf16 ceiling | 20.0% (200.0 TFLOP/s, 0.30 req/s) "
        "| missed: 67% under the target |",
        "| start-up time to SERVING (issue 13: report it) | 12.0 s, no graphs_ready line |",
        "| peak device memory <= weights + 12 GiB (torch's reserved peak) | no GPU: not measured | not measured |",
    ):
        assert row in text
    assert "## First-seen requests (workload seed 7" in text and "## Concurrency sweep" in text
    assert "](sweep.png)" in text and (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_level_with_errors_misses_its_matmul_rate_target():
    """Rejected or failed requests are load the server did not carry, whatever rate the rest reached."""
    row = _row("split", 16, 3_000_000) | {"errors": 3}
    _, [target] = report_load.sweep([row], 10**9, 1e15)
    assert target[1:] == ("60.0% (600.0 TFLOP/s, 0.30 req/s)", "missed (3 errors)")


def _load_only(tmp_path) -> None:
    """results.json of a --blocks 0 run: ceilings measured, no concurrency-1 cases nor floors."""
    saved = {
        "samples": [],
        "sweep": [_row("split", 16, 3_000_000)],
        "floors": {},
        "header": "# test",
        "tokens": {},
        "ceilings": {"copy_bytes_per_second": 4e12, "matmul_flops_per_second": 1e15, "device": "H200"},
        "matmul_parameters": roofline.token_matmul_parameters(SMALL),
    }
    (tmp_path / "results.json").write_text(json.dumps(saved))


def test_a_load_only_run_renders_at_given_ceilings(tmp_path):
    _load_only(tmp_path)
    cases = workload.read_jsonl(WORKLOAD)
    own = render_saved(tmp_path, cases, None)
    assert "bf16 ceiling measured in this run: 1000 TFLOP/s." in own
    # the sweep is drawn though the run has no concurrency-1 samples (and so no latency plot)
    assert (tmp_path / "sweep.png").stat().st_size > 0 and not (tmp_path / "latency.png").exists()
    render_saved(tmp_path, cases, None, name="report-at-ceilings")
    assert (tmp_path / "report-at-ceilings-sweep.png").exists()
    given = roofline.Ceilings(4e12, 1.2e15, "given")
    text = render_saved(tmp_path, cases, None, ceilings=given, config=SMALL)
    assert "bf16 ceiling given (--ceilings): 1200 TFLOP/s, this run measured 1000." in text
    assert "measured in this run" not in text.split("## Concurrency sweep")[1]
    assert "re-rendered at ceilings copy 4.00 TB/s, bf16 GEMM 1200 TFLOP/s" in text
    other = ModelConfig(**{**SMALL.__dict__, "intermediate_size": 24})
    with pytest.raises(ValueError, match="does not follow from this model shape"):
        render_saved(tmp_path, cases, None, ceilings=given, config=other)


def test_the_sweep_keeps_each_request_latency(monkeypatch):
    """results.json keeps each answered request of a level, so its percentiles can be redone."""
    cases = [c for c in workload.read_jsonl(WORKLOAD) if c.kind == "noul"][:8]

    def answered(arm, streams, seconds, timeout):
        for k, stream in enumerate(streams):
            stream.latencies += [(c.name, 0.001 * (k + i + 1)) for i, c in enumerate(stream.cases)]
        return 10.0

    monkeypatch.setattr(load, "run_streams", answered)
    [row] = load.concurrency_sweep(harness.Arm("ours-auto", "", "auto"), cases, (4,), label="split")
    row = json.loads(json.dumps(row))
    assert sorted(name for name, _ in row["latencies"]) == sorted(c.name for c in cases)
    ms = [1e3 * seconds for _, seconds in row["latencies"]]
    assert row["p50_ms"] == harness.percentile(ms, 0.5) and row["p95_ms"] == harness.percentile(ms, 0.95)

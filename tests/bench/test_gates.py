"""The numerical-gates tool itself, on the CPU with the demo model: it chooses requests of every
kind, says what each column covered, and catches an injected error of one ulp (a policy's head
scores; a request spread over passes that it shared) in --exact mode."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from openjev.tools.bench import gates, gates_report, workload
from openjev.worker.engine import ExecutionResult
from openjev.worker.planner.plan import PackLimits
from openjev.worker.scheduler import Scheduler

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "benchmarks" / "workload.jsonl"
# Short strata only (the CPU is slow); chunks of 128 tokens so that requests of the 129-512 group
# and the 3-question one run spread over passes when they share them.
SHORT = "16k,513-2048,2049-4096,4q,8q,17-candidates,33-candidates,mixed,score-10"


def run(tmp_path: Path, demo_model: Path, *extra: str) -> tuple[int, str]:
    out = tmp_path / "gates.md"
    argv = [
        "--model",
        str(demo_model),
        "--workload",
        str(WORKLOAD),
        "--backend",
        "torch",
        "--skip",
        SHORT,
        "--chunk-tokens",
        "128",
        "--max-launch-tokens",
        "512",
        "--out",
        str(out),
        *extra,
    ]
    return gates.run_gates(argv), out.read_text()


def bump(score: float) -> float:
    """One fp32 ulp up."""
    return float(np.nextafter(np.float32(score), np.float32(np.inf)))


def test_selection_is_stratified_and_seeded():
    cases = workload.read_jsonl(WORKLOAD)
    chosen = gates.select_cases(cases, 30, seed=0, skip={"16k"}, kinds=None)
    strata = {(c.kind, c.group) for c in cases if c.group != "16k"}
    assert len(chosen) == 30 and {(c.kind, c.group) for c in chosen} == strata
    assert [c.name for c in gates.select_cases(cases, 30, 0, {"16k"}, None)] == [c.name for c in chosen]
    assert [c.name for c in gates.select_cases(cases, 30, 1, {"16k"}, None)] != [c.name for c in chosen]
    everything = gates.select_cases(cases, None, 0, set(), None)
    assert len(everything) == len(cases)
    assert everything[len(strata)].group == "16k"  # the slow case last of the first round


@pytest.mark.parametrize(
    ("flags", "chunk"),
    [
        ((), 2048),
        (("--shared-launch-tokens", "2048"), 1024),
        (("--max-launch-tokens", "512"), 256),
        (("--shared-launch-tokens", "1024", "--chunk-tokens", "128"), 128),
    ],
)
def test_chunk_default_is_the_workers_for_the_same_flags(flags, chunk):
    """Without --chunk-tokens the gates plan with the chunk the worker would take for the same
    budget and shared pass (a fixed 2,048 once made --shared-launch-tokens 1024 a ValueError)."""
    args = gates.parse_args(["--model", "m", "--workload", "w", *flags])
    assert args.chunk_tokens == chunk
    PackLimits(max_tokens=args.max_launch_tokens, chunk_tokens=chunk, shared_tokens=args.shared_launch_tokens)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (("--shared-launch-tokens", "8192"), "shared_tokens 8192 must lie between chunk_tokens 4096 and the pass"),
        (("--shared-launch-tokens", "1024", "--chunk-tokens", "2048"), "1024 must lie between chunk_tokens 2048"),
        (("--max-launch-tokens", "0"), "expected an integer >= 1"),
    ],
)
def test_budget_the_worker_would_refuse_is_a_usage_error(flags, why, capsys):
    """The worker refuses these flags at start; the gates say so before loading anything."""
    with pytest.raises(SystemExit) as e:
        gates.parse_args(["--model", "m", "--workload", "w", *flags])
    assert e.value.code == 2
    assert why in capsys.readouterr().err


def test_report_covers_kinds_and_passes(tmp_path, demo_model):
    rc, text = run(tmp_path, demo_model, "--limit", "8", "--oracle-cases", "2", "--policies", "default,fixed")
    assert rc == 0, text
    assert "verdict: **PASS**" in text
    for row in ("| choice | 1-128 |", "| noul | 129-512 |", "| score | 1-128 |", "| multi | 3q |", "| capacity |"):
        assert row in text
    # what each row covered, and n/a where the oracle's requests (two choice) had no such question
    assert "| fixed | 8 |" in text
    assert "2 of the first 2 requests" in text and "max abs d score n/a" in text and "0 requests failed there" in text
    assert "seed 0" in text
    assert "ran in more passes mixed than alone" in text
    mixed = text.split(gates_report.MIXED_LOG_HEADER)[1]
    assert mixed.count("| yes |") == 8


def test_exact_passes_where_the_cpu_is_exact(tmp_path, demo_model):
    """`fixed` is bit exact against `off` on the CPU, and so is every request mixed and alone."""
    rc, text = run(tmp_path, demo_model, "--limit", "6", "--oracle-cases", "0", "--policies", "fixed", "--exact")
    assert rc == 0, text
    assert "| fixed | 0 | 0.00e+00 | 0 | 0.00e+00 |" in text


@pytest.mark.parametrize("shift", ["ulp", "constant"])
def test_exact_catches_a_policy_off_by_one_ulp(tmp_path, demo_model, monkeypatch, shift):
    """One policy's head scores one ulp off (or all shifted alike, which softmax hides)."""
    update = Scheduler._update

    def injected(self, job, index, keep, result):
        if job.plan.policy == "fixed" and result.head_score is not None:
            score = bump(result.head_score) if shift == "ulp" else result.head_score + 2.0**-12
            result = dataclasses.replace(result, head_score=score)
        update(self, job, index, keep, result)

    monkeypatch.setattr(Scheduler, "_update", injected)
    rc, text = run(
        tmp_path,
        demo_model,
        "--limit",
        "4",
        "--oracle-cases",
        "0",
        "--policies",
        "fixed",
        "--exact",
        "--mixed-clients",
        "1",
    )
    assert rc == 1, text
    assert "verdict: **FAIL**" in text and "fixed: " in text and "differ in some bit" in text
    row = next(line for line in text.splitlines() if line.startswith("| fixed | ") and "e" in line)
    assert row.split(" | ")[1] != "0"  # head scores differing


def test_exact_catches_a_request_split_while_sharing(tmp_path, demo_model, monkeypatch):
    """A head score one ulp off only where its request ran spread over passes that it shared:
    the mixed run must hold such requests to see it."""
    update = Scheduler._update

    def injected(self, job, index, keep, result):
        if job.num_passes > 1 and job.num_shared_passes > 0 and result.head_score is not None:
            result = dataclasses.replace(result, head_score=bump(result.head_score))
        update(self, job, index, keep, result)

    monkeypatch.setattr(Scheduler, "_update", injected)
    rc, text = run(tmp_path, demo_model, "--limit", "6", "--oracle-cases", "0", "--policies", "fixed", "--exact")
    assert rc == 1, text
    assert "mixed run: " in text and "differ in some bit of a head score from alone" in text


def test_a_long_request_that_ran_whole_in_one_pass_does_not_cover_the_split_gate():
    """Longer than a chunk is not spread over passes (a pass with room runs it whole): the gate
    asks for a request that ran in more than one pass and shared one."""
    base = {"requests": 3, "shared": 3, "long": 1, "split_shared": 0, "mismatches": 0, "failures": 0}
    assert any("none ran over more than one pass" in p for p in gates.mixed_problems(base))
    assert gates.mixed_problems(base | {"split_shared": 1}) == []
    assert gates.mixed_problems(base | {"long": 0}) == []  # nothing longer than a chunk: nothing to split


def test_command_line_exit_status(tmp_path, demo_model):
    """As device_run.sh runs it: 1 where a gate fails (`default` is not bit exact against `off` on
    the CPU), never an abort at exit (engines closed at the end once ended it with status 134)."""
    argv = [sys.executable, "-m", "openjev.tools.bench.gates", "--model", str(demo_model), "--workload", str(WORKLOAD)]
    argv += ["--skip", SHORT, "--kinds", "choice", "--limit", "2", "--oracle-cases", "0", "--policies", "default"]
    done = subprocess.run([*argv, "--exact"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "verdict: **FAIL**: default: " in done.stdout


def test_nothing_compared_fails(tmp_path, demo_model):
    """A selection that leaves no request (a misspelt --kinds) compares nothing: that is a failed
    gate, not a pass over zero comparisons."""
    rc, text = run(tmp_path, demo_model, "--kinds", "chioce", "--oracle-cases", "0", "--policies", "fixed")
    assert rc == 1, text
    assert "fixed: compared no request" in text and "mixed run: compared no request" in text


@pytest.mark.parametrize("exact", [True, False])
def test_a_non_finite_answer_fails(exact):
    """A NaN in both answers has the same bits and max() skips it: counted on its own."""
    nan = float("nan")
    base = ExecutionResult([[0.5, nan]], [[0.3, nan]], "off", "off", False, "none", 0, 2, 2, 1, 0, 0.0, 0.0)
    diff = gates.Diff()
    diff.add(["score"], base, base)
    problems = diff.problems("auto", exact, 1e-3)
    assert problems == ["auto: 2 head scores or probabilities are not finite"]

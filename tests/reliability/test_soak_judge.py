"""The soak's judge on hand-made runs: each failure a review found it passing (2026-12-04) now
fails the run. No servers: the real judge() and failures() over Outcomes with known times."""

from __future__ import annotations

import io
import time

from openjev import progress
from openjev.tools import soak
from openjev.tools.soak.judge import judge
from openjev.tools.soak.report import Report, failures
from openjev.tools.soak.run import Run
from openjev.tools.soak.workload import MEDIUM, tagged, tagged_answer

NOW = time.monotonic()


def _run(hostile: soak.Hostile | None, outcomes=(), kills=()) -> Run:
    run = Run(
        address="127.0.0.1:1",
        clients=1,
        duration=60,
        timeout=60.0,
        seed=0,
        bound=hostile.request_bound_seconds if hostile else 60.0,
        hostile=hostile,
        parts=hostile.parts if hostile else (),
        worker=None,
        valid=[],
        invalid=[],
        expected=[],
        expected_medium={},
        oversized=[],
        plan=[],
        pids={},
        peak={},
        bar=progress.Progress("test", 1, stream=io.StringIO()),
        stop_at=0.0,
    )
    run.outcomes, run.kills = list(outcomes), [dict(k) for k in kills]
    return run


def _outcome(status: str, begin: float, end: float, n: int, ok: bool = True) -> soak.Outcome:
    return soak.Outcome("valid", status, end - begin, ok, f"soak-{n}", started=begin, ended=end, answered_ok=ok or None)


def _failures(run: Run) -> list[str]:
    report = Report(clients=1)
    judge(run, report, frontend_log=None, metrics_ports=None)
    return failures(report)


def test_a_kill_whose_worker_is_not_back_fails_the_run():
    """Without a time it was SERVING again, the kill's window was open-ended and excused every
    later UNAVAILABLE: a worker that never came back passed."""
    kill = {"at_s": 10.0, "in_flight": 0, "_killed_at": NOW - 50}
    outcomes = [_outcome("UNAVAILABLE", NOW - 49 + i, NOW - 48.9 + i, i, ok=False) for i in range(20)]
    problems = _failures(_run(soak.Hostile(kills=1), outcomes, [kill]))
    assert problems == ["the worker killed at 10.0 s was not serving again when the run was judged"]
    back = {**kill, "_up_at": NOW - 45, "down_s": 5.0}  # the worker back: the first 4 are excused
    assert _failures(_run(soak.Hostile(kills=1), outcomes[:4], [back])) == []


def test_fewer_kills_than_asked_fail_the_run():
    """Kills are timed over --duration: clients that used up --requests first ended the run with
    none done, and it passed."""
    problems = _failures(_run(soak.Hostile(kills=2), [_outcome("OK", NOW - 2, NOW - 1, 1)]))
    assert problems == ["0 of 2 kills done (the clients ended before the rest were due)"]
    assert _failures(_run(soak.Hostile(parts=("idle",), kills=2), [_outcome("OK", NOW - 2, NOW - 1, 1)])) == []


def test_memory_is_judged_at_the_peak_and_without_a_hostile_mix():
    """The growth was after - before, so a worker that grew and was then killed (its successor
    fresh at the end) passed; and a run without a hostile mix judged no memory at all."""
    report = Report(clients=1)
    report.rss = {
        "before_mib": {"worker": 700.0},
        "after_mib": {"worker": 690.0},
        "peak_mib": {"worker": 1200.0},
        "bound_mib": 128.0,
    }
    assert failures(report) == ["worker RSS grew 500.0 MiB at its peak (bound 128)"]
    report.after_drain = {"openjev_frontend_in_flight_requests": 1.0}
    assert "openjev_frontend_in_flight_requests is 1.0 after the run (a request was not freed)" in failures(report)


def test_a_worker_gone_at_the_end_is_a_failure_not_a_crash():
    """A worker whose restart failed: its pid is the killed one's, and reading that process's RSS
    raised, so the judge crashed with a traceback and no verdict (a review helper's finding)."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    run = _run(None, [_outcome("OK", NOW - 2, NOW - 1, 1)])
    run.pids, run.peak = {"worker": gone.pid}, {"worker": 800.0}
    report = Report(clients=1)
    report.rss = {"before_mib": {"worker": 700.0}, "bound_mib": 128.0}
    judge(run, report, frontend_log=None, metrics_ports=None)
    assert report.rss["after_mib"] == {"worker": None}
    assert failures(report) == ["worker was not running when the run was judged"]
    assert "RSS worker MiB: before 700.0  after None" in soak.format_report(report)


def test_every_unexpected_outcome_is_counted_and_a_second_baseline_must_agree():
    run = _run(None, [_outcome("INTERNAL", NOW - 2, NOW - 1, i, ok=False) for i in range(30)])
    report = Report(clients=1)
    judge(run, report, frontend_log=None, metrics_ports=None)
    assert report.unexpected_count == 30 and len(report.unexpected) == 20
    assert failures(report)[0].startswith("30 unexpected outcomes (the first 20: ")
    assert "unexpected outcomes: 30;" in soak.format_report(report)
    report = Report(clients=1, baseline_differs=2)
    assert failures(report)[0].startswith("2 valid requests answered otherwise when sent alone again")


def test_an_answer_meant_for_another_send_of_the_same_request_differs():
    """Sends of one request had one answer, so a swap between two of them was invisible (about
    one swap in seven on the soak's 7 requests, every one on the cancel part's single request)."""
    answer = {"answers": {"q": {"type": "choice", "choice": "k1"}}, "metadata": {"method": "m"}}
    first = tagged(MEDIUM, "a1")
    assert list(first["questions"]) == ["q-a1"] and first["state"] == MEDIUM["state"]
    assert tagged_answer(answer, "a1") != tagged_answer(answer, "b2")
    assert tagged_answer(answer, "a1")["answers"] == {"q-a1": answer["answers"]["q"]}

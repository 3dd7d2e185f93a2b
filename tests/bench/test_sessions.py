"""The agent-session benchmark: sessions built from the committed workload are deterministic and
within their bounds, the report's ratios are those of the timings it is given, and one small run
goes end to end through real frontends and workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openjev.tools.bench import agent_sessions, prepare, sessions, workload
from openjev.tools.bench.sessions import Timing

WORKLOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.jsonl"


@pytest.fixture(scope="module")
def built(demo_model):
    _, _, longest = prepare.longest_tokens_fn(demo_model)
    cases = workload.read_jsonl(WORKLOAD)
    return lambda seed, **kw: sessions.build_sessions(cases, longest, agents=5, seed=seed, **kw), longest


def test_sessions_are_deterministic_and_within_bounds(built):
    build, longest = built
    first, again, other = build(3), build(3), build(4)
    assert first == again
    assert first != other
    for s in first:
        assert 4 <= len(s.questions) <= 8
        assert len({json.dumps(q, sort_keys=True) for q in s.questions}) == len(s.questions)
        assert 500 <= s.state_tokens <= 4000
        # the measured length is the state's: the request's longest candidate less the bare question's
        q = s.questions[0]
        grown = longest({"state": s.state, "questions": {"q": q}}) - longest(sessions.no_state(q))
        assert abs(grown - s.state_tokens) <= 2  # BPE may merge a token across the state's edge
    assert len({json.dumps(s.state, sort_keys=True) for s in first}) == 5
    split = [c for c in workload.read_jsonl(WORKLOAD) if c.kind in ("choice", "noul", "score")]
    asked = {json.dumps(q, sort_keys=True) for s in first + other for q in s.questions}
    assert asked <= {json.dumps(q, sort_keys=True) for q in sessions.distinct_questions(split)}
    narrow = build(3, min_requests=4, max_requests=4, max_state_tokens=1500)
    assert all(len(s.questions) == 4 and s.state_tokens <= 1500 for s in narrow)
    with pytest.raises(ValueError, match="states of"):
        build(3, min_state_tokens=3990, max_state_tokens=4000)


def test_interleaving_and_tags():
    s = [sessions.Session(a, "x", 600, tuple({"n": i} for i in range(n))) for a, n in enumerate((3, 1, 2))]
    assert sessions.interleaved(s) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
    assert s[0].request(1, "t")["state"] == "[session t]\nx"
    assert sessions.tagged({"a": 1}, "t") == {"session": "t", "a": 1}


def test_ratios_from_given_timings():
    timings = []
    # two agents, three requests each, one block; later requests with the cache on take 1.2x,
    # 1.0x, 1.5x, 1.1x the no-state question's time, the cache off 4x
    factors = {(0, 1): 1.2, (0, 2): 1.0, (1, 1): 1.5, (1, 2): 1.1}
    for agent in (0, 1):
        for k in range(3):
            base = 0.1 * (1 + agent + k)
            timings.append(Timing("nostate", 0, agent, k, base))
            timings.append(Timing("off", 0, agent, k, 4 * base))
            timings.append(Timing("on", 0, agent, k, 4 * base if k == 0 else factors[(agent, k)] * base, hit_tokens=k))
    timings.append(Timing("on", 0, 1, 2, 99.0, status="DEADLINE_EXCEEDED"))  # errors are counted, not timed
    summary = sessions.summarize(timings)
    on = summary["ratios"]["on"]
    assert on["pairs"] == 4
    assert on["p50"] == pytest.approx((1.1 + 1.2) / 2)
    assert on["within_target"] == pytest.approx(0.75)
    later_base = [0.2, 0.3, 0.3, 0.4]  # agent 0: k=1,2; agent 1: k=1,2
    later_on = [1.2 * 0.2, 1.0 * 0.3, 1.5 * 0.3, 1.1 * 0.4]
    assert on["of_means"] == pytest.approx(sum(later_on) / sum(later_base))
    assert summary["ratios"]["off"]["p50"] == pytest.approx(4.0)
    assert summary["rows"]["on/later"]["n"] == 4
    assert summary["rows"]["on/later"]["hit_tokens"] == 6
    assert summary["rows"]["on/first"]["p50_ms"] == pytest.approx(1e3 * (0.4 + 0.8) / 2)
    assert summary["errors"] == 1
    assert summary["target_met"]
    text = sessions.render(summary, ["# t"], [])
    assert "| cache on | 4 | 1.15x |" in text and "(p50 of the paired ratios): 1.150x, met." in text
    timings[-2].seconds = 10.0  # agent 1's last later request far over: p50 moves past the target
    timings[-5].seconds = 10.0
    assert not sessions.summarize(timings)["target_met"]


def test_small_run_end_to_end(demo_model, tmp_path):
    agent_sessions.main(
        ["--model", str(demo_model), "--out", str(tmp_path), "--agents", "2", "--min-requests", "2"]
        + ["--max-requests", "2", "--max-state-tokens", "700", "--blocks", "1", "--timeout", "60"]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    summary = saved["summary"]
    assert summary["errors"] == 0
    assert summary["rows"]["on/later"]["n"] == 2 and summary["rows"]["on/first"]["n"] == 2
    # the second request of a session hangs from its first; the first of a block's fresh state cannot
    assert summary["rows"]["on/later"]["hit_tokens"] > 500
    assert summary["rows"]["on/first"]["hit_tokens"] < 100  # at most the template before the tag
    cache = saved["run"]["cache"]
    assert 0 < cache["bytes_max"] <= cache["budget_bytes"]
    assert cache["hits"] >= 2 and cache["inserts"] > 0  # warm-up and timed block: one hit each
    assert all(m["rss_peak_bytes"] > 0 for m in saved["run"]["memory"].values())
    assert "later requests / same question with no state" in (tmp_path / "report.md").read_text()

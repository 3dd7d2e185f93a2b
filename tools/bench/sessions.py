"""Agent sessions from the workload, and what their timings say (issue 17's benchmark).

An agent holds one state and asks 4-8 distinct questions about it, one request each, in sequence.
Sessions are built from the JevBench split of `benchmarks/workload.jsonl` (its choice, noul and
score requests; the capacity and multi-question cases probe limits, e.g. 33 options): the states
of its requests that are 500-4,000 tokens long, and its distinct questions. The runner is
`agent_sessions.py`.

The no-state reference is the same question with `"state": ""`: the contract's empty state, which
renders the prompt template with nothing in the state slot, so it is the least a question can cost
(its own tokens and the template's). It is asked of the worker with the cache off, so nothing it
computes is ever reused: the target compares a later request of a session (cache on) with that.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from openjev.tools.bench.harness import percentile
from openjev.tools.bench.report import JEVBENCH_KINDS
from openjev.tools.bench.workload import Case

TARGET_RATIO = 1.3  # later requests (cache on) / the same question with no state


@dataclass(frozen=True)
class Session:
    agent: int
    state: str | dict
    state_tokens: int
    questions: tuple[dict, ...]  # one request each, in this order

    def request(self, k: int, tag: str) -> dict:
        """The k-th request; `tag` makes the state this session's own (a block's sessions would
        otherwise hit the states a previous block left in the cache at their first request)."""
        return {"state": tagged(self.state, tag), "questions": {"q": self.questions[k]}}


def tagged(state: str | dict, tag: str) -> str | dict:
    # at the start, so that the whole state is a new prefix; a few tokens either way
    if isinstance(state, dict):
        return {"session": tag, **state}
    return f"[session {tag}]\n{state}"


def no_state(question: dict) -> dict:
    return {"state": "", "questions": {"q": question}}


def distinct_questions(cases: list[Case]) -> list[dict]:
    """Every distinct question object of the workload, in the order first seen."""
    seen: dict[str, dict] = {}
    for case in cases:
        for q in case.request["questions"].values():
            seen.setdefault(json.dumps(q, sort_keys=True), q)
    return list(seen.values())


def state_lengths(cases: list[Case], longest: Callable[[dict], int], probe: dict) -> dict[str, tuple]:
    """Tokens of each distinct non-empty state: the probe question's longest candidate with the
    state, less the same without it."""
    bare = longest(no_state(probe))
    found: dict[str, tuple] = {}
    for case in cases:
        state = case.request["state"]
        key = json.dumps(state, sort_keys=True)
        if state and key not in found:
            found[key] = (state, longest({"state": state, "questions": {"q": probe}}) - bare)
    return found


def build_sessions(
    cases: list[Case],
    longest: Callable[[dict], int],
    *,
    agents: int,
    min_requests: int = 4,
    max_requests: int = 8,
    min_state_tokens: int = 500,
    max_state_tokens: int = 4000,
    seed: int = 0,
) -> list[Session]:
    """`agents` sessions, each a distinct state within the token range and 4-8 (min..max) distinct
    questions, all drawn with `seed`. Too few states or questions is an error, not fewer sessions."""
    if not 1 <= min_requests <= max_requests:
        raise ValueError(f"requests per session: {min_requests}..{max_requests}")
    cases = [c for c in cases if c.kind in JEVBENCH_KINDS]
    questions = distinct_questions(cases)
    if len(questions) < max_requests:
        raise ValueError(f"the workload has {len(questions)} distinct questions, fewer than {max_requests}")
    lengths = state_lengths(cases, longest, questions[0])
    states = sorted(
        ((s, n) for s, n in lengths.values() if min_state_tokens <= n <= max_state_tokens),
        key=lambda sn: (sn[1], json.dumps(sn[0], sort_keys=True)),
    )
    if len(states) < agents:
        raise ValueError(f"{len(states)} states of {min_state_tokens}-{max_state_tokens} tokens for {agents} agents")
    rng = random.Random(seed)
    chosen = rng.sample(states, agents)
    return [
        Session(a, state, tokens, tuple(rng.sample(questions, rng.randint(min_requests, max_requests))))
        for a, (state, tokens) in enumerate(chosen)
    ]


def interleaved(sessions: list[Session]) -> list[tuple[int, int]]:
    """(agent, k) in round-robin order: every agent's k-th request before any agent's k+1-th; an
    agent whose session is over drops out."""
    longest_session = max(len(s.questions) for s in sessions)
    return [(s.agent, k) for k in range(longest_session) for s in sessions if k < len(s.questions)]


# --- the report ---------------------------------------------------------------------------------


@dataclass
class Timing:
    """One request of a timed block. arm: 'off' / 'on' (the session's request on that worker) or
    'nostate' (its question with no state, on the cache-off worker)."""

    arm: str
    block: int
    agent: int
    k: int  # position in the session (0: the first request)
    seconds: float
    status: str = "OK"
    hit_tokens: int = 0  # from the worker's metrics, cache-on arm only


def _stats(seconds: list[float]) -> dict:
    ms = [1e3 * s for s in seconds]
    nan = float("nan")
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms) if ms else nan,
        "p50_ms": percentile(ms, 0.5),
        "p95_ms": percentile(ms, 0.95),
    }


def summarize(timings: list[Timing]) -> dict:
    """Per arm and position (first request, later ones) the latency; the paired ratios of each
    later request's latency to its question's no-state latency in the same block and step."""
    ok = [t for t in timings if t.status == "OK"]
    rows = {}
    for arm in ("off", "on", "nostate"):
        for position, keep in (("first", lambda t: t.k == 0), ("later", lambda t: t.k > 0)):
            chosen = [t for t in ok if t.arm == arm and keep(t)]
            rows[f"{arm}/{position}"] = _stats([t.seconds for t in chosen]) | {
                "hit_tokens": sum(t.hit_tokens for t in chosen)
            }
    reference = {(t.block, t.agent, t.k): t.seconds for t in ok if t.arm == "nostate"}
    ratios = {}
    for arm in ("on", "off"):
        paired = [
            (t.seconds, reference[(t.block, t.agent, t.k)])
            for t in ok
            if t.arm == arm and t.k > 0 and (t.block, t.agent, t.k) in reference
        ]
        per = [a / b for a, b in paired]
        ratios[arm] = {
            "pairs": len(per),
            "p50": percentile(per, 0.5),
            "p95": percentile(per, 0.95),
            "of_means": (statistics.fmean(a for a, _ in paired) / statistics.fmean(b for _, b in paired))
            if paired
            else float("nan"),
            "within_target": sum(r <= TARGET_RATIO for r in per) / len(per) if per else float("nan"),
        }
    return {
        "rows": rows,
        "ratios": ratios,
        "errors": sum(t.status != "OK" for t in timings),
        "target_ratio": TARGET_RATIO,
        "target_met": ratios["on"]["p50"] <= TARGET_RATIO,
    }


def render(summary: dict, header: list[str], memory: list[str]) -> str:
    r = summary["ratios"]
    lines = [
        *header,
        "",
        "| arm | requests | n | mean ms | p50 ms | p95 ms | cache hit tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"off": "cache off", "on": "cache on", "nostate": "no state (cache off)"}
    for key, row in summary["rows"].items():
        arm, position = key.split("/")
        lines.append(
            f"| {names[arm]} | {position} | {row['n']} | {row['mean_ms']:.1f} | {row['p50_ms']:.1f} "
            f"| {row['p95_ms']:.1f} | {row['hit_tokens'] if arm == 'on' else '-'} |"
        )
    lines += ["", "| later requests / same question with no state | pairs | p50 | p95 | of means | share <= 1.3x |"]
    lines += ["|---|---|---|---|---|---|"]
    for arm in ("on", "off"):
        x = r[arm]
        lines.append(
            f"| cache {arm} | {x['pairs']} | {x['p50']:.2f}x | {x['p95']:.2f}x | {x['of_means']:.2f}x "
            f"| {100 * x['within_target']:.0f}% |"
        )
    verdict = "met" if summary["target_met"] else "missed"
    lines += [
        "",
        f"Target: later requests with the cache on within {summary['target_ratio']}x of the no-state question "
        # three places: at two, 1.304x read "1.30x, missed" against a target of 1.3x
        f"(p50 of the paired ratios): {r['on']['p50']:.3f}x, {verdict}. Errors: {summary['errors']}.",
        "",
        *memory,
    ]
    return "\n".join(lines) + "\n"

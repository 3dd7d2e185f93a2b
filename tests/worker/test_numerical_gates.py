"""Numerical gates (docs/prefix-reuse.md): every prefix policy against `off`, and `off` / `shared` against
the transformers oracle, on a seeded corpus of real requests rendered and tokenized the way the
frontend does it, run on the real TorchRunner (fp32, CPU) over the demo export.

Gates, per policy vs off: max |dp| and max |d score| <= 1e-3, zero choice changes, zero noul
flips at 0.5, zero failures. Oracle (a subset, for CI time): within 1e-4. `make test` runs the
gates on a representative subset of the corpus (every kind, multi-question, many candidates, a
long shared state, the contract example); the whole corpus is `slow` (`make test-all`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from openjev.contract.request import parse_request
from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.planner import CPU_COST_MODEL

SEED = 20261129
POLICY_TOLERANCE = 1e-3
ORACLE_TOLERANCE = 1e-4
WORDS = (
    "the customer order charge refund account invoice payment service login password error "
    "delivery package late damaged team urgent support ticket network outage billing security "
    "access report issue duplicate cancel subscription plan upgrade warranty replace device "
    "screen battery email address shipping tracking number store credit card bank transfer "
    "was is not never again twice yesterday today after before because but and or with without "
    "für café naïve 東京 données сервис 😀 1e-05 -0.0 42 3.14"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def state(rng: random.Random, num_words: int):
    """Text, or a JSON object / array (rendered with sort_keys like the reference)."""
    shape = rng.choice(["text", "text", "object", "array"])
    if shape == "text":
        return words(rng, num_words)
    if shape == "array":
        return [words(rng, 8) for _ in range(max(1, num_words // 8))]
    return {
        f"field_{i}": rng.choice([words(rng, 8), rng.randint(-99, 99), rng.random(), None, True])
        for i in range(max(1, num_words // 8))
    }


def question(rng: random.Random, kind: str, num_options: int | None = None) -> dict:
    if kind == "choice":
        n = num_options or rng.randint(2, 6)
        criteria = {
            f"option_{i}_{rng.choice(WORDS)}": (None if rng.random() < 0.2 else words(rng, rng.randint(2, 10)))
            for i in range(n)
        }
        return {"type": "choice", "instructions": words(rng, rng.randint(4, 14)) + "?", "criteria": criteria}
    if kind == "score":
        n = num_options or rng.randint(2, 10)
        return {
            "type": "score",
            "instructions": words(rng, 8),
            "criteria": [words(rng, rng.randint(3, 9)) for _ in range(n)],
        }
    q = {"type": "noul", "instructions": words(rng, rng.randint(4, 14)) + "?"}
    if rng.random() < 0.5:
        q["criteria"] = {"true": words(rng, 5), "false": words(rng, 5)}
    return q


def corpus() -> list[tuple[str, dict]]:
    """(name, request) pairs; every request shape of the benchmark workload, kept small enough for CPU CI."""
    rng = random.Random(SEED)
    out = []

    def add(name, num_state_words, kinds, num_options=None):
        qs = {f"q{i}": question(rng, kind, num_options) for i, kind in enumerate(kinds)}
        out.append((name, {"state": state(rng, num_state_words), "questions": qs}))

    for i in range(26):
        add(f"choice-{i}", rng.randint(10, 160), ["choice"])
    for i in range(14):
        add(f"noul-{i}", rng.randint(10, 160), ["noul"])
    for i, levels in enumerate([2, 10, 3, 5, 2, 10, 4, 7]):
        add(f"score{levels}-{i}", rng.randint(10, 120), ["score"], levels)
    for n in (3, 4, 8):
        for i in range(2):
            add(f"multi{n}-{i}", rng.randint(40, 200), [rng.choice(["choice", "noul", "score"]) for _ in range(n)])
    for n in (17, 33):
        add(f"choice{n}", 60, ["choice"], n)
        add(f"choice{n}-long", 400, ["choice"], n)
    # Long shared states: a few thousand tokens under every candidate.
    add("long-choice3", 1700, ["choice"], 3)
    add("long-multi3", 1400, ["choice", "noul", "score"])
    add("long-score2", 1200, ["score"], 2)
    out.append(("contract-example", CONTRACT_EXAMPLE))
    return out


CONTRACT_EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples" / "contract_example.json").read_text())


@pytest.fixture(scope="module")
def work(demo_model) -> list[tuple[str, list[QuestionWork]]]:
    from openjev.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.from_export(demo_model)
    requests = []
    for name, obj in corpus():
        compiled = parse_request(obj, accepted_models=())
        requests.append(
            (name, [QuestionWork(q.kind, tuple(map(tuple, tokenizer.encode(q.prompts)))) for q in compiled.questions])
        )
    return requests


@pytest.fixture(scope="module")
def runner(demo_model):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(demo_model, num_threads=2)


@pytest.fixture(scope="module")
def results(work, runner):
    """(policy, request names) -> those requests' ExecutionResults, each computed on first use and
    kept for the module (a run falls inside the test that first needs it, not in one long setup)."""
    engine = Engine(runner, cost_model=CPU_COST_MODEL)
    requests = dict(work)
    cache: dict[tuple[str, str], ExecutionResult] = {}

    def of(policy: str, names: tuple[str, ...]) -> list[ExecutionResult]:
        for name in names:
            if (policy, name) not in cache:
                # Any exception here fails the gate: "zero failures".
                cache[policy, name] = engine.execute(requests[name], temperature=runner.meta.temperature, policy=policy)
        return [cache[policy, name] for name in names]

    return of


# One of each shape the corpus has; the gates on it run in `make test`, on everything in test-all.
REPRESENTATIVE = (
    "choice-0",
    "choice-1",
    "noul-0",
    "noul-1",
    "score2-0",
    "score10-1",
    "multi3-0",
    "multi8-0",
    "choice17",
    "long-choice3",
    "contract-example",
)
CORPORA = [
    pytest.param(REPRESENTATIVE, id="representative"),
    pytest.param(tuple(name for name, _ in corpus()), id="corpus", marks=pytest.mark.slow),
]


def test_corpus_covers_the_shapes(work):
    assert len(work) >= 60
    assert set(REPRESENTATIVE) <= set(dict(work))
    kinds = {q.kind for _, qs in work for q in qs}
    assert kinds == {"choice", "score", "noul"}
    assert {len(qs) for _, qs in work} >= {1, 3, 4, 8}
    assert {len(q.candidates) for _, qs in work for q in qs} >= {1, 2, 10, 17, 33}
    longest = max(len(c) for _, qs in work for q in qs for c in q.candidates)
    assert 2000 <= longest <= 4096
    # The reference tokenizes the contract example to these lengths (shared fixtures).
    contract = dict(work)["contract-example"]
    assert [[len(c) for c in q.candidates] for q in contract] == [[80, 76, 77], [66], [82, 80, 78]]


def argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))


def expected_score(probabilities):
    return sum(i * p for i, p in enumerate(probabilities))


@pytest.mark.parametrize("names", CORPORA)
@pytest.mark.parametrize("policy", ["default", "shared", "fixed", "auto"])
def test_policy_matches_off(work, results, policy, names):
    requests = dict(work)
    max_dp = max_dscore = max_dhead = 0.0
    choice_changes, noul_flips = [], []
    for name, got, off in zip(names, results(policy, names), results("off", names), strict=True):
        questions = requests[name]
        assert got.num_submitted_tokens == off.num_submitted_tokens
        for q, question in enumerate(questions):
            p, p_off = got.probabilities[q], off.probabilities[q]
            max_dp = max(max_dp, max(abs(a - b) for a, b in zip(p, p_off, strict=True)))
            max_dhead = max(
                max_dhead, max(abs(a - b) for a, b in zip(got.head_scores[q], off.head_scores[q], strict=True))
            )
            if question.kind == "score":
                max_dscore = max(max_dscore, abs(expected_score(p) - expected_score(p_off)))
            if question.kind == "noul" and (p[1] > 0.5) != (p_off[1] > 0.5):
                noul_flips.append((name, q))
            if question.kind != "noul" and argmax(p) != argmax(p_off):
                choice_changes.append((name, q))
    print(f"{policy} vs off: max|dp|={max_dp:.2e} max|d score|={max_dscore:.2e} max|d head|={max_dhead:.2e}")
    assert max_dp <= POLICY_TOLERANCE and max_dscore <= POLICY_TOLERANCE
    assert max_dhead <= POLICY_TOLERANCE
    assert choice_changes == [] and noul_flips == []


@pytest.mark.parametrize("names", CORPORA)
def test_sharing_actually_happened(results, names):
    """The gates mean nothing if no policy shared: check each did what it claims."""
    saved = {p: sum(r.num_saved_tokens for r in results(p, names)) for p in ("off", "default", "shared", "fixed")}
    assert saved["off"] == 0
    assert 0 < saved["default"] < saved["shared"]
    assert 0 < saved["fixed"] < saved["shared"]
    assert any(r.scope == "across_questions" for r in results("shared", names))
    assert {r.executed_policy for r in results("auto", names)} == {"shared", "default"}


@pytest.fixture(scope="module")
def oracle(demo_model):
    from safetensors.torch import load_file
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    text_config = json.loads((demo_model / "config.json").read_text())["text_config"]
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config)).float().eval()
    tensors = load_file(demo_model / "model.safetensors")
    model.load_state_dict({k.removeprefix("model.language_model."): t.float() for k, t in tensors.items()}, strict=True)
    return model


ORACLE_SUBSET = ("choice-0", "choice-1", "noul-0", "noul-1", "score2-0", "score10-1", "multi3-0", "contract-example")


@pytest.mark.parametrize("policy", ["off", "shared"])
def test_oracle_agrees(work, results, demo_model, oracle, policy):
    """transformers on each full prompt, head on the last hidden state after the final norm: the
    head vector, bias and temperature as the export's json holds them (not as the runner loaded them)."""
    from export_head import export_json, reference_head_score

    from openjev.contract.answers import question_probabilities

    temperature = float(export_json(demo_model)["temperature"])
    requests = dict(work)
    worst_score = worst_p = 0.0
    for name, got in zip(ORACLE_SUBSET, results(policy, ORACLE_SUBSET), strict=True):
        for q, question in enumerate(requests[name]):
            scores = []
            for tokens in question.candidates:
                with torch.no_grad():
                    hidden = oracle(input_ids=torch.tensor([list(tokens)])).last_hidden_state[0, -1]
                scores.append(reference_head_score(demo_model, hidden))
            p = question_probabilities(question.kind, scores, temperature)
            worst_score = max(worst_score, max(abs(a - b) for a, b in zip(scores, got.head_scores[q], strict=True)))
            worst_p = max(worst_p, max(abs(a - b) for a, b in zip(p, got.probabilities[q], strict=True)))
    print(f"{policy} vs transformers: max|d head|={worst_score:.2e} max|dp|={worst_p:.2e}")
    assert worst_score <= ORACLE_TOLERANCE and worst_p <= ORACLE_TOLERANCE

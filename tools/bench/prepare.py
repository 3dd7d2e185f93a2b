"""Before the servers start: the cases (read, generated, filtered), their token counts, the model's
shape and, on a GPU, the measured ceilings and each case's roofline floor."""

from __future__ import annotations

from pathlib import Path

from openjev.tools.bench import report, workload


def longest_tokens_fn(model: Path):
    from openjev.contract.request import parse_request
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer

    meta = load_export_meta(model)
    tokenizer = PromptTokenizer.from_export(model)

    def candidates(request: dict) -> list[list[list[int]]]:
        decision = parse_request(request, accepted_models=meta.accepted_model_names)
        return [tokenizer.encode(list(q.prompts)) for q in decision.questions]

    return meta, candidates, lambda request: max(len(ids) for q in candidates(request) for ids in q)


def generated(longest, max_length: int, seed: int = 0) -> list[workload.Case]:
    """The whole workload; `seed` moves the split's requests (multi and capacity keep theirs)."""
    return (
        workload.jevbench_cases(longest, seed)
        + workload.multi_question_cases(longest)
        + workload.capacity_cases(longest, max_length)
    )


def stratified(cases: list[workload.Case], per_group: int) -> list[workload.Case]:
    seen: dict[str, int] = {}
    chosen = []
    for case in cases:
        key = report.group_of(case)
        if seen.get(key, 0) < per_group:
            chosen.append(case)
            seen[key] = seen.get(key, 0) + 1
    return chosen


def split_sets(cases: list[workload.Case]) -> dict[str, list[workload.Case]]:
    """The concurrency sweep's sets: the JevBench split and its requests of at most 512 tokens."""
    split = [c for c in cases if c.kind in report.JEVBENCH_KINDS]
    return {"split": split, "short": [c for c in split if c.group in ("1-128", "129-512")]}


def model_config(model: Path, worker_args: list[str]):
    """The config the worker serves: the `--synthetic` shape's (either spelling, as the worker's
    own parser reads it) or the export's."""
    from openjev.worker.main import parser as worker_parser

    synthetic = worker_parser().parse_known_args(["--model", str(model), *worker_args])[0].synthetic
    if synthetic is not None:
        from openjev.worker.cuda.fused_weights import shape_config

        return shape_config(synthetic)
    from openjev.worker.checkpoint.config import load_model_config

    return load_model_config(model)


def token_counts(cases, candidates_of) -> dict[str, tuple[int, int]]:
    """case -> (tokens submitted, tokens of the shared token tree: what the floor computes)."""
    from openjev.worker.planner.plan import PackLimits
    from openjev.worker.planner.policy import plan_request

    tokens = {}
    for case in cases:
        ids = candidates_of(case.request)
        tokens[case.name] = (
            sum(len(t) for q in ids for t in q),
            plan_request(ids, "shared", PackLimits()).num_computed_tokens,
        )
    return tokens


def measure_floors(config, tokens):
    """(ceilings, case -> floor seconds), both None without a GPU. Measured before the servers
    start, so that the ceilings see an idle card and a run cut short still has its floors."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    from openjev.tools.bench import roofline

    ceilings = roofline.measure_ceilings()
    floors = {name: roofline.floor_seconds(config, t[1], ceilings) for name, t in tokens.items()}
    torch.cuda.empty_cache()
    return ceilings, floors

"""The cost model `auto` uses to choose between sharing the whole tree and not.

estimated_seconds(plan) =
    num_launches        * seconds_per_launch      (one read of every weight per forward pass)
  + num_computed_tokens * seconds_per_token       (projections, MLP, GDN recurrence: linear)
  + num_attention_pairs * seconds_per_attention_pair

num_attention_pairs counts (query token, key token) pairs of causal attention: a segment of p
tokens starting at position s attends over s + 1 .. s + p keys, p * s + p * (p + 1) / 2 pairs.
Sharing removes recomputed queries but every query still attends over its whole prompt, so this
term is what shrinks least; it matters once prompts reach thousands of tokens.

Sharing a prefix means the tree is deeper than `off`'s one level, so it can take more launches;
that trade (weight reads against computed tokens) is the whole decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openjev.worker.planner.plan import PackLimits, Plan


@dataclass(frozen=True)
class CostModel:
    seconds_per_launch: float
    seconds_per_token: float
    seconds_per_attention_pair: float

    def __post_init__(self) -> None:
        # off_seconds_at_least bounds off's cost only with no negative term (and auto's choice with it)
        for name, value in vars(self).items():
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def estimated_seconds(self, plan: Plan) -> float:
        return self.seconds(plan.num_launches, plan.num_computed_tokens, num_attention_pairs(plan))

    def seconds(self, launches: int, tokens: int, attention_pairs: int) -> float:
        return (
            launches * self.seconds_per_launch
            + tokens * self.seconds_per_token
            + attention_pairs * self.seconds_per_attention_pair
        )


def num_attention_pairs(plan: Plan) -> int:
    return sum(s.num_tokens * s.start_position + s.num_tokens * (s.num_tokens + 1) // 2 for s in plan.segments)


def off_seconds_at_least(cost_model: CostModel, lengths: Sequence[int], limits: PackLimits) -> float:
    """At most estimated_seconds of the `off` plan of prompts of these lengths, found without
    planning it (65,536 candidates: ~3 s of planning, with the GIL held). `off` computes every
    prompt whole, so its tokens are their sum and its pairs each prompt's L (L + 1) / 2 however
    it is cut; its passes are at least what the budget's tokens and segments (one a prompt at
    least) need. Summed by `seconds`, as estimated_seconds is, so the bound holds in floats too."""
    tokens = sum(lengths)
    passes = max(-(-tokens // limits.max_tokens), -(-len(lengths) // limits.max_sequences))
    return cost_model.seconds(passes, tokens, sum(n * (n + 1) // 2 for n in lengths))


# CPU: the PyTorch fp32 runner on the embedded demo model. Fitted by weighted least squares to
# single-launch timings over 1-16 sequences x 8-2048 tokens x 0-3072 tokens of context
# (benchmarks/prefix_cpu.py --threads 1 --fit; docs/prefix-reuse.md has the fit and how well it
# predicts the measured off and shared latencies). A launch's fixed cost is Python and per-layer
# op dispatch; the attention term is large because the CPU path materializes the score matrices.
CPU_COST_MODEL = CostModel(
    seconds_per_launch=5.7e-3,
    seconds_per_token=8.4e-5,
    seconds_per_attention_pair=2.4e-8,
)

# GPU: the 27B shape on one H200 (docs/prefix-reuse.md). Launch = the weight read, ~54 GB at
# ~4.3 TB/s = 12 ms. Token: 2 * 27e9 FLOP / 790 TFLOP/s = 68 us at the roofline; doubled for the GDN
# recurrence, norms and realistic GEMM efficiency. Attention pair: SDPA measured 4.96 ms per
# layer at 16,384 causal tokens (1.34e8 pairs) over 16 attention layers = 5.9e-10 s.
GPU_COST_MODEL = CostModel(
    seconds_per_launch=12.0e-3,
    seconds_per_token=1.4e-4,
    seconds_per_attention_pair=6.0e-10,
)


def default_cost_model(backend: str) -> CostModel:
    if backend == "cuda":
        return GPU_COST_MODEL
    if backend == "torch":
        return CPU_COST_MODEL
    raise ValueError(f"no default cost model for backend {backend!r}")

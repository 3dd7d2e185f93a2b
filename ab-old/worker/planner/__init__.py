"""Prefix-reuse planner: token trees, policies, packing and the auto cost model (ints only)."""

from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.planner.cost import (
    CPU_COST_MODEL,
    GPU_COST_MODEL,
    CostModel,
    default_cost_model,
)
from openjev.worker.planner.plan import (
    PackLimits,
    Plan,
    Reader,
    Segment,
)
from openjev.worker.planner.policy import build_tree, plan_request

__all__ = [
    "CPU_COST_MODEL",
    "GPU_COST_MODEL",
    "GDN_CHUNK_TOKENS",
    "CostModel",
    "PackLimits",
    "Plan",
    "Reader",
    "Segment",
    "build_tree",
    "default_cost_model",
    "plan_request",
]

"""The capacity planner: how to split a machine between rollout workers and the trainer (CPU
threads, `model` and `measure`) or an accelerator node's devices (`devices`); `tidal plan` is
`command`. What the launcher uses is re-exported here."""

from tidal.plan.measure import cached_profile
from tidal.plan.model import ElasticPool, Prediction, Profile, Split, apply_plan, format_pool, planned_tail, recommend_pool, wants_plan

__all__ = [
    "ElasticPool",
    "Prediction",
    "Profile",
    "Split",
    "apply_plan",
    "cached_profile",
    "format_pool",
    "planned_tail",
    "recommend_pool",
    "wants_plan",
]

"""RL algorithms as small pure functions over tensors, each testable alone; advantages and policy losses are registered by name.

The package imports its modules (and torch) when one of their names is first used: `tidal.algo.names`, the
built-in names the config checks, is read without torch."""

import importlib

_EXPORTS = {
    "advantages": (
        "ADVANTAGES",
        "AdvantageFn",
        "advantage_fn",
        "compute_advantages",
        "dr_grpo_advantages",
        "grpo_advantages",
        "register_advantage",
        "rloo_advantages",
    ),
    "aggregation": ("AGGREGATIONS", "aggregate_loss", "aggregate_numerator"),
    "kl": ("KL_ESTIMATORS", "kl_estimate", "kl_reward_penalty"),
    "logprobs": ("token_logprobs_from_logits",),
    "losses": (
        "POLICY_LOSSES",
        "PolicyLossFn",
        "gspo_token_loss",
        "policy_loss_fn",
        "policy_token_loss",
        "ppo_clip_token_loss",
        "register_policy_loss",
        "sequence_log_ratio",
    ),
    "shaping": ("has_no_signal", "logprob_mismatch", "overlong_penalty", "sampled_only", "stale_token_weights", "truncated_importance_weights"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tidal.algo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tidal.algo.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

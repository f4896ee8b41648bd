"""KL(policy || reference) estimators from policy samples (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from tidal.algo.names import KL_ESTIMATORS


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}: choose from {list(KL_ESTIMATORS)}")


def kl_reward_penalty(rewards: torch.Tensor, kl_tok: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """KL as a reward penalty: each sequence's reward minus coef * its summed per-token KL."""
    return rewards - coef * (kl_tok * mask).sum(-1)

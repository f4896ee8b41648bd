"""Group advantages from one group's rewards [G]."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: mean-centred within the group, optionally divided by the group's (unbiased) std."""
    centred = rewards - rewards.mean()
    if std_normalize and rewards.numel() > 1:
        return centred / (rewards.std(unbiased=True) + eps)
    return centred


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: mean-centred only (no std division, which biases towards easy/hard prompts)."""
    return rewards - rewards.mean()


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's baseline is the mean reward of the *other* samples of its group."""
    g = rewards.numel()
    if g < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (g - 1)


ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def compute_advantages(estimator: str, rewards: torch.Tensor, std_normalize: bool = True) -> torch.Tensor:
    if estimator == "grpo":
        return grpo_advantages(rewards, std_normalize)
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}: choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[estimator](rewards)

"""Advantages, policy losses and KL estimators: pure functions, each testable alone."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages for one group's rewards [G]: mean-centred, optionally / std."""
    centred = rewards - rewards.mean()
    if std_normalize:
        return centred / (rewards.std(unbiased=True) + eps) if rewards.numel() > 1 else centred
    return centred


def ppo_clip_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss and the mask of tokens where the clipped branch was taken.

    `advantages` broadcasts against `logp` ([B, T] tokens, [B, 1] per sequence).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).detach()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), per position."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)

"""Sample-level shaping: DAPO's dynamic-sampling filter, overlong penalty, truncated IS."""

from __future__ import annotations

import torch


def has_no_signal(rewards: torch.Tensor) -> bool:
    """All rewards of the group equal (or fewer than two): every advantage estimator gives exactly zero, and
    DAPO's dynamic sampling drops the group."""
    return rewards.numel() < 2 or bool((rewards == rewards[0]).all())


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer, then linear down to -factor."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -factor * torch.clamp(over / buffer, max=1.0)


def sampled_only(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token `values` on the tokens the policy sampled (`loss_mask` True), exactly 0 on the
    tokens the environment or the chat template inserted. Log-probs pass through this before any
    per-token term is formed, so an inserted token adds neither loss nor gradient, and its log-prob
    (a tool's output can sit far in the policy's tail) cannot overflow a ratio or a KL estimate and
    turn a masked sum into inf * 0 = nan."""
    return torch.where(loss_mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(pi_old / pi_rollout, cap): corrects the engine-vs-trainer mismatch. Returns (weights, truncated)."""
    ratio = torch.exp(old_logp - rollout_logp).detach()
    return ratio.clamp(max=cap), ratio > cap


def stale_token_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, stale: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO per token: min(pi_prox / pi_behaviour, cap) on the `stale` tokens (sampled by a version
    older than the proximal policy, each against its own behaviour log-prob), exactly 1 on the others.
    Returns (weights, truncated)."""
    weights, truncated = truncated_importance_weights(old_logp, rollout_logp, cap)
    stale = stale.bool()
    return torch.where(stale, weights, torch.ones_like(weights)), truncated & stale


def logprob_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |Δ log-prob| between the trainer's and the engine's view of the same tokens."""
    mask = mask.to(old_logp.dtype)
    return float(((old_logp - rollout_logp).abs() * mask).sum() / mask.sum().clamp(min=1))

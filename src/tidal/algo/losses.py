"""Per-token policy losses. Tensors are [B, T] over response tokens; advantages are [B, 1]."""

from __future__ import annotations

import torch


def ppo_clip_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip with DAPO's asymmetric range [1-clip_low, 1+clip_high] ("clip-higher").

    Returns the per-token loss and the mask of tokens where the clipped branch was taken.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio: mean over each sequence's tokens [B, 1]."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    return ((logp - old_logp) * mask).sum(-1, keepdim=True) / lengths


def gspo_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO(-token): the clipped ratio is the sequence-level s_i = exp(mean_t log r_t).

    Each token carries sg[s_i] * pi(y_t)/sg[pi(y_t)], so the value is the sequence ratio while the
    gradient flows through every token, as in the GSPO paper's token variant.
    """
    seq_ratio = torch.exp(sequence_log_ratio(logp, old_logp, mask)).detach()
    ratio = seq_ratio * torch.exp(logp - logp.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


POLICY_LOSSES = ("ppo_clip", "gspo")


def policy_token_loss(
    name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "ppo_clip":
        return ppo_clip_token_loss(logp, old_logp, advantages, clip_low, clip_high)
    if name == "gspo":
        return gspo_token_loss(logp, old_logp, advantages, mask, clip_low, clip_high)
    raise ValueError(f"unknown policy loss {name!r}: choose from {list(POLICY_LOSSES)}")

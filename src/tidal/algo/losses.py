"""Per-token policy losses, registered by name. Tensors are [B, T] over response tokens; advantages are [B, 1].

Every loss is called as ``fn(logp, old_logp, advantages, *, mask, clip_low, clip_high)`` and returns the
per-token loss and the mask of tokens where the clipped branch was taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from tidal.algo import names
from tidal.algo.registry import add, check_built_ins, lookup


class PolicyLossFn(Protocol):
    def __call__(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, mask: torch.Tensor, clip_low: float, clip_high: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


L = TypeVar("L", bound=PolicyLossFn)

POLICY_LOSSES: dict[str, PolicyLossFn] = {}
_KIND = "policy loss"


def register_policy_loss(name: str) -> Callable[[L], L]:
    """``@register_policy_loss("name")`` makes ``fn(logp, old_logp, advantages, *, mask, clip_low, clip_high)`` a valid `trainer.policy_loss`."""

    def register(fn: L) -> L:
        add(POLICY_LOSSES, _KIND, name, fn)
        return fn

    return register


def policy_loss_fn(name: str) -> PolicyLossFn:
    return lookup(POLICY_LOSSES, _KIND, name)


def policy_token_loss(
    name: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return policy_loss_fn(name)(logp, old_logp, advantages, mask=mask, clip_low=clip_low, clip_high=clip_high)


@register_policy_loss("ppo_clip")
def ppo_clip_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip with DAPO's asymmetric range [1-clip_low, 1+clip_high] ("clip-higher"); per token, so `mask` is unused."""
    ratio = torch.exp(logp - old_logp)
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio: mean over each sequence's tokens [B, 1]."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    return ((logp - old_logp) * mask).sum(-1, keepdim=True) / lengths


@register_policy_loss("gspo")
def gspo_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO(-token): the clipped ratio is the sequence-level s_i = exp(mean_t log r_t).

    Each token carries sg[s_i] * pi(y_t)/sg[pi(y_t)], so the value is the sequence ratio while the
    gradient flows through every token, as in the GSPO paper's token variant.
    """
    seq_ratio = torch.exp(sequence_log_ratio(logp, old_logp, mask)).detach()
    ratio = seq_ratio * torch.exp(logp - logp.detach())
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r * A, clip(r, 1-clip_low, 1+clip_high) * A) per token, and where the clipped branch won."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


check_built_ins(POLICY_LOSSES, _KIND, names.POLICY_LOSSES)

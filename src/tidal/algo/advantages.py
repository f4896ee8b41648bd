"""Group advantages from one group's rewards [G], registered by name.

Every estimator is called as ``fn(rewards, *, std_normalize)`` and returns [G] in the rewards' dtype;
``std_normalize`` is a request that estimators without a std division ignore. A group whose rewards are
all equal carries no signal and must get exactly zero advantage: the learner skips such groups and
DAPO's dynamic sampling drops them (`has_no_signal`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from tidal.algo import names
from tidal.algo.registry import add, check_built_ins, lookup
from tidal.algo.shaping import has_no_signal


class AdvantageFn(Protocol):
    def __call__(self, rewards: torch.Tensor, *, std_normalize: bool) -> torch.Tensor: ...


A = TypeVar("A", bound=AdvantageFn)

ADVANTAGES: dict[str, AdvantageFn] = {}
_KIND = "advantage estimator"


def register_advantage(name: str) -> Callable[[A], A]:
    """``@register_advantage("name")`` makes ``fn(rewards, *, std_normalize)`` a valid `trainer.advantage`."""

    def register(fn: A) -> A:
        add(ADVANTAGES, _KIND, name, fn)
        return fn

    return register


def advantage_fn(name: str) -> AdvantageFn:
    return lookup(ADVANTAGES, _KIND, name)


def compute_advantages(estimator: str, rewards: torch.Tensor, std_normalize: bool = True) -> torch.Tensor:
    return advantage_fn(estimator)(rewards, std_normalize=std_normalize)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: mean-centred within the group, optionally divided by the group's (unbiased) std."""
    if has_no_signal(rewards):
        # Equal rewards that floats cannot represent (0.1, 1/3) have a mean off by an ulp; divided by
        # (std + eps) with std ~ 0, that rounding would become an advantage of ~1e-2.
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    if std_normalize:
        return centred / (rewards.std(unbiased=True) + eps)
    return centred


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, *, std_normalize: bool = False) -> torch.Tensor:
    """Dr.GRPO: mean-centred only; never divided by the std (which biases towards easy/hard prompts)."""
    return grpo_advantages(rewards, std_normalize=False)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, *, std_normalize: bool = False) -> torch.Tensor:
    """RLOO: each sample's baseline is the mean reward of the *other* samples of its group (no std division)."""
    if has_no_signal(rewards):  # also G < 2: no other sample to form a baseline
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (rewards.numel() - 1)


check_built_ins(ADVANTAGES, _KIND, names.ADVANTAGES)

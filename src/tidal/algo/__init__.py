"""RL algorithms as small pure functions over tensors."""

from tidal.algo.core import (  # noqa: F401
    grpo_advantages,
    kl_estimate,
    ppo_clip_token_loss,
    token_logprobs_from_logits,
    entropy_from_logits,
)

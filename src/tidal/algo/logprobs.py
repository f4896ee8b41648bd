"""Log-probs of chosen tokens from logits."""

from __future__ import annotations

import torch


def token_logprobs_from_logits(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``target_ids`` (and entropy) under ``softmax(logits / temperature)``, in float32."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logprobs = log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_logprobs, entropy

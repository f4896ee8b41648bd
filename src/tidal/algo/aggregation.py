"""Loss aggregation under streaming (docs/design.md §3.2).

Each mode is a numerator, summed group by group as groups arrive, and a count of units (tokens or
sequences) known only when the last group is in. loss = Σ numerators / Σ units; because gradients
are linear in the loss, scaling the accumulated gradient by 1/Σ units at the step is exact.
"""

from __future__ import annotations

import torch

from tidal.algo.names import LOSS_AGGREGATIONS as AGGREGATIONS


def aggregate_numerator(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str, constant: float | None = None) -> tuple[torch.Tensor, float]:
    """(numerator, units) of one group's per-token loss [G, T] under `mode`."""
    mask = mask.to(loss_tok.dtype)
    if mode == "token_mean":
        return (loss_tok * mask).sum(), float(mask.sum())
    per_seq_sum = (loss_tok * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).sum(), float(mask.shape[0])
    if mode == "seq_mean_token_sum_norm":
        if not constant:
            raise ValueError("seq_mean_token_sum_norm needs a constant normaliser (e.g. the max response length)")
        return (per_seq_sum / constant).sum(), float(mask.shape[0])
    raise ValueError(f"unknown loss aggregation {mode!r}: choose from {list(AGGREGATIONS)}")


def aggregate_loss(losses: list[torch.Tensor], masks: list[torch.Tensor], mode: str, constant: float | None = None) -> torch.Tensor:
    """The whole-batch loss, for reference and tests: Σ numerators / Σ units."""
    parts = [aggregate_numerator(l, m, mode, constant) for l, m in zip(losses, masks)]
    return sum(n for n, _ in parts) / sum(u for _, u in parts)

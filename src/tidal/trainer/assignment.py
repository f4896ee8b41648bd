"""Which rank trains which group: a deterministic, token-balanced assignment every rank computes alike."""

from __future__ import annotations

from tidal.protocol import Group


def group_token_count(group: Group) -> int:
    """Tokens one group costs in the shared-prompt layout: the prompt once, plus every response."""
    return len(group.prompt_ids) + sum(len(s.token_ids) for s in group.samples)


def assign_groups(token_counts: list[int], world_size: int) -> list[list[int]]:
    """Indices of the groups per rank: longest first onto the least-loaded rank (ties: the lower
    rank), each rank's list in arrival order. The same input gives the same answer on every rank."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += token_counts[i]
    return [sorted(share) for share in shares]

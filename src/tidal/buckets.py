"""Grouping by length: one call per group of similar lengths instead of one call padded to the longest."""

from __future__ import annotations

from collections.abc import Sequence

SHORT_RESPONSE_BITS = 4  # lengths up to 2**4 share one bucket: a call's dispatch costs more than their padding


def length_buckets(lengths: Sequence[int], short_bits: int = SHORT_RESPONSE_BITS) -> list[list[int]]:
    """Indices of `lengths` grouped by the power of two above each length, shortest first, every length up
    to 2**short_bits in the first: beyond that a group's longest is at most twice its shortest, so a call
    over a group costs at most twice what it would with no padding at all, in about log2(longest / 2**short_bits) calls."""
    buckets: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        buckets.setdefault(max(short_bits, max(0, length - 1).bit_length()), []).append(i)
    return [buckets[b] for b in sorted(buckets)]

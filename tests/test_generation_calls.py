"""How a worker splits its pulled work items into engine calls (rollout.generation_token_budget,
rollout.first_call_groups): pure functions, no engine."""

from __future__ import annotations

import pytest

from tidal.rollout.generator import generation_chunks


def sizes(chunks: list[range]) -> list[int]:
    return [len(c) for c in chunks]


def covers_in_order(chunks: list[range], n: int) -> bool:
    return [i for c in chunks for i in c] == list(range(n))


@pytest.mark.parametrize(
    ("n", "budget", "cap", "expected"),
    [
        (28, 4096, None, [28]),  # 28 groups of 8 x (8 + 10) tokens fit 4096
        (29, 4096, None, [15, 14]),  # one over: two calls, evened out, not 28 + 1
        (5, 4096, 2, [2, 2, 1]),
        (3, 10, None, [1, 1, 1]),  # a group larger than the budget still gets a call of its own
    ],
)
def test_calls_hold_what_the_token_budget_allows_evened_out(n, budget, cap, expected):
    chunks = generation_chunks([8] * n, 8, 10, budget, cap)
    assert sizes(chunks) == expected and covers_in_order(chunks, n)


@pytest.mark.parametrize(
    ("n", "first", "expected"),
    [
        (28, 4, [4, 24]),
        (40, 4, [4, 18, 18]),  # the rest is chunked by the budget as before
        (3, 4, [3]),  # no more than the first call would hold: one call
        (1, 1, [1]),
    ],
)
def test_the_first_call_holds_first_call_groups_and_the_rest_follow(n, first, expected):
    chunks = generation_chunks([8] * n, 8, 10, 4096, None, first)
    assert sizes(chunks) == expected and covers_in_order(chunks, n)


def test_the_first_call_never_exceeds_the_budget_or_the_cap():
    assert sizes(generation_chunks([8] * 6, 8, 10, 4096, 1, 4)) == [1] * 6  # deterministic mode's one group per call
    assert sizes(generation_chunks([8] * 6, 8, 10, 4096, 2, 4)) == [2, 2, 2]
    long_prompts = [200] * 6  # 8 x 210 tokens a group: two fit 4096
    assert sizes(generation_chunks(long_prompts, 8, 10, 4096, None, 4)) == [2, 2, 2]

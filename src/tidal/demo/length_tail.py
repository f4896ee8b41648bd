"""Responses of long-tailed length for the tiny model (model.warm_start.length_tail): each answer of the
synthetic warm-start data (the single-turn answer line; with rollout.agent, the first turn, a tool call
or an answer) follows a scratch pad of dots whose length is drawn from a heavy-tailed distribution, so the
warm-started policy writes responses whose lengths are long-tailed, as a reasoning model's are. Benchmarks
then measure what long responses cost each mode (`tidal bench modes --set model.warm_start.length_tail...`).

Lengths are log-normal, given like rollout.agent.tool_latency by a median and the ratio of the 99th
percentile to the median (tidal.envs.latency); example n's length is drawn from a generator seeded with
(seed, n), and cut so the pad, the answer and the end-of-sequence token fit one turn
(rollout.max_new_tokens). The pad is nothing the reward reads or a tool-call parser finds: a line of dots,
then the answer on a line of its own, so the policy learns only how long to write.
"""

from __future__ import annotations

import logging

from tidal.envs.latency import lognormal_draw

log = logging.getLogger(__name__)

PAD = "."


def scratch_length(p50_tokens: int, p99_over_p50: float, seed: int, example: int) -> int:
    """Example `example`'s pad length before any cut: log-normal, at least one token."""
    return max(1, round(lognormal_draw(p50_tokens, p99_over_p50, f"tidal-length-tail:{seed}:{example}")))


def with_scratch(answer: str, length: int) -> str:
    """`answer` after a pad of `length` tokens (none for 0)."""
    return f"{PAD * length}\n{answer}" if length > 0 else answer


def scratch_room(answer_tokens: int, max_new_tokens: int) -> int:
    """The longest pad that leaves room in one turn for the newline, the answer and the end-of-sequence token."""
    return max(0, max_new_tokens - answer_tokens - 2)


class ScratchPads:
    """model.warm_start.length_tail for one warm start: `pad(n, answer, answer_tokens)` is example n's
    answer with its pad, cut to fit; `cut` counts the pads that were cut (logged by `report`)."""

    def __init__(self, p50_tokens: int, p99_over_p50: float, seed: int, max_new_tokens: int):
        self.p50, self.ratio, self.seed, self.max_new_tokens = p50_tokens, p99_over_p50, seed, max_new_tokens
        self.lengths: list[int] = []
        self.cut = 0

    @classmethod
    def from_config(cls, cfg, seed: int) -> ScratchPads | None:
        tail = cfg.model.warm_start.length_tail
        return None if tail is None else cls(tail.p50_tokens, tail.p99_over_p50, seed, cfg.rollout.max_new_tokens)

    def pad(self, example: int, answer: str, answer_tokens: int) -> str:
        drawn = scratch_length(self.p50, self.ratio, self.seed, example)
        length = min(drawn, scratch_room(answer_tokens, self.max_new_tokens))
        self.cut += length < drawn
        self.lengths.append(length)
        return with_scratch(answer, length)

    def report(self) -> None:
        if not self.lengths:
            return
        ordered = sorted(self.lengths)
        p50, p99 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        log.info("warm start: scratch pads of %d tokens at the median, %d at p99, %d the longest", p50, p99, ordered[-1])
        if self.cut > len(self.lengths) // 100:
            log.warning(
                "model.warm_start.length_tail: %d of %d scratch pads were cut to fit rollout.max_new_tokens (%d) with their answer; "
                "raise it for the tail asked for",
                self.cut,
                len(self.lengths),
                self.max_new_tokens,
            )

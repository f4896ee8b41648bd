"""How often a reward fails, and the error that stops a run when it fails too often (a function that
raises on every sample, a reward server that no longer answers): the run would train on zeros."""

from __future__ import annotations

from collections import deque


class RewardFailingError(RuntimeError):
    """A reward failed more than its max_error_rate: the run stops (one line, naming the reward)."""


class FailureWindow:
    """The outcome of the last `size` calls; `too_many` when more than `rate` of `size` failed."""

    def __init__(self, size: int, rate: float):
        self.outcomes: deque[bool] = deque(maxlen=size)
        self.size, self.rate = size, rate

    def record(self, failed: bool) -> None:
        self.outcomes.append(failed)

    @property
    def failures(self) -> int:
        return sum(self.outcomes)

    def too_many(self) -> bool:
        return self.failures > self.rate * self.size

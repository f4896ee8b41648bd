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


FIRST_ERROR_CHARS = 300  # of the first error's text: enough to say what is wrong, small on the wire

# A tally is [calls, failed, first error's text]: what a group carries per name (Group.failures), as msgpack
Tally = list


class FailureLedger:
    """Calls and failures per name since the last `take`, with the first failure's text: each reward
    (a function's label or a served reward's), an environment's step() and reward(). The groups carry
    it to the trainer, which stops a run whose reward fails every call of its first iteration and
    whose end-of-run table names every failing one. Thread-safe: an environment steps on threads."""

    def __init__(self) -> None:
        import threading

        self.tallies: dict[str, Tally] = {}
        self.lock = threading.Lock()

    def record(self, name: str, failed: bool, error: str | None = None, calls: int = 1) -> None:
        """`calls` calls of `name`; all of them failed when `failed` (the first with `error`)."""
        with self.lock:
            tally = self.tallies.setdefault(name, [0, 0, ""])
            tally[0] += calls
            if failed:
                tally[1] += calls
                tally[2] = tally[2] or (error or "failed")[:FIRST_ERROR_CHARS]

    def take(self) -> dict[str, Tally] | None:
        """The tallies since the last take (None when nothing was called), and a fresh start."""
        with self.lock:
            tallies, self.tallies = self.tallies, {}
        return tallies or None


def merge_tallies(into: dict[str, Tally], tallies: dict[str, Tally] | None) -> dict[str, Tally]:
    """`tallies` added to `into` (in place, returned): calls and failures summed, the earliest first error kept."""
    for name, (calls, failed, error) in (tallies or {}).items():
        total = into.setdefault(name, [0, 0, ""])
        total[0] += calls
        total[1] += failed
        total[2] = total[2] or error
    return into


def failing_every_call(tallies: dict[str, Tally], names: dict[str, float]) -> tuple[str, Tally] | None:
    """The first of `names` (reward label -> its max_error_rate) that failed every one of its calls,
    when it tolerates less than all of them failing (max_error_rate 1 trains on regardless)."""
    for name, rate in names.items():
        calls, failed, _ = tallies.get(name, (0, 0, ""))
        if calls and failed == calls and rate < 1:
            return name, tallies[name]
    return None


def over_their_rate(tallies: dict[str, Tally], rate_of) -> list[str]:
    """The names whose failures exceed `rate_of(name)` of their calls, over however many calls they
    made: a short run is judged on what it did, not only once a whole error window is in."""
    return [name for name, (calls, failed, _) in tallies.items() if failed and failed > rate_of(name) * calls]

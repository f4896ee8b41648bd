"""User reward functions for tests (loaded as `tests.rewards:NAME`, as a user's would be)."""


def digit_count(completion: str, answer: str) -> float:
    """A graded reward that differs between samples, so every group has a non-zero advantage."""
    return float(sum(c.isdigit() for c in completion))


def slow_exact_match(completion: str, answer: str) -> float:
    """A reward that takes a while, so an iteration lasts long enough to be interrupted in a test."""
    import time

    from tidal.rewards import exact_match

    time.sleep(0.05)
    return exact_match(completion, answer)


def median_baseline(rewards, *, std_normalize):
    """A user's advantage estimator, named `tests.rewards:median_baseline` in a config."""
    return rewards - rewards.median()


def digit_fraction(completion: str, answer: str) -> float:
    """The share of digits among the completion's characters: a reward a policy can learn within a
    few steps from any start, so a test can tell an update that learns from one that does not."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def nan_advantage(rewards, *, std_normalize):
    """A user's advantage estimator with a bug: every advantage is NaN, so the loss is NaN."""
    return rewards * float("nan")

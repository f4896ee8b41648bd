"""User reward functions for tests (loaded as `tests.rewards:NAME`, as a user's would be)."""


def digit_count(completion: str, answer: str) -> float:
    """A graded reward that differs between samples, so every group has a non-zero advantage."""
    return float(sum(c.isdigit() for c in completion))

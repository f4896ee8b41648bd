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


REWARD_GATE_ENV = "TIDAL_TEST_REWARD_GATE"


def paced_exact_match(completion: str, answer: str) -> float:
    """Slower still, so a worker can join mid-run; while the file $TIDAL_TEST_REWARD_GATE exists it
    waits, so a test can hold the run at a point of its choosing (a worker's start on a loaded machine
    can outlast a whole run). Waiting changes no score: the run trains the same groups, later."""
    import os
    import time

    from tidal.rewards import exact_match

    gate = os.environ.get(REWARD_GATE_ENV)
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    time.sleep(0.15)
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


# Misbehaving user rewards: the isolation tests run them in real reward processes.
def hangs(completion: str, answer: str) -> float:
    import time

    time.sleep(3600)
    return 1.0


def crashes(completion: str, answer: str) -> float:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def exits(completion: str, answer: str) -> float:
    import sys

    sys.exit(3)


def chatty(completion: str, answer: str) -> float:
    """Prints to stdout, as user code does: the reward protocol must not read it."""
    print("a line on stdout", completion)
    return 0.25


def _first_call(name: str) -> bool:
    """True the first time in a run (a marker file in $TIDAL_TEST_MARKERS), so a run misbehaves once."""
    import os
    from pathlib import Path

    marker = Path(os.environ["TIDAL_TEST_MARKERS"]) / name
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def hangs_once(completion: str, answer: str) -> float:
    return hangs(completion, answer) if _first_call("hangs") else 0.0


def crashes_once(completion: str, answer: str) -> float:
    return crashes(completion, answer) if _first_call("crashes") else 0.0


def exits_once(completion: str, answer: str) -> float:
    return exits(completion, answer) if _first_call("exits") else 0.0


def terminates_worker_once(completion: str, answer: str) -> float:
    """The first time in a run: notes every process its worker started ($TIDAL_TEST_MARKERS/worker-terminated.json,
    pid: start time) and sends the worker SIGTERM, as a preemption would."""
    if _first_call("terminate-worker"):
        import json
        import os
        import signal
        from pathlib import Path

        from tests.processes import descendants_of, started_at

        worker = os.getppid()
        started = {pid: started_at(pid) for pid in descendants_of(worker)}
        (Path(os.environ["TIDAL_TEST_MARKERS"]) / "worker-terminated.json").write_text(json.dumps({"worker": worker, "started": started}))
        os.kill(worker, signal.SIGTERM)
    return 0.0


def trl_style(completions, **kwargs) -> list[float]:
    """A reward written for TRL's GRPOTrainer: a batch in, a list out."""
    return [float(len(c)) for c in completions]


def raises_without_an_answer(completion: str, answer: str) -> float:
    """A strict parser: raises where the completion has no `A:` line (a reward that fails by design)."""
    if "A:" not in completion:
        raise ValueError("no answer")
    return 1.0

"""User reward functions (`module:function`) run in a worker-owned process (tidal.hosted), so that a
hang, a crash or `sys.exit` in user code costs one score (0, counted as a reward error), never the
worker. The process is a fresh interpreter (`python -m tidal.rewards.host`): only str and float cross
the boundary. A call that outlives `reward.timeout_seconds`, or a process that dies, fails that call;
the process is killed and a new one starts at the next call."""

from __future__ import annotations

from tidal.hosted import HostCallError, HostProcess


class RewardError(ValueError):
    """A reward function cannot be found or loaded."""


def reward_process(names: list[str], timeout: float, memory_mb: int | None = None, cpu_seconds: int | None = None) -> HostProcess:
    """The user functions' process, in the sandbox (tidal.sandbox), with the limits of tools:
    reward.memory_mb for its whole tree, reward.cpu_seconds per call."""
    limits = [f"--memory-mb={memory_mb}"] if memory_mb else []
    limits += [f"--cpu-seconds={cpu_seconds}"] if cpu_seconds else []
    return HostProcess("tidal.rewards.host", [*limits, *names], timeout, "reward.timeout_seconds", memory_mb=memory_mb)


def remote_reward(process: HostProcess, name: str):
    """The reward function `name` as run in `process`: raises HostCallError when it fails there."""

    def call(completion: str, answer: str) -> float:
        reply = process.request({"fn": name, "completion": completion, "answer": answer})
        if "error" in reply:
            kind, _, detail = reply["error"].partition(": ")
            raise HostCallError(kind, detail)
        return float(reply["value"])

    return call

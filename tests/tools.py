"""Tools for the isolation tests (named `tests.tools:NAME` in rollout.agent.tools, as a user's would be):
misbehaving ones run in a real tool process."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from tests.processes import command, descendants_of, started_at
from tests.rewards import _first_call
from tidal.envs import Environment, ParsedTurn, ToolCall


def pid() -> int:
    """The process the tool runs in."""
    return os.getpid()


def slow_pid() -> int:
    """Its process id, after a moment (calls from several threads overlap)."""
    time.sleep(0.5)
    return os.getpid()


def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return "woke"


def crash() -> str:
    """Kills its own process."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def exit_now() -> str:
    """Ends its process without a word."""
    os._exit(3)


def spin() -> str:
    """Burns CPU forever."""
    while True:
        pass


def hog() -> str:
    """Allocates 8 GiB and touches it."""
    block = bytearray(8 << 30)
    return str(len(block))


def boom(reason: str = "kaboom") -> str:
    """Raises.

    Args:
        reason: The message.
    """
    raise RuntimeError(reason)


def flood() -> str:
    """Returns 10 MB of text."""
    return "x" * 10_000_000


def shout() -> str:
    """Prints 5 MB to stdout, returns a short answer."""
    for _ in range(5000):
        print("y" * 1000)
    return "said"


def hang_once() -> str:
    """Hangs the first time in a run."""
    return hang() if _first_call("hang") else "ok"


def crash_once() -> str:
    """Kills its process the first time in a run."""
    return crash() if _first_call("crash") else "ok"


def exit_once() -> str:
    """Exits its process the first time in a run."""
    return exit_now() if _first_call("exit") else "ok"


SABOTAGE = ("hang_once", "crash_once", "exit_once", "boom", "flood", "shout")


class Saboteur(Environment):
    """Calls every misbehaving tool on a trajectory's first turn, whatever the policy wrote; the
    second turn is the answer."""

    def parse(self, assistant_text: str) -> ParsedTurn:
        if self.stats.turns:
            return ParsedTurn(assistant_text)
        return ParsedTurn(assistant_text, [ToolCall(name, {}) for name in SABOTAGE])


def grip() -> str:
    """Holds the interpreter in C for ever (a regular expression that backtracks without end): no
    other thread of its process runs, so only a signal ends it."""
    return str(re.fullmatch(r"(a+)+$", "a" * 64 + "b"))


def kill_worker_once() -> str:
    """The first time in a run: notes every process its worker started (pid and start time, in
    $TIDAL_TEST_MARKERS/worker-killed.json), SIGKILLs the worker, then holds the interpreter (grip),
    so only a signal can end this process."""
    if not _first_call("kill-worker"):
        return "ok"
    worker = os.getppid()
    started = {pid: started_at(pid) for pid in descendants_of(worker)}
    commands = [command(pid) for pid in started]
    record = Path(os.environ["TIDAL_TEST_MARKERS"]) / "worker-killed.json"
    record.write_text(json.dumps({"worker": worker, "started": started, "commands": commands}))
    os.kill(worker, signal.SIGKILL)
    return grip()


class WorkerKiller(Environment):
    """Calls kill_worker_once on a trajectory's first turn; the second turn is the answer."""

    def parse(self, assistant_text: str) -> ParsedTurn:
        if self.stats.turns:
            return ParsedTurn(assistant_text)
        return ParsedTurn(assistant_text, [ToolCall("kill_worker_once", {})])

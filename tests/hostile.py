"""User code that tries to take the run (tests/test_sandbox.py): as a tool, a reward function and an
environment class, each attempt reports what happened instead of raising. The targets come from $TIDAL_TEST_TARGETS
(JSON: the run directory, the NATS port); with $TIDAL_TEST_MARKERS set, the report is also written
there (a run's tool cannot hand a test anything else)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

from tidal.envs import Environment, ParsedTurn, ToolCall

SECRETS = ("TIDAL_WEIGHTS_KEY", "TIDAL_NATS_TOKEN", "MLFLOW_TRACKING_PASSWORD", "TIDAL_SECRET_FOR_TEST")


def _try(fn) -> str:
    """'ok: ...' when the attempt worked, else the error's type and text."""
    try:
        return f"ok: {str(fn())[:80]}"
    except Exception as err:  # noqa: BLE001 - every failure is an answer here
        return f"{type(err).__name__}: {err}"[:160]


def _read_secret_files(run_dir: Path) -> str:
    found = []
    for path in run_dir.rglob("*"):
        if path.is_file():
            found.append(path.read_bytes()[:8])
    if not found:
        raise FileNotFoundError(f"nothing readable in {run_dir}")
    return f"{len(found)} files"


def _connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        return conn.recv(64).decode(errors="replace")


FORKED: list[int] = []  # the sleepers _fork_children started in this process


def _fork_children(n: int) -> str:
    started = 0
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        FORKED.append(pid)
        started += 1
    return f"{started} forked"


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie, killed and not yet waited for, is not)."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(pid)
    return found


def _nats_port_of(pid: int) -> int | None:
    """The run's NATS port, from its worker's (or trainer's) command line (`--nats-url nats://host:port`)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--nats-url") + 1].rsplit(b":", 1)[1]) if b"--nats-url" in args else None


def attempts(kind: str) -> dict[str, str]:
    targets = json.loads(os.environ.get("TIDAL_TEST_TARGETS", "{}"))
    run_dir = Path(targets.get("run_dir", "/nonexistent"))
    worker = os.getppid()
    report = {
        "kind": kind,
        "env": ",".join(sorted(k for k in os.environ if k in SECRETS)) or "none",
        "proc_environ": _try(lambda: Path(f"/proc/{worker}/environ").read_bytes()[:40]),
        "run_dir_read": _try(lambda: _read_secret_files(run_dir)),
        "weights_write": _try(lambda: (run_dir / "weights" / "planted").write_text("x")),
        "run_dir_write": _try(lambda: (run_dir / "planted").write_text("x")),
        "nats": _try(lambda: _connect(port)) if (port := targets.get("nats_port") or _nats_port_of(worker)) else "no target",
        "signal": _try(lambda: os.kill(worker, 0)),
        "fork": _try(lambda: _fork_children(200)),
        "own_dir_write": _try(lambda: Path(os.environ["HOME"], "mine").write_text("x")),
        "cwd": os.getcwd(),
    }
    markers = os.environ.get("TIDAL_TEST_MARKERS")
    if markers:
        Path(markers, f"hostile-{os.getpid()}.json").write_text(json.dumps(report))
    return report


def hostile_tool() -> str:
    """Tries to take the run; returns what happened."""
    return json.dumps(attempts("tool"))


def hostile_reward(completion: str, answer: str) -> float:
    attempts("reward")
    return 0.0


def fork_and_hang(n: int) -> str:
    """Starts n sleeping children (each in a session of its own), then hangs past any timeout.

    Args:
        n: how many children
    """
    for _ in range(n):
        if os.fork() == 0:
            os.setsid()
            time.sleep(600)
            os._exit(0)
    time.sleep(600)
    return "never"


def allocate_in_children(children: int, megabytes: int) -> str:
    """Starts `children` processes that each hold `megabytes` of touched memory, and waits for them.

    Args:
        children: how many processes
        megabytes: memory each touches
    """
    pids = []
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            block = bytearray(megabytes << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(5)  # long past the watcher's looks (every 0.1 s); a control group kills at once
            os._exit(0)
        pids.append(pid)
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    return f"children ended: {codes}"


def flood_descriptor(megabytes: int) -> str:
    """Writes `megabytes` MiB straight to file descriptor 2, under Python's prints.

    Args:
        megabytes: how much
    """
    chunk = b"z" * (1 << 20)
    for _ in range(megabytes):
        os.write(2, chunk)
    return "flooded"


def leave_a_daemon() -> str:
    """Starts a child that sleeps in a session of its own and returns at once."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(600)
        os._exit(0)
    return str(pid)


def signal_parent_with_sigterm() -> str:
    """Sends SIGTERM to the process that started this one."""
    os.kill(os.getppid(), signal.SIGTERM)
    return "sent"


_attempted = False  # in this process: an environment process makes its attempts once


class CallsHostileTool(Environment):
    """Tries to take the run itself (attempts, once per environment process, in reset), and calls
    hostile_tool on a trajectory's first turn; the second turn is the answer. Its reward, the last
    call of its trajectory, reports (in $TIDAL_TEST_MARKERS/env-after-PID.json) which of the 200
    sleepers its reset forked still run: none should, what a call starts ends with the call."""

    forked: list[int] | None = None

    def reset(self, problem) -> list[dict]:
        global _attempted
        if not _attempted:
            _attempted = True
            attempts("env")
            self.forked = list(FORKED)
        return super().reset(problem)

    def parse(self, assistant_text: str) -> ParsedTurn:
        if self.stats.turns:
            return ParsedTurn(assistant_text)
        return ParsedTurn(assistant_text, [ToolCall("hostile_tool", {})])

    def reward(self, trajectory):
        markers = os.environ.get("TIDAL_TEST_MARKERS")
        if markers and self.forked is not None:
            after = {"forked": len(self.forked), "running": len(running(self.forked))}
            Path(markers, f"env-after-{os.getpid()}.json").write_text(json.dumps(after))
        return None

"""Processes by pid and start time (/proc, Linux): what a process started, whether it still runs,
and which processes a test session left running."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

SESSION_ENV = "TIDAL_TEST_SESSION"  # set per pytest process: every process a test starts inherits it


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [0] the state, [1] the parent, [19] the start time."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def started_at(pid: int) -> str:
    """A process's start time in clock ticks since boot: with its pid, it names one process."""
    return stat_fields(pid)[19]


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # it ended meanwhile
        return ""


def children_of(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (none once it ended)."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def descendants_of(pid: int) -> list[int]:
    """Every process `pid` started, and theirs."""
    return [d for c in children_of(pid) for d in [c, *descendants_of(c)]]


def start_time(pid: int) -> str | None:
    """started_at, or None for a process that ended meanwhile."""
    try:
        return started_at(pid)
    except OSError:
        return None


def running(pid: int, started: str | None) -> bool:
    """The process `pid` that started at `started` still runs (a zombie counts as ended; a reused pid is another process)."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return False
    return started is not None and fields[0] != "Z" and fields[19] == started


def left_running(started: dict[int, str], seconds: float) -> list[int]:
    """The processes of `started` (pid: start time) still running after waiting up to `seconds` for all to end."""
    deadline = time.monotonic() + seconds
    while any(running(p, s) for p, s in started.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p, s in started.items() if running(p, s)]


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def carrying(marker: bytes) -> dict[int, str]:
    """Running processes (pid: start time) whose environment holds `marker` (an exact NAME=value entry)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0") and stat_fields(int(entry.name))[0] != "Z":
                found[int(entry.name)] = started_at(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


SESSION_HELPERS = (" -m tidal.envs.host ", " -m tidal.envs.env_host ", " -m tidal.rewards.host ", "from multiprocessing.resource_tracker import main")


def ends_with_session(pid: int, session: int) -> bool:
    """A helper of the session process itself that ends when it does: the watcher of an engine it ran
    (tidal.reaper SESSION), a tool or reward process of its own (the kernel's parent-death signal) or
    multiprocessing's resource tracker (it exits when its parent's pipe closes)."""
    try:
        parent = stat_fields(pid)[1]
    except OSError:  # it ended meanwhile
        return False
    cmd = command(pid) + " "
    return parent == str(session) and (cmd.endswith(f" -m tidal.reaper {session} ") or any(h in cmd for h in SESSION_HELPERS))


def session_leftovers(marker: bytes, session: int, seconds: float) -> dict[int, str]:
    """What a test session (the pytest process `session`) leaves running, after up to `seconds` for
    it to end: processes carrying its marker or descended from it, but for its own helpers (ends_with_session)."""
    if not Path("/proc").is_dir():  # no /proc to read: nothing can be listed
        return {}
    deadline = time.monotonic() + seconds
    while True:
        candidates = {**carrying(marker), **{p: start_time(p) for p in descendants_of(session)}}
        left = {p: s for p, s in candidates.items() if p != session and running(p, s) and not ends_with_session(p, session)}
        if not left or time.monotonic() > deadline:
            return {p: command(p) for p in left}
        time.sleep(0.2)

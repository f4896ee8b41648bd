"""`python -m tidal.reaper PID`: a watcher that kills the processes descended from PID, in PID's
process group, once PID is gone.

For processes Tidal does not start itself (vLLM's engine core, its workers, multiprocessing's
resource tracker): they outlive a client killed by SIGKILL or the OOM killer, holding memory or an
accelerator. The watcher runs in a session of its own (a signal to the watched process's group
does not reach it) and re-reads PID's descendants every `INTERVAL` seconds, so a process started
after the watcher (an engine that is still starting, a grandchild) is known before PID dies.
PID counts as gone once it is a zombie: a container whose init never reaps it leaves it one.
Descendants in a group of their own are left alone: the launcher's roles, which it stops itself.
psutil is a dependency of vLLM, the one engine that needs this."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

INTERVAL = 0.5


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_group(proc: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(proc.pid) == group
    except ProcessLookupError:
        return False


def descendants(proc: psutil.Process, group: int) -> list[psutil.Process]:
    """The processes `proc` started, and theirs, that are in process group `group` (never this watcher: a session of its own)."""
    try:
        return [p for p in proc.children(recursive=True) if in_group(p, group)]
    except psutil.NoSuchProcess:
        return []


def watch(pid: int, interval: float = INTERVAL) -> tuple[list[psutil.Process], int]:
    """Every process descended from `pid` in its group while it ran (those still running at the last
    look), and that group: returns once `pid` is gone."""
    try:
        watched, group = psutil.Process(pid), os.getpgid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return [], 0
    known: dict[int, psutil.Process] = {}
    while running(watched):
        known = {p.pid: p for p in [*known.values(), *descendants(watched, group)] if running(p)}
        time.sleep(interval)
    return list(known.values()), group


def kill_all(procs: list[psutil.Process], group: int) -> None:
    """SIGKILL to each process and to whatever it started in `group` (psutil refuses a pid that a new process reuses)."""
    everything = {p.pid: p for proc in procs for p in [proc, *descendants(proc, group)]}
    for proc in everything.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def start(pid: int | None = None) -> subprocess.Popen:
    """Starts the watcher for `pid` (this process by default), detached: its own session, no inherited descriptors."""
    pid = os.getpid() if pid is None else pid
    return subprocess.Popen(
        [sys.executable, "-m", "tidal.reaper", str(pid)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def main(argv: list[str]) -> int:
    kill_all(*watch(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

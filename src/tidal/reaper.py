"""`python -m tidal.reaper PID`: a watcher that kills every process descended from PID once PID is gone.

For processes Tidal does not start itself (vLLM's engine core, its workers, multiprocessing's
resource tracker): they outlive a client killed by SIGKILL or the OOM killer, holding memory or an
accelerator. The watcher runs in a session of its own (a signal to the watched process's group
does not reach it) and re-reads PID's descendants every `INTERVAL` seconds, so a process started
after the watcher (an engine that is still starting, a grandchild) is known before PID dies.
PID counts as gone once it is a zombie: a container whose init never reaps it leaves it one."""

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


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    """The processes `proc` started, and theirs; never this watcher (a child of the watched process itself)."""
    try:
        return [p for p in proc.children(recursive=True) if p.pid != os.getpid()]
    except psutil.NoSuchProcess:
        return []


def watch(pid: int, interval: float = INTERVAL) -> dict[int, psutil.Process]:
    """Every process descended from `pid` while it ran (those still running at the last look): returns once it is gone."""
    try:
        watched = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return {}
    known: dict[int, psutil.Process] = {}
    while running(watched):
        known = {p.pid: p for p in [*known.values(), *descendants(watched)] if running(p)}
        time.sleep(interval)
    return known


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL to each process and to whatever it started (psutil refuses a pid that a new process reuses)."""
    everything = {p.pid: p for proc in procs for p in [proc, *descendants(proc)]}
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
    kill_all(list(watch(int(argv[0])).values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

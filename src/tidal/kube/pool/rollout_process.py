"""The ``tidal rollout-worker`` process of a pod, started by the fixed pool's step or by an elastic pool's pod entry
(:mod:`tidal.kube.pool.pod_entry`), and SIGTERM passed on to it.

A pod's SIGTERM (a cancelled run, a deleted pod, a preempted spot node) reaches the container's first
process only. The worker runs in a process group of its own (so what it starts can be ended with it), so
without forwarding it would be SIGKILLed at the end of the grace period instead of stopping in order and
handing back the work items it holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from contextlib import contextmanager

from tidal.kube.steps.tidal_cli import nats_url_of, tidal_executable


def worker_command(config_path: str, run_dir: str, worker_id: str) -> list[str]:
    return tidal_executable() + [
        "rollout-worker",
        config_path,
        "--run-dir",
        run_dir,
        "--nats-url",
        nats_url_of(config_path),
        "--worker-id",
        worker_id,
    ]


def start_worker(command: list[str]) -> subprocess.Popen:
    print("+ " + " ".join(command), flush=True)
    return subprocess.Popen(command, process_group=0)


class SigtermForward:
    """Whether this process got SIGTERM (and passed it on to the worker)."""

    def __init__(self) -> None:
        self.received = False


@contextmanager
def forward_sigterm(process: subprocess.Popen):
    """While inside: SIGTERM to this process is sent on to ``process`` (not its group: the worker ends its own
    children in order). Yields a :class:`SigtermForward` that says whether it happened."""
    forward = SigtermForward()
    if threading.current_thread() is not threading.main_thread():
        yield forward
        return

    def on_sigterm(signum, frame):
        forward.received = True
        print("received SIGTERM: passing it on to the rollout worker (it hands back its work items and exits)", flush=True)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield forward
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_group(process: subprocess.Popen) -> None:
    """What the exited worker started and left (vLLM's engine processes): its process group, killed,
    so they do not hold the pod's memory until the container ends."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_worker(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, up to ``grace_s`` to exit, then SIGKILL; the exit status."""
    if process.poll() is None:
        process.terminate()
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()

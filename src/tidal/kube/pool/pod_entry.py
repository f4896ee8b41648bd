"""The first process of an elastic pool's rollout-worker pod: ``python3 -m tidal.kube.pool.pod_entry``.

A pod of the pool's Deployment lives across rounds (KEDA adds and removes pods; the pipeline's rounds
come and go), but ``tidal rollout-worker`` exits when its round is over. So this process, PID 1 of the
container, starts a worker whenever the run is in a round, waits while it is between rounds or over
(exiting would make the Deployment restart the container, and back off), and passes SIGTERM on to the
worker (a preemption or a scale-down: the worker hands back its work items and exits; then so does this
process, with the worker's status).

The worker id is the pod's name (``POD_NAME``, from the downward API): unique per pod, and the same for
each round's worker in that pod, so the trainer's health check sees a new process under a known id at most.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tidal.kube.pool.rollout_process import SigtermForward, end_group, forward_sigterm, start_worker, stop_worker, worker_command

POD_NAME_ENV = "POD_NAME"
STATE_POLL_SECONDS = 5.0
WORKER_END_GRACE_S = 30.0
"""After the run state says the round is over, how long the worker may take to exit by itself."""


def pool_worker_id(pod_name: str) -> str:
    """The worker id of a pool pod: its name (a DNS label: one NATS token, a valid KV key)."""
    if not pod_name:
        raise SystemExit(f"{POD_NAME_ENV} is not set: the pool's Deployment sets it from the pod's metadata.name")
    return pod_name


def reap_orphans() -> None:
    """As PID 1, collect what the worker's children left when they exited (zombies hold nothing but a pid)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(
    current_state: Callable[[], str],
    start: Callable[[], subprocess.Popen],
    sigterm: SigtermForward,
    poll_s: float = STATE_POLL_SECONDS,
    end_grace_s: float = WORKER_END_GRACE_S,
) -> int:
    """Run workers while the run is in a round, until SIGTERM; returns the exit status for the container.

    ``sigterm`` is set by the caller's handler (:func:`main`); :func:`supervise_round` passes it on."""
    while not sigterm.received:
        state = current_state()
        if state != "running":
            time.sleep(poll_s)
            continue
        code = supervise_round(start(), current_state, sigterm, poll_s, end_grace_s)
        reap_orphans()
        if sigterm.received:
            return exit_status(code) or 128 + signal.SIGTERM
        if code not in (0, None):
            print(f"the rollout worker exited with status {code} while the run was {current_state()!r}; starting another", flush=True)
            time.sleep(poll_s)
        else:
            print("the rollout worker ended with its round; waiting for the next one", flush=True)
    return 128 + signal.SIGTERM


def exit_status(code: int) -> int:
    """A child's status as a shell reports it: killed by signal N (Popen's -N) is 128 + N."""
    return 128 - code if code < 0 else code


def supervise_round(process: subprocess.Popen, current_state, sigterm: SigtermForward, poll_s: float, end_grace_s: float) -> int:
    """One worker process, SIGTERM passed on to it; stopped if it outlives its round by ``end_grace_s``."""
    over_since = None
    try:
        with forward_sigterm(process) as forwarded:
            if sigterm.received:  # it came while this worker was starting, before the handler that passes it on
                process.send_signal(signal.SIGTERM)
            while True:
                try:
                    code = process.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    code = None
                if forwarded.received:
                    sigterm.received = True
                if code is not None:
                    return code
                if sigterm.received:
                    continue  # the worker got SIGTERM: it hands back its items; the kubelet's grace period bounds the wait
                if current_state() != "running":
                    over_since = over_since or time.monotonic()
                    if time.monotonic() - over_since > end_grace_s:
                        print("the round is over; stopping the rollout worker", flush=True)
                        return stop_worker(process, end_grace_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_group(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tidal.kube.pool.pod_entry", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's staged config.yaml")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    from tidal.kube.pool.fixed import current_run_state
    from tidal.rundir import RunDir

    run = RunDir(Path(args.run_dir))
    worker_id = pool_worker_id(os.environ.get(POD_NAME_ENV, ""))
    sigterm = SigtermForward()

    def between_workers(signum, frame):  # SIGTERM while no worker runs: nothing to hand back
        sigterm.received = True

    signal.signal(signal.SIGTERM, between_workers)
    return serve(lambda: current_run_state(run, args.config), lambda: start_worker(worker_command(args.config, str(run.root), worker_id)), sigterm)


if __name__ == "__main__":
    sys.exit(main())

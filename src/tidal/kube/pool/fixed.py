"""The fixed worker pool (``worker_pool=fixed``): each round's rollout-worker lanes, one ``tidal rollout-worker``
per step pod, ended with its round."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tidal.kube.pool.rollout_process import end_group, forward_sigterm, start_worker, worker_command
from tidal.kube.steps import run_state
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError
from tidal.kube.steps.run_start import WORKER_LANE_PREFIX
from tidal.rundir import RunDir

WORKER_GRACE_SECONDS = 20.0
STATE_POLL_SECONDS = 2.0


@as_separate_pod("rollout-worker")
def rollout_worker(run_dir: str, config_path: str, lane: str, round_index: int) -> None:
    """One long-running rollout worker; the step ends when the KV run state says the round is over.

    The worker exits by itself at the end of a round; if it is still running
    ``WORKER_GRACE_SECONDS`` after the state says so (stuck in a long generation),
    it is terminated, so a round never outlives its trainer.
    """
    if not lane.startswith(WORKER_LANE_PREFIX):
        raise PipelineStepError(f"lane {lane!r} is not a rollout worker lane")
    run = RunDir(Path(run_dir))
    process = start_worker(worker_command(config_path, str(run.root), f"r{round_index:03d}-{lane}"))
    try:
        with forward_sigterm(process) as sigterm:
            supervise_worker(process, lambda: current_run_state(run, config_path), terminated=lambda: sigterm.received)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_group(process)


def current_run_state(run: RunDir, config_path: str) -> str:
    try:
        state = run_state.read_run_state(run, config_path)
    except Exception as err:  # NATS briefly unreachable: keep the worker, ask again
        print(f"run state unavailable: {err}", flush=True)
        return "unknown"
    return state or "unknown"


def supervise_worker(
    process: subprocess.Popen, current_state, poll_s: float = STATE_POLL_SECONDS, grace_s: float = WORKER_GRACE_SECONDS, terminated=lambda: False
) -> None:
    """Wait for the worker; stop it once the round is over; raise if it failed while the round was live.
    ``terminated()``: this pod got SIGTERM, which was passed on to the worker (:mod:`tidal.kube.pool.rollout_process`)."""
    over_since = None
    while True:
        try:
            code = process.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and terminated():
            raise PipelineStepError(f"this pod got SIGTERM; the rollout worker stopped in order (status {code})")
        state = current_state()
        if code is not None:
            if code != 0 and state not in run_state.ROUND_OVER_STATES:
                raise PipelineStepError(f"'tidal rollout-worker' exited with status {code} while the run was {state!r}")
            return
        if state == "failed":
            process.terminate()
            raise PipelineStepError("the trainer marked the run as failed; stopped this rollout worker")
        if state in run_state.ROUND_OVER_STATES:
            over_since = over_since or time.monotonic()
            if time.monotonic() - over_since > grace_s:
                print(f"round is over ({state}); stopping the rollout worker", flush=True)
                process.terminate()
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                return

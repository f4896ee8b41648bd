"""``tidal run --via kfp-local``: the cluster pipeline, run on this machine by ``kfp.local``.

The same pipeline definition as on Kubeflow (compiled for the ``cpu`` profile),
executed by ``kfp.local.SubprocessRunner(use_venv=False)``: every step is a
subprocess of this Python, no per-task venv or pip install. What the cluster
provides is provided here instead: an embedded nats-server in the run
directory, and an MLflow store under it unless the config names one. The
trainer runs in its step (``trainer_backend=local``), not as a PyTorchJob.

Two settings shape the loop: the rounds R (default 1) and the iterations per
round K (default: ``trainer.iterations`` split over R rounds). Set them with the
environment variables ``TIDAL_KFP_ROUNDS`` / ``TIDAL_KFP_ITERATIONS_PER_ROUND``
or the pseudo-overrides ``kfp.rounds=R`` / ``kfp.iterations_per_round=K``. kfp.local runs at most two loop iterations at once, so one rollout
worker runs beside the trainer per round.

Each step runs as if in its own pod: a fresh HOME, ``$TIDAL_CACHE`` and working
directory, deleted when the step ends; only the run directory is shared, as the
data volume is on a cluster (``TIDAL_KFP_LOCAL_SHARED_HOME=1`` turns this off).
"""

from __future__ import annotations

import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tidal.kube import cluster

LOOP_KEYS = ("kfp.rounds", "kfp.iterations_per_round")
LOOP_ENV = {"TIDAL_KFP_ROUNDS": "kfp.rounds", "TIDAL_KFP_ITERATIONS_PER_ROUND": "kfp.iterations_per_round"}


class KfpLocalError(RuntimeError):
    """The local pipeline run could not start or a step failed; the message names which."""


@dataclass(frozen=True)
class LocalLoop:
    rounds: int
    iterations_per_round: int
    overrides: list[str]


def split_loop_overrides(overrides: list[str], total_iterations_of) -> LocalLoop:
    """Take ``kfp.*`` keys out of ``overrides``; ``total_iterations_of(rest)`` gives trainer.iterations."""
    loop: dict[str, int] = {}
    rest = []
    from_env = [f"{key}={os.environ[name]}" for name, key in LOOP_ENV.items() if os.environ.get(name)]
    for item in from_env + overrides:
        key, _, value = item.partition("=")
        if key.strip() in LOOP_KEYS:
            if not value.strip().isdigit() or int(value) < 1:
                raise KfpLocalError(f"{key.strip()} must be a positive integer, got {value!r}")
            loop[key.strip()] = int(value)
        elif key.strip().startswith("kfp."):
            raise KfpLocalError(f"unknown kfp-local option {key.strip()!r}; known: {', '.join(LOOP_KEYS)}")
        else:
            rest.append(item)
    rounds = loop.get("kfp.rounds", 1)
    per_round = loop.get("kfp.iterations_per_round") or math.ceil(total_iterations_of(rest) / rounds)
    return LocalLoop(rounds=rounds, iterations_per_round=per_round, overrides=rest)


def load_checked_config(config_path: str, overrides: list[str]):
    from tidal.config import ConfigError, load_config

    try:
        return load_config(config_path, overrides)
    except ConfigError as err:
        raise KfpLocalError(str(err)) from None


@contextmanager
def separate_pods():
    """Every step runs with its own HOME, cache and working directory, removed when it ends (as a pod's
    file system is), so a step that leaves something outside the run directory for a later one fails
    here as it would on a cluster. ``TIDAL_KFP_LOCAL_SHARED_HOME=1`` turns this off."""
    from tidal.kube.steps.pod_sandbox import POD_SANDBOX_ENV

    if os.environ.get("TIDAL_KFP_LOCAL_SHARED_HOME") == "1":
        yield
        return
    saved = os.environ.get(POD_SANDBOX_ENV)
    with tempfile.TemporaryDirectory(prefix="tidal-kfp-pods-") as root:
        os.environ[POD_SANDBOX_ENV] = root
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(POD_SANDBOX_ENV, None)
            else:
                os.environ[POD_SANDBOX_ENV] = saved


def run_pipeline_locally(config_path: str, run_dir: str, overrides: list[str]) -> Path:
    """Run the whole pipeline; returns the run directory. Raises :class:`KfpLocalError` on failure."""
    from kfp import local

    from tidal.kube.pipeline.definition import build_pipeline
    from tidal.rundir import RunDir
    from tidal.tracking import local_store_uri
    from tidal.transport.server import EmbeddedNats

    loop = split_loop_overrides(list(overrides), lambda rest: load_checked_config(config_path, rest).trainer.iterations)
    config = load_checked_config(config_path, loop.overrides)
    run = RunDir(Path(run_dir).resolve())
    run.root.mkdir(parents=True, exist_ok=True)
    tracking_uri = config.tracking.uri or local_store_uri(run.root)
    # kfp.local's own record of the steps (their inputs and outputs), beside the run's files
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(run.root / "kfp"), raise_on_error=True)
    pipeline = build_pipeline(cluster.accelerator_profile("cpu"))
    with EmbeddedNats(run.nats_store, max_payload_mb=config.transport.max_payload_mb) as nats, separate_pods():
        try:
            pipeline(
                config_path=str(Path(config_path).resolve()),
                run_dir=str(run.root),
                rounds=loop.rounds,
                iterations_per_round=loop.iterations_per_round,
                rollout_workers=1,
                overrides="\n".join(loop.overrides),
                experiment=config.tracking.experiment,
                nats_url=nats.url,
                tracking_uri=tracking_uri,
                trainer_backend="local",
                registered_model_name=f"tidal-{run.root.name}",
            )
        except RuntimeError as err:
            raise KfpLocalError(f"pipeline failed: {err}") from None
    return run.root

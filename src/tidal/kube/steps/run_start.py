"""The run's first steps: prepare (check the cluster and the config, stage them and the base model, create the
run's streams and KV bucket, open the MLflow parent run).

The step functions take the step's KFP parameters as they come (strings and numbers) and work on the run
directory through one :class:`~tidal.rundir.RunDir`; what a step records for later ones is in ``RUN_DIR/kube/``
(:mod:`tidal.kube.steps.records`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tidal.kube import cluster
from tidal.kube.steps import run_state
from tidal.kube.steps.parent_run import RunLinks, open_parent_run
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError, StepRecords, pipeline_run_dir
from tidal.kube.steps.staging import WORKER_POOLS, PipelineKnobs, stage_for_pool
from tidal.kube.trainer.launch import check_trainer_backend
from tidal.rundir import RunDir

TRAINER_LANE = "trainer"
WORKER_LANE_PREFIX = "rollout-"


def worker_lanes(rollout_workers: int, worker_pool: str = "fixed") -> list[str]:
    """The round's parallel lanes: the trainer first (kfp.local runs two lanes at a time), then workers; with an
    elastic pool the trainer alone (the pool's Deployment runs the workers)."""
    if worker_pool not in WORKER_POOLS:
        raise PipelineStepError(f"worker_pool must be one of {', '.join(WORKER_POOLS)}, got {worker_pool!r}")
    if rollout_workers < 1:
        raise PipelineStepError(f"rollout_workers must be at least 1, got {rollout_workers}")
    if worker_pool == "elastic":
        return [TRAINER_LANE]
    return [TRAINER_LANE] + [f"{WORKER_LANE_PREFIX}{i}" for i in range(rollout_workers)]


# ---------------------------------------------------------------- prepare


@dataclass(frozen=True)
class PreparedRun:
    run_dir: str
    config_path: str
    rounds: list[int]
    lanes: list[str]
    parent_run_id: str


@as_separate_pod("prepare")
def prepare(
    config_yaml: str,
    config_path: str,
    run_dir: str,
    job_id: str,
    knobs: PipelineKnobs,
    links: RunLinks | None = None,
    trainer_backend: str = "local",
    worker_pool: str = "fixed",
    registered_model_name: str | None = None,
) -> PreparedRun:
    """Check the cluster runs what ``trainer_backend`` needs, validate the config, stage it and its data, create the
    streams and KV bucket, open the MLflow parent run. With ``worker_pool=elastic``, the NCCL weight transfer is
    turned off (it needs a fixed lane per worker; pool workers load each version from the weight store).
    ``registered_model_name``, which the last step registers the model as, is checked here, before any training."""
    if registered_model_name is not None:
        check_registered_model_name(registered_model_name)
    lanes = worker_lanes(knobs.rollout_workers, worker_pool)
    check_trainer_backend(trainer_backend)
    run = pipeline_run_dir(run_dir, job_id)
    records = StepRecords(run).create()
    records.registered.unlink(missing_ok=True)  # this pipeline run has not succeeded (yet)
    for earlier in records.evaluations():  # nor evaluated: the run metrics are this run's
        earlier.unlink()
    staged = stage_for_pool(run, config_yaml, config_path, knobs.config_overrides(), worker_pool)
    parent = open_parent_run(run, staged, job_id, links or RunLinks())
    prepare_run(run, staged, parent.tracking_uri, parent.run_id, shared_roots=(cluster.DATA_MOUNT_PATH,))
    warning = run_state.reset_rounds(run, staged, job_id or "local")
    if warning:
        print(f"warning: {warning}", flush=True)
    return PreparedRun(
        run_dir=str(run.root),
        config_path=staged,
        rounds=list(range(knobs.rounds)),
        lanes=lanes,
        parent_run_id=parent.run_id,
    )


def check_registered_model_name(name: str) -> None:
    from tidal.tracking import registry_name_problem

    problem = registry_name_problem(name)
    if problem:
        raise PipelineStepError(f"registered_model_name {name!r}: {problem} (the run would be refused only at its last step)")


BASE_MODEL_DIR = "base-model"
"""Where the prepare step stages the base model inside the run directory (on the shared volume)."""


def prepare_run(run: RunDir, config_path: str, tracking_uri: str, mlflow_run_id: str, shared_roots: tuple[str, ...] = ()) -> None:
    """Stage the base model and data, write run.json, create the streams and the KV bucket.

    The base model is copied into ``RUN_DIR/base-model`` (see :func:`stage_base_model`), and
    run.json records that path: the prepare pod's own cache vanishes with the pod.
    """
    from tidal.config import load_config
    from tidal.roles import check_prompt_settings, ensure_base_model  # the base model: a warm start trains (torch)
    from tidal.rundir import RunInfo

    cfg = load_config(config_path)
    if not run.started:
        base_model = stage_base_model(ensure_base_model(cfg), run, shared_roots)
        check_prompt_settings(cfg, base_model)
        run.save_info(RunInfo(run_id=run_state.run_id_of(run), base_model=str(base_model), tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id))
    create_transport(run, config_path)


def stage_base_model(base_model: str | Path, run: RunDir, shared_roots: tuple[str, ...] = ()) -> str:
    """Where every later pod finds the base model: a local directory is copied to ``RUN_DIR/base-model``.

    The warm-started tiny model, and any model directory, lives in this pod's file system
    (``$TIDAL_CACHE`` or ``$HOME/.cache/tidal``), which the trainer and worker pods do not see.
    A directory already inside the run directory or under one of ``shared_roots`` (the data
    volume) is used where it is. A name that is not a local directory (a Hugging Face hub id) is
    returned unchanged: each pod resolves it itself. The copy is atomic (a temporary folder,
    renamed), so a retried prepare step either finds the staged model or stages it again.
    """
    source = Path(base_model)
    if not source.is_dir():
        return str(base_model)
    source = source.resolve()
    run_path = run.root.resolve()
    if any(source.is_relative_to(Path(root).resolve()) for root in (run_path, *shared_roots)):
        return str(source)
    target = run_path / BASE_MODEL_DIR
    if (target / "config.json").is_file():
        return str(target)
    tmp = run_path / f".{BASE_MODEL_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return str(target)


def create_transport(run: RunDir, config_path: str) -> None:
    """Set up the run's streams and KV bucket (a session that creates them, then closes)."""

    async def nothing(transport) -> None:
        pass

    run_state.in_session(config_path, run, nothing, create=True)

"""What each pipeline step runs, as plain functions (the KFP components only import and call these).

prepare → for each round: open_round, the rollout workers beside the trainer (the train step:
:mod:`tidal.kube.trainer_launch`), weight_sync, evaluate → register_model; finalize, the exit
handler, whatever became of the run. Each function takes the step's KFP parameters as they come
(strings and numbers) and works on the run directory through one :class:`~tidal.rundir.RunDir`.
Tidal's roles run as ``tidal`` CLI verbs in subprocesses (:mod:`tidal.kube.verbs`); what a step
records for later ones is in ``RUN_DIR/kube/`` (:mod:`tidal.kube.step_records`).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.kube import cluster, core_hooks
from tidal.kube.parent_run import RunLinks, end_parent_run, log_to_parent_run, open_parent_run, register_final_model
from tidal.kube.pod_sandbox import as_separate_pod
from tidal.kube.staging import WORKER_POOLS, PipelineKnobs, PoolSettings, stage_for_pool
from tidal.kube.step_records import PipelineStepError, StepRecords, pipeline_run_dir
from tidal.kube.trainer_launch import check_trainer_backend, delete_trainer_jobs
from tidal.kube.verbs import run_tidal
from tidal.kube.worker_process import end_group, forward_sigterm, start_worker, worker_command
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
    core_hooks.prepare_run(run, staged, parent.tracking_uri, parent.run_id, shared_roots=(cluster.DATA_MOUNT_PATH,))
    warning = core_hooks.reset_rounds(run, staged, job_id or "local")
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


@as_separate_pod("worker-pool")
def start_worker_pool(
    worker_pool: str,
    run_dir: str,
    config_path: str,
    namespace: str,
    accelerator: str,
    image: str,
    accelerators: int,
    cpu: str,
    memory: str,
    settings: PoolSettings,
    queue_name: str = "",
    api_client=None,
) -> list[str]:
    """``worker_pool=elastic``: check KEDA is installed, then create the run's rollout-worker Deployment and its
    ScaledObject (recorded first: finalize deletes them), owned by the run's owner object. ``fixed``: nothing."""
    if worker_pool not in WORKER_POOLS:
        raise PipelineStepError(f"worker_pool must be one of {', '.join(WORKER_POOLS)}, got {worker_pool!r}")
    if worker_pool == "fixed":
        print("worker_pool=fixed: each round runs its own rollout-worker tasks; no pool to create", flush=True)
        return []
    from kubernetes import client as k8s

    from tidal.config import load_config
    from tidal.kube import worker_pool as pool
    from tidal.kube.trainer_launch import current_namespace
    from tidal.transport.streams import stream_names

    if settings.termination_grace_s < 0:
        raise PipelineStepError(f"pool_termination_grace_s must be 0 or more seconds, got {settings.termination_grace_s}")
    run = RunDir(Path(run_dir))
    config = load_config(config_path)
    minimum, maximum, lag = pool.pool_sizes(
        settings.min_workers,
        settings.max_workers,
        settings.lag_threshold,
        pool.most_workers(config.rollout.workers),
        config.trainer.prompts_per_iteration,
    )
    if api_client is None:
        from tidal.kube.trainer_job import cluster_api_client

        api_client = cluster_api_client()
    pool.check_keda_installed(k8s.ApiextensionsV1Api(api_client))
    namespace = namespace or current_namespace()
    spec = pool.PoolSpec(
        name=pool.pool_name(run.root.name),
        namespace=namespace,
        run_label=cluster.label_value(run.root.name),
        config_path=config_path,
        run_dir=str(run.root),
        stream=stream_names(core_hooks.run_id_of(run))["work_stream"],
        profile=cluster.accelerator_profile(accelerator),
        image=image or cluster.accelerator_profile(accelerator).image,
        min_workers=minimum,
        max_workers=maximum,
        lag_threshold=lag,
        accelerators=accelerators,
        cpu=cpu,
        memory=memory,
        node_selector=pool.parse_node_selector(settings.node_selector),
        preferred_nodes=pool.parse_node_selector(settings.preferred_nodes, "pool_preferred_nodes"),
        tolerations=(cluster.Toleration(key=settings.toleration_key),) if settings.toleration_key else (),
        termination_grace_s=settings.termination_grace_s,
        queue_name=queue_name,
        owner=pool.run_owner(k8s.CoreV1Api(api_client), pool.step_pod_name(), namespace),
    )
    if spec.owner is None:
        print("no owner object found for this step's pod: the pool is deleted by finalize only", flush=True)
    pool.record_pool(run, spec.namespace, spec.name)
    done = pool.create_pool(spec, api_client)
    done.append(f"pool of {minimum} to {maximum} rollout workers, one more per {lag} pending work items of {spec.stream}")
    for line in done:
        print(line, flush=True)
    return done


# ---------------------------------------------------------------- a round


@as_separate_pod("open-round")
def open_round(run_dir: str, config_path: str, round_index: int, job_id: str) -> None:
    """Take the round lease (round ``round_index - 1`` of this pipeline run must have ended: a KFP backend that
    ignores the rounds loop's parallelism=1 starts every round at once, and all but one fail here, saying so,
    instead of sharing the run directory), then mark the run as running round ``round_index`` so this round's
    workers do not exit at once."""
    run = RunDir(Path(run_dir))
    try:
        core_hooks.begin_round(run, config_path, job_id or "local", round_index)
    except core_hooks.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    core_hooks.open_round(run, config_path, round_index)
    log_to_parent_run(run, metrics={"round/started": float(round_index)}, step=round_index)


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
            supervise_worker(process, lambda: run_state(run, config_path), terminated=lambda: sigterm.received)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        end_group(process)


def run_state(run: RunDir, config_path: str) -> str:
    try:
        state = core_hooks.read_run_state(run, config_path)
    except Exception as err:  # NATS briefly unreachable: keep the worker, ask again
        print(f"run state unavailable: {err}", flush=True)
        return "unknown"
    return state or "unknown"


def supervise_worker(
    process: subprocess.Popen, current_state, poll_s: float = STATE_POLL_SECONDS, grace_s: float = WORKER_GRACE_SECONDS, terminated=lambda: False
) -> None:
    """Wait for the worker; stop it once the round is over; raise if it failed while the round was live.
    ``terminated()``: this pod got SIGTERM, which was passed on to the worker (:mod:`tidal.kube.worker_process`)."""
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
            if code != 0 and state not in core_hooks.ROUND_OVER_STATES:
                raise PipelineStepError(f"'tidal rollout-worker' exited with status {code} while the run was {state!r}")
            return
        if state == "failed":
            process.terminate()
            raise PipelineStepError("the trainer marked the run as failed; stopped this rollout worker")
        if state in core_hooks.ROUND_OVER_STATES:
            over_since = over_since or time.monotonic()
            if time.monotonic() - over_since > grace_s:
                print(f"round is over ({state}); stopping the rollout worker", flush=True)
                process.terminate()
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                return


# ---------------------------------------------------------------- weight sync, evaluation


@dataclass(frozen=True)
class SyncedWeights:
    version: int
    path: str


@as_separate_pod("weight-sync")
def weight_sync(run_dir: str, round_index: int) -> SyncedWeights:
    """Verify the round's newest snapshot against its manifest, point ``latest`` at it, log it to MLflow."""
    run = RunDir(Path(run_dir))
    version, path = core_hooks.latest_snapshot(run)
    try:
        core_hooks.verify_snapshot(path)
    except Exception as err:
        raise PipelineStepError(f"round {round_index}: snapshot v{version} failed verification: {err}") from None
    core_hooks.point_latest(run, version)
    synced = SyncedWeights(version=version, path=path)
    records = StepRecords(run)
    records.write(records.round_file(round_index), {"round": round_index, **asdict(synced)})
    log_to_parent_run(
        run,
        metrics={"round/policy_version": float(version)},
        step=round_index,
        tags={f"tidal.round{round_index:03d}.weights": path, "tidal.latest_weights": path},
    )
    return synced


@as_separate_pod("evaluate")
def evaluate(run_dir: str, config_path: str, weights_path: str, round_index: int, job_id: str) -> dict[str, float]:
    """Held-out metrics of the round's snapshot (``tidal eval``), logged to MLflow per round; the round's last
    step, so it releases the round lease and the next round may begin."""
    run = RunDir(Path(run_dir))
    output = run_tidal(["eval", config_path, "--run-dir", str(run.root), "--weights", weights_path], capture=True)
    print(output, flush=True)
    metrics = numeric_metrics(last_json_object(output))
    if not metrics:
        raise PipelineStepError(f"'tidal eval' printed no numeric metrics: {output[-500:]!r}")
    log_to_parent_run(run, metrics={f"eval/{k}": v for k, v in metrics.items()}, step=round_index)
    records = StepRecords(run)
    records.write(records.eval_file(round_index), {"round": round_index, "metrics": metrics, "weights": weights_path})
    try:
        core_hooks.end_round(run, config_path, job_id or "local", round_index)
    except core_hooks.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    return metrics


def last_json_object(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise PipelineStepError(f"'tidal eval' did not print JSON: {text[-500:]!r}") from None


def numeric_metrics(payload: dict) -> dict[str, float]:
    return {key: float(value) for key, value in payload.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


def final_metrics(run_dir: str, job_id: str) -> dict[str, float]:
    """The held-out metrics of the last evaluated round, and that round (the run's metrics); empty before any."""
    records = StepRecords(pipeline_run_dir(run_dir, job_id))
    evaluations = records.evaluations()
    if not evaluations:
        return {}
    last = records.read(evaluations[-1])
    return {**{f"final_{k}": float(v) for k, v in last["metrics"].items()}, "rounds_evaluated": float(last["round"] + 1)}


# ---------------------------------------------------------------- the end of a run


@as_separate_pod("register-model")
def register_model(run_dir: str, registered_model_name: str) -> str:
    """Export the final snapshot as a model directory (`tidal export`: full weights, or base + adapter for a
    LoRA run), log it to the parent run and register it in the MLflow model registry."""
    from tidal.export import EXPORT_RECORD, export_version

    run = RunDir(Path(run_dir))
    version, latest_path = core_hooks.latest_snapshot(run)
    core_hooks.verify_snapshot(latest_path)
    out = run.root / "exports" / f"{Path(latest_path).name}-final"
    if out.exists():  # a retried step: the export before it was whole (export_version renames a finished folder into place)
        exported_path, record = out, json.loads((out / EXPORT_RECORD).read_text())
    else:
        exported = export_version(run, out, version, accuracy=last_evaluated_accuracy(run, latest_path))
        exported_path, record = exported.path, exported.record
    model_version = register_final_model(run, registered_model_name, exported_path, record, Path(latest_path))
    records = StepRecords(run)
    records.write(
        records.registered, {"model": registered_model_name, "version": model_version, "weights": latest_path, "export": str(exported_path)}
    )
    print(f"registered {registered_model_name} version {model_version}: {exported_path} ({record['kind']}, from {latest_path})", flush=True)
    return model_version


def last_evaluated_accuracy(run: RunDir, weights_path: str) -> float | None:
    """The held-out accuracy the evaluate step measured for `weights_path`, if it did."""
    records = StepRecords(run)
    for path in reversed(records.evaluations()):
        record = records.read(path)
        if record.get("weights") == weights_path and "accuracy" in record["metrics"]:
            return float(record["metrics"]["accuracy"])
    return None


@as_separate_pod("finalize")
def finalize_run(run_dir: str, job_id: str, namespace: str = "", job_backend=None, pool_api_client=None) -> list[str]:
    """Whatever became of the run (the exit handler runs after success, failure and cancellation): delete
    trainer jobs that are left and the elastic worker pool, end the MLflow parent run FINISHED (register_model got to the end) or
    FAILED, and delete the run's NATS streams and KV bucket. Every part is tried; the step fails
    afterwards if one failed, naming it. Returns what it did, one line per action. Weights, checkpoints
    and the config stay on the volume.

    register_model, the run's last step, writes ``registered.json``: its presence is how finalize knows
    the run succeeded. (An exit task could be handed dsl.PipelineTaskFinalStatus, but KFP backends
    before 2.14 cannot resolve it.)"""
    run = pipeline_run_dir(run_dir, job_id)
    succeeded = StepRecords(run).registered.is_file()
    done: list[str] = []
    problems: list[str] = []

    def attempt(what: str, action) -> None:
        try:
            done.extend(action())
        except Exception as err:
            problems.append(f"{what}: {type(err).__name__}: {err}")

    attempt("deleting trainer jobs", lambda: delete_trainer_jobs(run, job_backend))
    attempt("deleting the worker pool", lambda: delete_worker_pool(run, pool_api_client))
    attempt("ending the MLflow run", lambda: end_parent_run(run, succeeded))
    attempt("deleting the NATS streams and KV bucket", lambda: delete_run_transport(run))
    for line in done:
        print(line, flush=True)
    if problems:
        raise PipelineStepError("finalize could not clean up everything:\n  - " + "\n  - ".join(problems))
    return done


def delete_worker_pool(run: RunDir, api_client=None) -> list[str]:
    from tidal.kube.worker_pool import delete_pool

    return delete_pool(run, api_client)


def delete_run_transport(run: RunDir) -> list[str]:
    if not run.config.is_file():
        return []  # prepare stopped before it created streams
    return [f"deleted {what}" for what in core_hooks.delete_run_transport(run, str(run.config))]

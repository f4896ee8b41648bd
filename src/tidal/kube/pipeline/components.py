"""KFP v2 lightweight components, one per pipeline step.

Each body imports :mod:`tidal.kube.steps` (the train step: :mod:`tidal.kube.trainer.launch`; Tidal is
installed in the image: no per-task pip install, ``install_kfp_package=False``) and calls one step. The
image here is a placeholder: :func:`tidal.kube.pipeline.compile_pipeline`
writes the image of the chosen accelerator profile into the compiled YAML.
"""

from typing import NamedTuple

from kfp import dsl

from tidal.kube.cluster import PROFILES

BASE_IMAGE = PROFILES["cpu"].image

component = dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)


@component
def prepare(
    config_yaml: str,
    config_path: str,
    run_dir: str,
    job_id: str,
    rounds: int,
    iterations_per_round: int,
    rollout_workers: int,
    group_size: int,
    prompts_per_iteration: int,
    mode: str,
    experiment: str,
    nats_url: str,
    tracking_uri: str,
    overrides: str,
    kfp_ui_url: str,
    mlflow_ui_url: str,
    trainer_backend: str,
    worker_pool: str,
    registered_model_name: str,
    mlflow_run: dsl.Output[dsl.Markdown],
) -> NamedTuple("Prepared", run_dir=str, config_path=str, rounds=list[int], lanes=list[str], parent_run_id=str):
    """Check the cluster has what ``trainer_backend`` needs, validate the config, stage data, create streams and KV
    bucket, open the MLflow parent run (tagged with this KFP run's id and link); the run's page shows the MLflow run's
    link (artifact ``mlflow_run``)."""
    from collections import namedtuple

    from tidal.kube.steps import parent_run, run_start, staging

    knobs = staging.PipelineKnobs(
        rounds=rounds,
        iterations_per_round=iterations_per_round,
        rollout_workers=rollout_workers,
        group_size=group_size,
        prompts_per_iteration=prompts_per_iteration,
        mode=mode,
        experiment=experiment,
        nats_url=nats_url,
        tracking_uri=tracking_uri,
        overrides=overrides,
    )
    links = parent_run.RunLinks(kfp_ui_url=kfp_ui_url, mlflow_ui_url=mlflow_ui_url)
    run = run_start.prepare(
        config_yaml=config_yaml,
        config_path=config_path,
        run_dir=run_dir,
        job_id=job_id,
        knobs=knobs,
        links=links,
        trainer_backend=trainer_backend,
        worker_pool=worker_pool,
        registered_model_name=registered_model_name,
    )
    with open(mlflow_run.path, "w") as fh:
        fh.write(parent_run.mlflow_run_markdown(run.run_dir))
    prepared = namedtuple("Prepared", ["run_dir", "config_path", "rounds", "lanes", "parent_run_id"])
    return prepared(run.run_dir, run.config_path, run.rounds, run.lanes, run.parent_run_id)


@component
def worker_pool(
    worker_pool: str,
    run_dir: str,
    config_path: str,
    namespace: str,
    accelerator: str,
    image: str,
    accelerators: int,
    cpu: str,
    memory: str,
    min_workers: int,
    max_workers: int,
    lag_threshold: int,
    node_selector: str,
    preferred_nodes: str,
    toleration_key: str,
    termination_grace_s: int,
    queue_name: str,
):
    """worker_pool=elastic: the run's rollout-worker Deployment and its KEDA ScaledObject (scaled on the WORK stream);
    fixed: nothing (each round runs its own rollout-worker tasks)."""
    from tidal.kube.pool import elastic_step
    from tidal.kube.steps.staging import PoolSettings

    settings = PoolSettings(
        min_workers=min_workers,
        max_workers=max_workers,
        lag_threshold=lag_threshold,
        node_selector=node_selector,
        preferred_nodes=preferred_nodes,
        toleration_key=toleration_key,
        termination_grace_s=termination_grace_s,
    )
    elastic_step.start_worker_pool(
        worker_pool=worker_pool,
        run_dir=run_dir,
        config_path=config_path,
        namespace=namespace,
        accelerator=accelerator,
        image=image,
        accelerators=accelerators,
        cpu=cpu,
        memory=memory,
        settings=settings,
        queue_name=queue_name,
    )


@component
def open_round(run_dir: str, config_path: str, round_index: int, job_id: str):
    """Take the round lease (the previous round must have ended), set the KV run state to 'running round N'."""
    from tidal.kube.steps import rounds

    rounds.open_round(run_dir=run_dir, config_path=config_path, round_index=int(round_index), job_id=job_id)


@component
def rollout_worker(run_dir: str, config_path: str, lane: str, round_index: int):
    """One long-running rollout worker; exits when the round is over."""
    from tidal.kube.pool import fixed as fixed_pool

    fixed_pool.rollout_worker(run_dir=run_dir, config_path=config_path, lane=lane, round_index=int(round_index))


@component
def train(
    run_dir: str,
    config_path: str,
    round_index: int,
    iterations: int,
    backend: str,
    nodes: int,
    accelerators_per_node: int,
    accelerator: str,
    image: str,
    namespace: str,
    pipeline_job_id: str,
    cpu: str,
    memory: str,
    deadline_s: int,
    start_timeout_s: int,
    queue_name: str,
):
    """The round's trainer: a TrainJob or PyTorchJob (waited for, logs streamed) or, locally, the trainer role itself.
    On any failure it marks the run failed (the round's workers stop) and deletes the job."""
    from tidal.kube.trainer import launch as trainer_launch

    placement = trainer_launch.TrainerPlacement(
        backend=backend,
        nodes=nodes,
        accelerators_per_node=accelerators_per_node,
        accelerator=accelerator,
        image=image,
        namespace=namespace,
        pipeline_job_id=pipeline_job_id,
        cpu=cpu,
        memory=memory,
        deadline_s=deadline_s,
        start_timeout_s=start_timeout_s,
        queue_name=queue_name,
    )
    trainer_launch.train_round(run_dir=run_dir, config_path=config_path, round_index=int(round_index), iterations=iterations, placement=placement)


@component
def weight_sync(run_dir: str, round_index: int) -> NamedTuple("Synced", version=int, weights_path=str):
    """Verify and publish the round's checkpoint: move `latest`, log it to MLflow."""
    from collections import namedtuple

    from tidal.kube.steps import rounds

    synced = rounds.weight_sync(run_dir=run_dir, round_index=int(round_index))
    return namedtuple("Synced", ["version", "weights_path"])(synced.version, synced.path)


@component
def evaluate(run_dir: str, config_path: str, weights_path: str, round_index: int, job_id: str, metrics: dsl.Output[dsl.Metrics]) -> float:
    """Held-out accuracy of the round's checkpoint, to MLflow and as KFP metrics; releases the round lease."""
    from tidal.kube.steps import rounds

    values = rounds.evaluate(run_dir=run_dir, config_path=config_path, weights_path=weights_path, round_index=int(round_index), job_id=job_id)
    for name, value in values.items():
        metrics.log_metric(name, value)
    return float(values.get("accuracy", next(iter(values.values()))))


@component
def register_model(run_dir: str, registered_model_name: str) -> str:
    """Register the final checkpoint in the MLflow model registry; returns the model version."""
    from tidal.kube.steps import run_end

    return run_end.register_model(run_dir=run_dir, registered_model_name=registered_model_name)


@component
def finalize(run_dir: str, job_id: str, namespace: str, run_metrics: dsl.Output[dsl.Metrics]) -> str:
    """The exit handler (runs after success, failure or cancellation): the run's final held-out metrics as a
    KFP metrics artifact at the top of the run, then delete leftover trainer jobs, end the MLflow run as
    FINISHED or FAILED, delete the run's NATS streams and KV bucket."""
    from tidal.kube.steps import rounds, run_end

    for name, value in rounds.final_metrics(run_dir=run_dir, job_id=job_id).items():
        run_metrics.log_metric(name, value)
    return "\n".join(run_end.finalize_run(run_dir=run_dir, job_id=job_id, namespace=namespace))

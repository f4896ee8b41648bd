"""The looping training pipeline.

::

    exit handler ┌ prepare ─▶ (worker_pool=elastic: the run's worker Deployment + KEDA ScaledObject) ─▶ training loop (rounds one after another: ParallelFor, parallelism 1)
                 │              └─ round: open_round ─▶ lanes ∥ (trainer | rollout-0 … rollout-N-1) ─▶ weight_sync ─▶ evaluate
                 │           ─▶ register_model (the final snapshot, in the MLflow registry)
                 └ finalize, however the run ended: delete leftover trainer jobs, end the MLflow run, delete streams and KV

KFP v2 carries no state between loop iterations; each round reads what the
previous one left in the run's storage (run directory on the PVC, NATS KV,
MLflow) and the trainer resumes from the latest checkpoint. The trainer and the
rollout workers of a round are lanes of one ParallelFor so that they run at the
same time everywhere, kfp.local included (it runs sibling tasks one by one but
loop iterations concurrently).

The accelerator profile (nvidia, ascend, cpu) is fixed at compile time: it
picks the image, the accelerator resource and node placement. Everything a user
chooses per run is a pipeline parameter with a default.
"""

import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml
from kfp import compiler, dsl, kubernetes

from tidal.kube import cluster
from tidal.kube.cluster import AcceleratorProfile
from tidal.kube.pipeline import components as c
from tidal.kube.pipeline.ir_check import driver_resolution_violations
from tidal.kube.pipeline.parameters import LOOP_PARAMETERS, ROUND_PARAMETERS, per_round_values, pipeline_function, run_parameters
from tidal.kube.pipeline.task_settings import LONG_STEP_TIMEOUT_S, as_rollout_worker, in_queue, on_accelerator, on_cluster, retried
from tidal.kube.submit.backend import strip_above_floor

PIPELINE_NAME = "tidal-grpo"


def build_pipeline(profile: AcceleratorProfile, image: str = "", queue_name: str = "") -> Callable:
    """The pipeline function for one accelerator profile; ``image`` (default: the profile's) is
    also the default of the ``trainer_image`` parameter, so the trainer job runs what the steps run.
    ``queue_name``: the Kueue LocalQueue of the trainer job and of every accelerator pod (workers,
    evaluation, the trainer in its step), so they are admitted from one quota."""
    step_image = image or profile.image

    @dsl.pipeline(name=f"{PIPELINE_NAME}-round", description="One round: rollout workers ∥ trainer, then sync and eval.")
    @pipeline_function(ROUND_PARAMETERS)
    def round_pipeline(p):
        job_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        opened = retried(on_cluster(open_round(run_dir=p.run_dir, config_path=p.config_path, round_index=p.round_index, job_id=job_id), mlflow=True))
        with dsl.ParallelFor(p.lanes, name="lanes: trainer and rollout workers") as lane:
            with dsl.If(lane == "trainer", name="trainer-lane"):
                trainer_args = dict(
                    run_dir=p.run_dir,
                    config_path=p.config_path,
                    round_index=p.round_index,
                    iterations=p.iterations_per_round,
                    backend=p.trainer_backend,
                    nodes=p.trainer_nodes,
                    accelerators_per_node=p.trainer_accelerators_per_node,
                    accelerator=profile.name,
                    image=p.trainer_image,
                    namespace=p.namespace,
                    pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    cpu=p.trainer_cpu,
                    memory=p.trainer_memory,
                    deadline_s=p.trainer_deadline_s,
                    start_timeout_s=p.trainer_start_timeout_s,
                    queue_name=queue_name,
                )
                # Resources are fixed per task, the backend is a run parameter: one task per backend.
                with dsl.If(p.trainer_backend != "local", name="trainer-job"):
                    # a launcher: creates the trainer job, streams its logs, waits; the job has the resources
                    trainer = launcher = on_cluster(train(**trainer_args)).set_display_name("train (job launcher)")
                with dsl.Else(name="trainer-in-step"):
                    # trainer_backend=local trains in this pod: it gets what a trainer replica would get
                    in_step = train(**trainer_args)
                    on_cluster(in_step, nats_role="trainer", cpu=p.trainer_cpu, memory=p.trainer_memory, mlflow=True, weights="signing")
                    in_step.set_display_name("train")
                    on_accelerator(in_step, profile, p.trainer_accelerators_per_node)
                    in_queue(in_step, queue_name)
                    for key, value in cluster.TRAINER_POD_LABEL.items():  # rollout workers' NCCL weight transfer reaches it
                        kubernetes.add_pod_label(in_step, label_key=key, label_value=value)
                for task in (launcher, in_step):
                    task.after(opened)
                    # the job's ownerReference and per-attempt name (tidal.kube.trainer.launch.launcher_pod)
                    kubernetes.use_field_path_as_env(task, env_name="TIDAL_POD_NAME", field_path="metadata.name")
                    kubernetes.use_field_path_as_env(task, env_name="TIDAL_POD_UID", field_path="metadata.uid")
            with dsl.Else(name="rollout-lane"):
                worker = rollout_worker(run_dir=p.run_dir, config_path=p.config_path, lane=lane, round_index=p.round_index)
                as_rollout_worker(on_cluster(worker, nats_role="worker", cpu=p.worker_cpu, memory=p.worker_memory, weights="public"))
                worker.set_display_name("rollout-worker")
                in_queue(on_accelerator(worker, profile, p.worker_accelerators), queue_name).after(opened)
        synced = retried(on_cluster(weight_sync(run_dir=p.run_dir, round_index=p.round_index), nats_role=None, mlflow=True, weights="public"))
        synced.after(trainer).after(worker)
        evaluation = evaluate(
            run_dir=p.run_dir, config_path=p.config_path, weights_path=synced.outputs["weights_path"], round_index=p.round_index, job_id=job_id
        )
        retried(
            on_cluster(evaluation, cpu=p.worker_cpu, memory=p.worker_memory, mlflow=True, weights="public"), LONG_STEP_TIMEOUT_S
        )  # NATS: it releases the round lease
        in_queue(on_accelerator(evaluation, profile, 1), queue_name)

    @dsl.pipeline(name=f"{PIPELINE_NAME}-loop", description="Rounds, one after another.")
    @pipeline_function(LOOP_PARAMETERS)
    def training_loop(p):
        with dsl.ParallelFor(p.rounds, parallelism=1, name="rounds, one after another") as round_index:
            round_pipeline(
                run_dir=p.run_dir, config_path=p.config_path, round_index=round_index, lanes=p.lanes, **per_round_values(p)
            ).set_caching_options(False).set_display_name("round")

    def run_steps(p):
        """prepare -> (the elastic worker pool) -> rounds -> register the model (inside the exit handler)."""
        prepared = retried(
            on_cluster(
                prepare(
                    config_yaml=p.config_yaml,
                    config_path=p.config_path,
                    run_dir=p.run_dir,
                    job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    rounds=p.rounds,
                    iterations_per_round=p.iterations_per_round,
                    rollout_workers=p.rollout_workers,
                    group_size=p.group_size,
                    prompts_per_iteration=p.prompts_per_iteration,
                    mode=p.mode,
                    experiment=p.experiment,
                    nats_url=p.nats_url,
                    tracking_uri=p.tracking_uri,
                    overrides=p.overrides,
                    kfp_ui_url=p.kfp_ui_url,
                    mlflow_ui_url=p.mlflow_ui_url,
                    trainer_backend=p.trainer_backend,
                    worker_pool=p.worker_pool,
                    registered_model_name=p.registered_model_name,
                ),
                mlflow=True,
            ),
            LONG_STEP_TIMEOUT_S,
        )
        # always runs (a dsl.If here would keep the loop from depending on it); with worker_pool=fixed it returns at once
        pool_task = pool_step(
            worker_pool=p.worker_pool,
            run_dir=prepared.outputs["run_dir"],
            config_path=prepared.outputs["config_path"],
            namespace=p.namespace,
            accelerator=profile.name,
            image=step_image,
            accelerators=p.worker_accelerators,
            cpu=p.worker_cpu,
            memory=p.worker_memory,
            min_workers=p.pool_min_workers,
            max_workers=p.pool_max_workers,
            lag_threshold=p.pool_lag_threshold,
            node_selector=p.pool_node_selector,
            preferred_nodes=p.pool_preferred_nodes,
            toleration_key=p.pool_toleration_key,
            termination_grace_s=p.pool_termination_grace_s,
            queue_name=queue_name,
        )
        retried(on_cluster(pool_task, nats_role=None)).set_display_name("worker pool (Deployment + KEDA ScaledObject)")
        # the run's owner object is read from this pod's ownerReferences
        kubernetes.use_field_path_as_env(pool_task, env_name="TIDAL_POD_NAME", field_path="metadata.name")
        loop = training_loop(
            run_dir=prepared.outputs["run_dir"],
            config_path=prepared.outputs["config_path"],
            rounds=prepared.outputs["rounds"],
            lanes=prepared.outputs["lanes"],
            **per_round_values(p),
        )
        loop.set_caching_options(False).set_display_name("training loop").after(pool_task)
        registered = register_model(run_dir=prepared.outputs["run_dir"], registered_model_name=p.registered_model_name)
        on_cluster(registered, nats_role=None, mlflow=True, weights="public").after(loop)

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description=f"Tidal GRPO with periodic asynchrony ({profile.name}): rounds of rollout "
        "workers ∥ trainer, weight sync and evaluation, tracked in MLflow.",
    )
    @pipeline_function(run_parameters(trainer_image=step_image))
    def tidal_pipeline(p):
        """Parameters: config_yaml (config text; wins over config_path), config_path (a config in the image),
        run_dir (default /mnt/tidal/runs/<job id>), rounds × iterations_per_round iterations in all,
        rollout_workers pods per round; group_size, prompts_per_iteration, mode: 0/'' keep the config's;
        overrides: key=value lines for any other config key; trainer_backend: trainjob (Kubeflow Trainer v2, new clusters),
        pytorchjob (Training Operator v1, existing clusters) or local (in the step's pod);
        trainer_image (default: the steps' image), trainer_cpu / trainer_memory: requests of each trainer replica;
        trainer_deadline_s: the trainer job's activeDeadlineSeconds (0: none); trainer_start_timeout_s: how long
        the job may stay Pending before the round fails; kfp_ui_url / mlflow_ui_url: where people open KFP and MLflow
        (the MLflow run is tagged with this run's KFP link and the run shows its MLflow link; empty: the run id only);
        worker_pool: fixed (rollout_workers worker tasks per round) or elastic (one Deployment for the run, scaled by KEDA
        on the WORK stream's pending items between pool_min_workers and pool_max_workers, 0: rollout_workers, one pod more per
        pool_lag_threshold items, 0: prompts_per_iteration / max); pool_node_selector (label=value,...: required),
        pool_preferred_nodes (label=value,...: preferred, other nodes when none is free) and pool_toleration_key
        place the pool on spot or preemptible nodes; pool_termination_grace_s: how long a
        preempted pod's worker has to hand back its work items."""
        # The exit handler: runs however the run ends; it may only read pipeline parameters (KFP rule), so it
        # finds the run directory as prepare does (run_dir, else /mnt/tidal/runs/<job id>).
        cleanup = finalize(run_dir=p.run_dir, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, namespace=p.namespace)
        retried(on_cluster(cleanup, mlflow=True)).set_display_name("finalize (run metrics, clean-up)")
        with dsl.ExitHandler(cleanup, name="tidal-run"):
            run_steps(p)

    return tidal_pipeline


# Component handles used above (module level so the pipeline reads like the diagram).
prepare, open_round, rollout_worker, train, pool_step = c.prepare, c.open_round, c.rollout_worker, c.train, c.worker_pool
weight_sync, evaluate, register_model, finalize = c.weight_sync, c.evaluate, c.register_model, c.finalize


def compile_pipeline(output_path, accelerator: str = "nvidia", image: str = "", queue_name: str = "") -> Path:
    """Write the pipeline YAML for ``accelerator``; every step runs ``image`` (default: the profile's);
    ``queue_name``: the Kueue LocalQueue of the trainer job and the accelerator pods (empty: none)."""
    profile = cluster.accelerator_profile(accelerator)
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(build_pipeline(profile, image, queue_name), str(raw))
        documents = list(yaml.safe_load_all(raw.read_text()))
    problems = driver_resolution_violations(documents[0])
    if problems:
        raise ValueError("the compiled pipeline has inputs the KFP driver cannot resolve:\n  - " + "\n  - ".join(problems))
    set_executor_images(documents[0], image or profile.image)
    strip_above_floor(documents)
    output.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return output


def set_executor_images(pipeline_spec: dict, image: str) -> None:
    for executor in pipeline_spec["deploymentSpec"]["executors"].values():
        executor["container"]["image"] = image

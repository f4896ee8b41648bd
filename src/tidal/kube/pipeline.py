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
from tidal.kube import components as c
from tidal.kube.cluster import AcceleratorProfile
from tidal.kube.ir_check import driver_resolution_violations
from tidal.kube.staging import DEFAULT_TERMINATION_GRACE_S

PIPELINE_NAME = "tidal-grpo"
DEFAULT_CONFIG_PATH = "/opt/tidal/examples/arithmetic.yaml"


WEIGHT_KEYS = (None, "public", "signing")
"""What a step holds of the snapshot keys: nothing, the public key (it loads or checks snapshots), or the private
key as well (it is the trainer, which signs them)."""


def on_cluster(
    task: dsl.PipelineTask,
    nats_role: str | None = "control",
    cpu: str = "500m",
    memory: str = "1Gi",
    *,
    mlflow: bool = False,
    weights: str | None = None,
) -> dsl.PipelineTask:
    """What every step gets on Kubernetes: the data PVC, the NetworkPolicy label, a non-root security context,
    resource requests, no caching (steps are stateful), and only the credentials it uses.
    ``nats_role``: the NATS user the step logs in as (cluster.NATS_ROLES), None for steps that do not use NATS;
    ``mlflow``: it logs to MLflow; ``weights``: which snapshot keys it holds (WEIGHT_KEYS)."""
    if weights not in WEIGHT_KEYS:
        raise ValueError(f"weights={weights!r}: choose one of {WEIGHT_KEYS}")
    task.set_caching_options(False)
    task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(memory)
    consume_channels(task, cpu, memory)
    kubernetes.mount_pvc(task, pvc_name=cluster.DATA_PVC, mount_path=cluster.DATA_MOUNT_PATH)
    if nats_role is not None:
        as_nats_user(task, nats_role)
    if weights is not None:
        kubernetes.use_config_map_as_env(task, config_map_name=cluster.WEIGHTS_PUBLIC_CONFIG_MAP, config_map_key_to_env=cluster.WEIGHTS_PUBLIC_ENV)
    if weights == "signing":
        kubernetes.use_secret_as_env(task, secret_name=cluster.WEIGHTS_SIGNING_SECRET, secret_key_to_env=cluster.WEIGHTS_SIGNING_SECRET_ENV)
    if mlflow:
        # the tracking URI is required (no Secret: the pod does not start, and says why); basic auth is optional
        kubernetes.use_secret_as_env(task, secret_name=cluster.MLFLOW_SECRET, secret_key_to_env=cluster.MLFLOW_SECRET_REQUIRED_ENV)
        kubernetes.use_secret_as_env(task, secret_name=cluster.MLFLOW_SECRET, secret_key_to_env=cluster.MLFLOW_SECRET_OPTIONAL_ENV, optional=True)
    for key, value in cluster.TIDAL_POD_LABEL.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    kubernetes.set_security_context(task, run_as_user=cluster.RUN_AS_USER, run_as_group=cluster.RUN_AS_GROUP, run_as_non_root=True)
    return task


def as_nats_user(task: dsl.PipelineTask, role: str) -> dsl.PipelineTask:
    """The step logs in to NATS as ``role``'s user, with that role's password from Secret tidal-nats (required)."""
    task.set_env_variable(cluster.NATS_USER_ENV, cluster.nats_user(role))
    kubernetes.use_secret_as_env(
        task, secret_name=cluster.NATS_SECRET, secret_key_to_env={cluster.nats_password_key(role): cluster.NATS_PASSWORD_ENV}
    )
    return task


def as_rollout_worker(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """A rollout-worker pod: the label the reward server's NetworkPolicy admits, and served rewards' API keys from
    Secret tidal-rewards (optional keys), as the elastic pool's pods get them (tidal.kube.worker_pool.pool_env)."""
    for key, value in cluster.WORKER_POD_LABEL.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    kubernetes.use_secret_as_env(task, secret_name=cluster.REWARD_SECRET, secret_key_to_env=cluster.REWARD_SECRET_ENV, optional=True)
    return task


def in_queue(task: dsl.PipelineTask, queue_name: str) -> dsl.PipelineTask:
    """Kueue admits this pod through ``queue_name`` (its pod integration). A KFP pod label is fixed when the
    pipeline is compiled (kfp-kubernetes takes no parameter there), so the queue is a compile option."""
    if queue_name:
        kubernetes.add_pod_label(task, label_key=cluster.QUEUE_LABEL, label_value=queue_name)
    return task


RETRY = dict(num_retries=2, backoff_duration="30s", backoff_factor=2.0, backoff_max_duration="600s")
"""For steps that are safe to run again (prepare, open_round, weight_sync, evaluate and finalize re-read or
overwrite the run's state): a NATS or MLflow blip does not fail the run. Trainer and workers are not retried:
the failed trainer has marked the run failed and stopped the round's workers."""
SHORT_STEP_TIMEOUT_S = 3600
"""Pod activeDeadlineSeconds of the bookkeeping steps (open_round, weight_sync, finalize). Trainer and workers have
none: the trainer job has its own deadline (trainer_deadline_s) and the workers end with their round."""
LONG_STEP_TIMEOUT_S = 6 * 3600
"""prepare (it may copy a large base model onto the volume) and evaluate (pass@k on the held-out set)."""


def retried(task: dsl.PipelineTask, timeout_s: int = SHORT_STEP_TIMEOUT_S) -> dsl.PipelineTask:
    task.set_retry(**RETRY)
    kubernetes.set_timeout(task, timeout_s)
    return task


def consume_channels(task: dsl.PipelineTask, *values) -> None:
    """Declare the pipeline parameters that a resource setting reads as inputs of ``task``.

    ``set_cpu_request(param)`` and friends put a ``{{$.inputs.parameters['pipelinechannel--…']}}``
    placeholder on the task but (kfp 2.17) do not register the channel, so the compiler does not
    thread it through the enclosing loop and condition DAGs. ``kfp.local`` looks the value up in
    outer scopes and runs; the KFP driver resolves a task's inputs only from its immediate parent
    DAG and fails the task before its pod starts ("parent DAG does not have input parameter").
    """
    from kfp.dsl import pipeline_channel

    channels = pipeline_channel.extract_pipeline_channels_from_any(list(values))
    if channels:
        task.register_pipeline_channels(channels)


def on_accelerator(task: dsl.PipelineTask, profile: AcceleratorProfile, count) -> dsl.PipelineTask:
    """Accelerator request, node placement and a memory-backed /dev/shm for an inference pod."""
    if profile.has_accelerator:
        task.set_accelerator_type(profile.resource).set_accelerator_limit(count)
        consume_channels(task, count)
    for key, value in profile.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for toleration in profile.tolerations:
        kubernetes.add_toleration(task, key=toleration.key, operator=toleration.operator, effect=toleration.effect)
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=profile.shm_size)
    return task


def build_pipeline(profile: AcceleratorProfile, image: str = "", queue_name: str = "") -> Callable:
    """The pipeline function for one accelerator profile; ``image`` (default: the profile's) is
    also the default of the ``trainer_image`` parameter, so the trainer job runs what the steps run.
    ``queue_name``: the Kueue LocalQueue of the trainer job and of every accelerator pod (workers,
    evaluation, the trainer in its step), so they are admitted from one quota."""
    step_image = image or profile.image

    @dsl.pipeline(name=f"{PIPELINE_NAME}-round", description="One round: rollout workers ∥ trainer, then sync and eval.")
    def round_pipeline(
        run_dir: str,
        config_path: str,
        round_index: int,
        lanes: list[str],
        iterations_per_round: int,
        trainer_backend: str,
        trainer_nodes: int,
        trainer_accelerators_per_node: int,
        worker_accelerators: int,
        worker_cpu: str,
        worker_memory: str,
        trainer_image: str,
        trainer_cpu: str,
        trainer_memory: str,
        trainer_deadline_s: int,
        trainer_start_timeout_s: int,
        namespace: str,
    ):
        job_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        opened = retried(on_cluster(open_round(run_dir=run_dir, config_path=config_path, round_index=round_index, job_id=job_id), mlflow=True))
        with dsl.ParallelFor(lanes, name="lanes: trainer and rollout workers") as lane:
            with dsl.If(lane == "trainer", name="trainer-lane"):
                trainer_args = dict(
                    run_dir=run_dir,
                    config_path=config_path,
                    round_index=round_index,
                    iterations=iterations_per_round,
                    backend=trainer_backend,
                    nodes=trainer_nodes,
                    accelerators_per_node=trainer_accelerators_per_node,
                    accelerator=profile.name,
                    image=trainer_image,
                    namespace=namespace,
                    pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                    cpu=trainer_cpu,
                    memory=trainer_memory,
                    deadline_s=trainer_deadline_s,
                    start_timeout_s=trainer_start_timeout_s,
                    queue_name=queue_name,
                )
                # Resources are fixed per task, the backend is a run parameter: one task per backend.
                with dsl.If(trainer_backend != "local", name="trainer-job"):
                    # a launcher: creates the trainer job, streams its logs, waits; the job has the resources
                    trainer = launcher = on_cluster(train(**trainer_args)).set_display_name("train (job launcher)")
                with dsl.Else(name="trainer-in-step"):
                    # trainer_backend=local trains in this pod: it gets what a trainer replica would get
                    in_step = train(**trainer_args)
                    on_cluster(in_step, nats_role="trainer", cpu=trainer_cpu, memory=trainer_memory, mlflow=True, weights="signing")
                    in_step.set_display_name("train")
                    on_accelerator(in_step, profile, trainer_accelerators_per_node)
                    in_queue(in_step, queue_name)
                    for key, value in cluster.TRAINER_POD_LABEL.items():  # rollout workers' NCCL weight transfer reaches it
                        kubernetes.add_pod_label(in_step, label_key=key, label_value=value)
                for task in (launcher, in_step):
                    task.after(opened)
                    # the job's ownerReference and per-attempt name (tidal.kube.trainer_launch.launcher_pod)
                    kubernetes.use_field_path_as_env(task, env_name="TIDAL_POD_NAME", field_path="metadata.name")
                    kubernetes.use_field_path_as_env(task, env_name="TIDAL_POD_UID", field_path="metadata.uid")
            with dsl.Else(name="rollout-lane"):
                worker = rollout_worker(run_dir=run_dir, config_path=config_path, lane=lane, round_index=round_index)
                as_rollout_worker(on_cluster(worker, nats_role="worker", cpu=worker_cpu, memory=worker_memory, weights="public"))
                worker.set_display_name("rollout-worker")
                in_queue(on_accelerator(worker, profile, worker_accelerators), queue_name).after(opened)
        synced = retried(on_cluster(weight_sync(run_dir=run_dir, round_index=round_index), nats_role=None, mlflow=True, weights="public"))
        synced.after(trainer).after(worker)
        evaluation = evaluate(
            run_dir=run_dir, config_path=config_path, weights_path=synced.outputs["weights_path"], round_index=round_index, job_id=job_id
        )
        retried(
            on_cluster(evaluation, cpu=worker_cpu, memory=worker_memory, mlflow=True, weights="public"), LONG_STEP_TIMEOUT_S
        )  # NATS: it releases the round lease
        in_queue(on_accelerator(evaluation, profile, 1), queue_name)

    @dsl.pipeline(name=f"{PIPELINE_NAME}-loop", description="Rounds, one after another.")
    def training_loop(
        run_dir: str,
        config_path: str,
        rounds: list[int],
        lanes: list[str],
        iterations_per_round: int,
        trainer_backend: str,
        trainer_nodes: int,
        trainer_accelerators_per_node: int,
        worker_accelerators: int,
        worker_cpu: str,
        worker_memory: str,
        trainer_image: str,
        trainer_cpu: str,
        trainer_memory: str,
        trainer_deadline_s: int,
        trainer_start_timeout_s: int,
        namespace: str,
    ):
        with dsl.ParallelFor(rounds, parallelism=1, name="rounds, one after another") as round_index:
            round_pipeline(
                run_dir=run_dir,
                config_path=config_path,
                round_index=round_index,
                lanes=lanes,
                iterations_per_round=iterations_per_round,
                trainer_backend=trainer_backend,
                trainer_nodes=trainer_nodes,
                trainer_accelerators_per_node=trainer_accelerators_per_node,
                worker_accelerators=worker_accelerators,
                worker_cpu=worker_cpu,
                worker_memory=worker_memory,
                trainer_image=trainer_image,
                trainer_cpu=trainer_cpu,
                trainer_memory=trainer_memory,
                trainer_deadline_s=trainer_deadline_s,
                trainer_start_timeout_s=trainer_start_timeout_s,
                namespace=namespace,
            ).set_caching_options(False).set_display_name("round")

    def run_steps(
        config_yaml,
        config_path,
        run_dir,
        rounds,
        iterations_per_round,
        rollout_workers,
        group_size,
        prompts_per_iteration,
        mode,
        overrides,
        experiment,
        nats_url,
        tracking_uri,
        trainer_backend,
        trainer_nodes,
        trainer_accelerators_per_node,
        worker_accelerators,
        worker_cpu,
        worker_memory,
        trainer_image,
        trainer_cpu,
        trainer_memory,
        trainer_deadline_s,
        trainer_start_timeout_s,
        namespace,
        registered_model_name,
        kfp_ui_url,
        mlflow_ui_url,
        pool,
    ):
        """prepare -> (the elastic worker pool) -> rounds -> register the model (inside the exit handler)."""
        prepared = retried(
            on_cluster(
                prepare(
                    config_yaml=config_yaml,
                    config_path=config_path,
                    run_dir=run_dir,
                    job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
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
                    kfp_ui_url=kfp_ui_url,
                    mlflow_ui_url=mlflow_ui_url,
                    trainer_backend=trainer_backend,
                    worker_pool=pool["worker_pool"],
                    registered_model_name=registered_model_name,
                ),
                mlflow=True,
            ),
            LONG_STEP_TIMEOUT_S,
        )
        # always runs (a dsl.If here would keep the loop from depending on it); with worker_pool=fixed it returns at once
        pool_task = pool_step(
            worker_pool=pool["worker_pool"],
            run_dir=prepared.outputs["run_dir"],
            config_path=prepared.outputs["config_path"],
            namespace=namespace,
            accelerator=profile.name,
            image=step_image,
            accelerators=worker_accelerators,
            cpu=worker_cpu,
            memory=worker_memory,
            min_workers=pool["pool_min_workers"],
            max_workers=pool["pool_max_workers"],
            lag_threshold=pool["pool_lag_threshold"],
            node_selector=pool["pool_node_selector"],
            preferred_nodes=pool["pool_preferred_nodes"],
            toleration_key=pool["pool_toleration_key"],
            termination_grace_s=pool["pool_termination_grace_s"],
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
            iterations_per_round=iterations_per_round,
            trainer_backend=trainer_backend,
            trainer_nodes=trainer_nodes,
            trainer_accelerators_per_node=trainer_accelerators_per_node,
            worker_accelerators=worker_accelerators,
            worker_cpu=worker_cpu,
            worker_memory=worker_memory,
            trainer_image=trainer_image,
            trainer_cpu=trainer_cpu,
            trainer_memory=trainer_memory,
            trainer_deadline_s=trainer_deadline_s,
            trainer_start_timeout_s=trainer_start_timeout_s,
            namespace=namespace,
        )
        loop.set_caching_options(False).set_display_name("training loop").after(pool_task)
        registered = register_model(run_dir=prepared.outputs["run_dir"], registered_model_name=registered_model_name)
        on_cluster(registered, nats_role=None, mlflow=True, weights="public").after(loop)

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description=f"Tidal GRPO with periodic asynchrony ({profile.name}): rounds of rollout "
        "workers ∥ trainer, weight sync and evaluation, tracked in MLflow.",
    )
    def tidal_pipeline(
        config_yaml: str = "",
        config_path: str = DEFAULT_CONFIG_PATH,
        run_dir: str = "",
        rounds: int = 4,
        iterations_per_round: int = 10,
        rollout_workers: int = 2,
        group_size: int = 0,
        prompts_per_iteration: int = 0,
        mode: str = "",
        overrides: str = "",
        experiment: str = "tidal",
        nats_url: str = cluster.NATS_URL,
        tracking_uri: str = "",
        trainer_backend: str = "trainjob",
        trainer_nodes: int = 1,
        trainer_accelerators_per_node: int = 1,
        worker_accelerators: int = 1,
        worker_cpu: str = "8",
        worker_memory: str = "32Gi",
        trainer_image: str = step_image,
        trainer_cpu: str = "8",
        trainer_memory: str = "64Gi",
        trainer_deadline_s: int = 24 * 3600,
        trainer_start_timeout_s: int = 3600,
        namespace: str = "",
        registered_model_name: str = "tidal-policy",
        kfp_ui_url: str = "",
        mlflow_ui_url: str = "",
        worker_pool: str = "fixed",
        pool_min_workers: int = 1,
        pool_max_workers: int = 0,
        pool_lag_threshold: int = 0,
        pool_node_selector: str = "",
        pool_preferred_nodes: str = "",
        pool_toleration_key: str = "",
        pool_termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S,
    ):
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
        cleanup = finalize(run_dir=run_dir, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, namespace=namespace)
        retried(on_cluster(cleanup, mlflow=True)).set_display_name("finalize (run metrics, clean-up)")
        with dsl.ExitHandler(cleanup, name="tidal-run"):
            run_steps(
                config_yaml=config_yaml,
                config_path=config_path,
                run_dir=run_dir,
                rounds=rounds,
                iterations_per_round=iterations_per_round,
                rollout_workers=rollout_workers,
                group_size=group_size,
                prompts_per_iteration=prompts_per_iteration,
                mode=mode,
                overrides=overrides,
                experiment=experiment,
                nats_url=nats_url,
                tracking_uri=tracking_uri,
                trainer_backend=trainer_backend,
                trainer_nodes=trainer_nodes,
                trainer_accelerators_per_node=trainer_accelerators_per_node,
                worker_accelerators=worker_accelerators,
                worker_cpu=worker_cpu,
                worker_memory=worker_memory,
                trainer_image=trainer_image,
                trainer_cpu=trainer_cpu,
                trainer_memory=trainer_memory,
                trainer_deadline_s=trainer_deadline_s,
                trainer_start_timeout_s=trainer_start_timeout_s,
                namespace=namespace,
                registered_model_name=registered_model_name,
                kfp_ui_url=kfp_ui_url,
                mlflow_ui_url=mlflow_ui_url,
                pool=dict(
                    worker_pool=worker_pool,
                    pool_min_workers=pool_min_workers,
                    pool_max_workers=pool_max_workers,
                    pool_lag_threshold=pool_lag_threshold,
                    pool_node_selector=pool_node_selector,
                    pool_preferred_nodes=pool_preferred_nodes,
                    pool_toleration_key=pool_toleration_key,
                    pool_termination_grace_s=pool_termination_grace_s,
                ),
            )

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
    output.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return output


def set_executor_images(pipeline_spec: dict, image: str) -> None:
    for executor in pipeline_spec["deploymentSpec"]["executors"].values():
        executor["container"]["image"] = image

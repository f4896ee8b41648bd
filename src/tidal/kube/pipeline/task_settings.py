"""What a pipeline task gets on Kubernetes: volume, credentials, labels, resources, accelerators, Kueue queue,
retries (kfp-kubernetes' settings, applied per task at compile time).

Only what KFP backend 2.5.0 knows (tidal.kube.submit.backend): no security context (the images' USER 1000 and each
step's own check keep pods non-root) and no optional Secret keys (the Secrets hold every key, empty = unset)."""

from kfp import dsl, kubernetes

from tidal.kube import cluster
from tidal.kube.cluster import AcceleratorProfile

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
    """What every step gets on Kubernetes: the data PVC, the NetworkPolicy label, resource requests, no caching
    (steps are stateful), and only the credentials it uses.
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
    if weights is not None:  # files the staged config names (weights.public_key_file, weights.signing_key_file)
        kubernetes.use_config_map_as_volume(task, config_map_name=cluster.WEIGHTS_PUBLIC_CONFIG_MAP, mount_path=cluster.WEIGHTS_PUBLIC_MOUNT_PATH)
    if weights == "signing":
        kubernetes.use_secret_as_volume(task, secret_name=cluster.WEIGHTS_SIGNING_SECRET, mount_path=cluster.WEIGHTS_SIGNING_MOUNT_PATH)
    if mlflow:
        # every key must exist (no Secret or key: the pod does not start, and says why); basic auth and the UI link
        # may be empty (unset), the tracking URI may not (tidal.kube.steps.pod_env)
        kubernetes.use_secret_as_env(task, secret_name=cluster.MLFLOW_SECRET, secret_key_to_env=cluster.MLFLOW_SECRET_ENV)
    for key, value in cluster.TIDAL_POD_LABEL.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
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
    Secret tidal-rewards (every key present, empty where a server needs none), as the elastic pool's pods get them
    (tidal.kube.pool.elastic.pool_env)."""
    for key, value in cluster.WORKER_POD_LABEL.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    kubernetes.use_secret_as_env(task, secret_name=cluster.REWARD_SECRET, secret_key_to_env=cluster.REWARD_SECRET_ENV)
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

"""A round's trainer as a Kubernetes job, whichever kind runs it: what both kinds share.

:mod:`tidal.kube.trainer.pytorchjob` (Training Operator v1) and :mod:`tidal.kube.trainer.trainjob` (Kubeflow
Trainer v2) build different objects around the same trainer pod, from the same spec:

- :class:`TrainerJobSpec`: everything that varies between trainer jobs (the rest comes from
  :mod:`tidal.kube.cluster`);
- the pod's parts: the ``torchrun`` command, env from the Secrets, resources, volumes, security
  context, labels and the launcher pod as owner; the job name's rule;
- :class:`TrainerJobBackend`, the interface both kinds implement, and :func:`run_trainer_job`:
  submit, stream the log, wait, and delete the job on any failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from kubernetes import client as k8s

from tidal.kube import cluster
from tidal.kube.cluster import AcceleratorProfile

POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}
"""In an Istio-injected namespace (Kubeflow profiles) a sidecar keeps the Master pod running after
``torchrun`` exits, so the job never succeeds; trainer pods reach NATS and MLflow directly."""
STRICT = "Strict"
"""Field validation for every object Tidal creates: the API server refuses a field it does not know (its default,
Warn, drops the field and creates the object without it)."""
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class TrainerJobSpec:
    """Everything that varies between trainer jobs; the rest comes from :mod:`tidal.kube.cluster`."""

    name: str
    config_path: str
    run_dir: str
    profile: AcceleratorProfile
    namespace: str = "tidal"
    image: str | None = None
    nodes: int = 1
    accelerators_per_node: int = 1
    procs_per_node: int | str | None = None
    iterations: int | None = None
    overrides: tuple[str, ...] = ()
    nats_url: str = cluster.NATS_URL
    cpu: str = "8"
    memory: str = "64Gi"
    backoff_limit: int = 2
    ttl_seconds_after_finished: int = 3600
    clean_pod_policy: str = "Running"
    active_deadline_seconds: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    queue_name: str = ""
    """Kueue LocalQueue: the job gets the ``kueue.x-k8s.io/queue-name`` label and waits (suspended) for admission."""
    owner: tuple[str, str] | None = None
    """``(name, uid)`` of the launcher pod: the job is garbage-collected with it (a deleted or cancelled run)."""

    @property
    def container_image(self) -> str:
        return self.image or self.profile.image

    @property
    def nproc_per_node(self) -> str:
        if self.procs_per_node is not None:
            return str(self.procs_per_node)
        if self.profile.has_accelerator and self.accelerators_per_node > 0:
            return str(self.accelerators_per_node)
        return "1"


# ---------------------------------------------------------------- the trainer pod


def trainer_command(spec: TrainerJobSpec) -> list[str]:
    """``torchrun`` reads nodes/rank/master from the PET_* variables the operator sets."""
    command = ["torchrun", "--no-python", "tidal", "train", spec.config_path, "--run-dir", spec.run_dir, "--nats-url", spec.nats_url]
    if spec.iterations is not None:
        command += ["--iterations", str(spec.iterations)]
    for override in spec.overrides:
        command += ["--set", override]
    return command


def secret_env(role: str = "trainer") -> list[k8s.V1EnvVar]:
    """What a pod of ``role`` ("trainer" or "worker") gets in its environment, and nothing more: its NATS user and
    password (required); a trainer also the MLflow endpoint (required) with MLflow's basic-auth credentials
    (optional keys). A worker does not log to MLflow. The snapshot keys are files (key_volumes)."""
    env = [
        k8s.V1EnvVar(name=cluster.NATS_USER_ENV, value=cluster.nats_user(role)),
        _secret_env_var(cluster.NATS_SECRET, cluster.nats_password_key(role), cluster.NATS_PASSWORD_ENV, optional=False),
    ]
    if role != "trainer":
        return env
    env += [_secret_env_var(cluster.MLFLOW_SECRET, key, name, optional=False) for key, name in cluster.MLFLOW_SECRET_REQUIRED_ENV.items()]
    env += [_secret_env_var(cluster.MLFLOW_SECRET, key, name, optional=True) for key, name in cluster.MLFLOW_SECRET_OPTIONAL_ENV.items()]
    return env


def reward_key_env() -> list[k8s.V1EnvVar]:
    """A rollout worker's API keys of served rewards (``api_key_env``), from Secret tidal-rewards: optional keys, since
    most reward servers need none (the in-cluster one is reachable by worker pods alone)."""
    return [_secret_env_var(cluster.REWARD_SECRET, key, name, optional=True) for key, name in cluster.REWARD_SECRET_ENV.items()]


def pod_ip_env() -> k8s.V1EnvVar:
    """The pod's IP: where rollout engines reach trainer rank 0 for the NCCL weight transfer
    (rollout.vllm.weight_sync: nccl)."""
    return k8s.V1EnvVar(name="POD_IP", value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP")))


def key_volumes(role: str = "trainer") -> list[k8s.V1Volume]:
    """The snapshot keys as files: the public key (ConfigMap) in every pod of ``role``, the private key (Secret) in
    a trainer's alone; both required. The staged config names where they are mounted (key_mounts)."""
    volumes = [k8s.V1Volume(name="weights-public", config_map=k8s.V1ConfigMapVolumeSource(name=cluster.WEIGHTS_PUBLIC_CONFIG_MAP, optional=False))]
    if role == "trainer":
        volumes.append(
            k8s.V1Volume(name="weights-signing", secret=k8s.V1SecretVolumeSource(secret_name=cluster.WEIGHTS_SIGNING_SECRET, optional=False))
        )
    return volumes


def key_mounts(role: str = "trainer") -> list[k8s.V1VolumeMount]:
    mounts = [k8s.V1VolumeMount(name="weights-public", mount_path=cluster.WEIGHTS_PUBLIC_MOUNT_PATH, read_only=True)]
    if role == "trainer":
        mounts.append(k8s.V1VolumeMount(name="weights-signing", mount_path=cluster.WEIGHTS_SIGNING_MOUNT_PATH, read_only=True))
    return mounts


def _secret_env_var(secret: str, key: str, name: str, optional: bool) -> k8s.V1EnvVar:
    selector = k8s.V1SecretKeySelector(name=secret, key=key, optional=optional)
    return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(secret_key_ref=selector))


def container_resources(spec: TrainerJobSpec) -> k8s.V1ResourceRequirements:
    requests = {"cpu": spec.cpu, "memory": spec.memory}
    limits = {"memory": spec.memory}
    if spec.profile.has_accelerator and spec.accelerators_per_node > 0:
        count = str(spec.accelerators_per_node)
        requests[spec.profile.resource] = count
        limits[spec.profile.resource] = count
    return k8s.V1ResourceRequirements(requests=requests, limits=limits)


def trainer_pod_security() -> k8s.V1PodSecurityContext:
    """Every trainer pod, whichever job kind runs it: not root, the data volume's group, the default seccomp profile."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=cluster.RUN_AS_USER,
        run_as_group=cluster.RUN_AS_GROUP,
        fs_group=cluster.RUN_AS_GROUP,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def trainer_volumes(spec: TrainerJobSpec) -> list[k8s.V1Volume]:
    """The run's data volume, a memory-backed /dev/shm (the process group's shared memory) and the snapshot keys."""
    return [
        k8s.V1Volume(name="data", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=cluster.DATA_PVC)),
        k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.profile.shm_size)),
        *key_volumes("trainer"),
    ]


def owner_references(spec: TrainerJobSpec) -> list[k8s.V1OwnerReference] | None:
    """The launcher pod as the job's owner. Not a controller, and ``blockOwnerDeletion`` off: setting
    it would need ``update`` on ``pods/finalizers``, which the launcher's Role does not grant."""
    if spec.owner is None:
        return None
    name, uid = spec.owner
    return [k8s.V1OwnerReference(api_version="v1", kind="Pod", name=name, uid=uid, controller=False, block_owner_deletion=False)]


def job_labels(spec: TrainerJobSpec) -> dict[str, str]:
    """Kueue admits a job by the queue label on the job itself (it suspends the job until then)."""
    labels = {**cluster.TIDAL_POD_LABEL, **spec.labels}
    if spec.queue_name:
        labels[cluster.QUEUE_LABEL] = spec.queue_name
    return labels


def rendezvous_network_policy(spec: TrainerJobSpec) -> dict:
    """The job's pods (label tidal.trainer-job=<job>) admit the job's own pods on every port: torchrun's rendezvous, the
    process group's store and NCCL, whose ports are chosen at run time. manifests/base/networkpolicy.yaml denies every
    other ingress to Tidal's pods, but the rollout workers' NCCL weight transfer. Owned, as the job is, by the launcher pod."""
    own = {"matchLabels": {cluster.TRAINER_JOB_LABEL: spec.name}}
    metadata = {"name": f"{spec.name}-rendezvous", "namespace": spec.namespace, "labels": job_labels(spec)}
    if (owners := owner_references(spec)) is not None:
        metadata["ownerReferences"] = [k8s.ApiClient().sanitize_for_serialization(o) for o in owners]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": own}]}]},
    }


def create_rendezvous_network_policy(spec: TrainerJobSpec, api_client=None) -> None:
    """Creates the job's NetworkPolicy before the job, so its pods can rendezvous from their start."""
    if api_client is None:
        from tidal.kube.in_cluster import cluster_api_client

        api_client = cluster_api_client()
    k8s.NetworkingV1Api(api_client).create_namespaced_network_policy(spec.namespace, rendezvous_network_policy(spec), field_validation="Strict")


def name_violations(metadata: dict) -> list[str]:
    """The name's rule and the label values': the API server refuses either."""
    name = metadata.get("name") or ""
    problems = []
    if len(name) > 63 or not _DNS1035.match(name):
        problems.append(
            f"metadata.name: {name!r} must be a DNS-1035 label (lower-case letters, digits, '-', starting with a letter, at most 63 characters)"
        )
    for key, value in (metadata.get("labels") or {}).items():
        if not cluster.is_label_value(value):
            problems.append(
                f"metadata.labels.{key}: {value!r} is not a label value (at most 63 letters, digits, '-', '_', '.', starting and ending with a letter or digit)"
            )
    return problems


# ---------------------------------------------------------------- submission


@dataclass(frozen=True)
class JobOutcome:
    name: str
    succeeded: bool
    message: str = ""


class TrainerJobBackend(Protocol):
    """How a round's trainer runs on a cluster: a PyTorchJob or a Kubeflow Trainer v2 TrainJob."""

    def submit(self, spec: TrainerJobSpec) -> str:
        """Create the job; return its name."""

    def stream_logs(self, name: str, namespace: str) -> None:
        """Print the master's log until it ends."""

    def wait(self, name: str, namespace: str, timeout_s: int) -> JobOutcome:
        """Block until the job succeeded or failed."""

    def delete(self, name: str, namespace: str) -> None:
        """Remove the job and its pods."""


class TrainerJobFailed(RuntimeError):
    """The trainer job ended without success; the message carries the operator's."""


def run_trainer_job(backend: TrainerJobBackend, spec: TrainerJobSpec, timeout_s: int = 7 * 24 * 3600) -> JobOutcome:
    """Submit, stream the master's log, wait; raise with the operator's message if the job failed.

    On any failure after the job was created — it never started, failed, outlived ``timeout_s``,
    or this step was cancelled — the job is deleted, so its pods release their accelerators. A job
    whose creation failed is not deleted: a name clash must not remove someone else's job.
    """
    name = backend.submit(spec)
    try:
        backend.stream_logs(name, spec.namespace)
        outcome = backend.wait(name, spec.namespace, timeout_s)
        if not outcome.succeeded:
            raise TrainerJobFailed(f"trainer job {spec.namespace}/{name} failed: {outcome.message}")
        return outcome
    except BaseException:
        delete_quietly(backend, name, spec.namespace)
        raise


def delete_quietly(backend: TrainerJobBackend, name: str, namespace: str) -> None:
    try:
        backend.delete(name, namespace)
        print(f"deleted trainer job {namespace}/{name}", flush=True)
    except Exception as err:  # the original failure matters more; the ownerReference and deadline still apply
        print(f"could not delete trainer job {namespace}/{name}: {err}", flush=True)

"""Names and accelerator profiles shared by the pipeline, the PyTorchJob and ``manifests/``.

A cluster set up from ``manifests/`` provides exactly these objects; the
compiled pipeline and the trainer job refer to them by these names.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

# The Kubernetes version the manifests and jobs are validated against (offline schemas).
KUBERNETES_VERSION = "1.31.0"

DATA_PVC = "tidal-data"
"""PVC holding run directories: weights, checkpoints, staged data. ReadWriteMany on a cluster (pods on
several nodes mount it); its class and access mode are each overlay's DATA_STORAGE_CLASS / DATA_ACCESS_MODE."""
DATA_MOUNT_PATH = "/mnt/tidal"
RUNS_ROOT = f"{DATA_MOUNT_PATH}/runs"

NATS_URL = "nats://tidal-nats:4222"
NATS_SECRET = "tidal-nats"
"""Secret with one NATS password per role (key ``<role>-password``); the NATS server reads them all."""
NATS_ROLES = ("control", "trainer", "worker")
"""Who connects to the cluster's NATS, each as its own user with its own subject permissions (``auth.conf`` in
manifests/base/nats.yaml): ``control``, the pipeline's bookkeeping steps (prepare, open_round, the trainer job
launcher, evaluate, finalize): the run's streams, run state and round lease; ``trainer``, trainer rank 0: work
items, the policy pointer, consuming ROLLOUTS; ``worker``, rollout workers: pulling WORK, publishing groups."""
NATS_USER_ENV, NATS_PASSWORD_ENV = "NATS_USER", "NATS_PASSWORD"
"""What a client reads (tidal.transport.credentials_from_env)."""


def nats_user(role: str) -> str:
    """The NATS user of ``role``: ``tidal-<role>``."""
    if role not in NATS_ROLES:
        raise ValueError(f"unknown NATS role {role!r}; choose one of: {', '.join(NATS_ROLES)}")
    return f"tidal-{role}"


def nats_password_key(role: str) -> str:
    """The key of ``role``'s password in Secret ``tidal-nats``."""
    nats_user(role)
    return f"{role}-password"


NATS_SERVER_SECRET_ENV = {nats_password_key(role): f"NATS_{role.upper()}_PASSWORD" for role in NATS_ROLES}
"""The NATS server's environment: every role's password, which auth.conf names as ``$NATS_<ROLE>_PASSWORD``."""

WEIGHTS_SIGNING_SECRET = "tidal-weights-signing"
"""Secret whose key ``private-key`` is the trainer's Ed25519 private key (tidal.weights.signing), which signs each
snapshot's manifest: mounted as a file in trainer pods only (the trainer job's replicas; the train step with
trainer_backend=local). Required: a missing Secret stops the pod from starting, naming it."""
WEIGHTS_SIGNING_MOUNT_PATH = "/etc/tidal/weights-signing"
WEIGHTS_SIGNING_KEY_FILE = f"{WEIGHTS_SIGNING_MOUNT_PATH}/private-key"
"""The staged config's ``weights.signing_key_file``: where a trainer pod reads the private key."""
WEIGHTS_PUBLIC_CONFIG_MAP = "tidal-weights-public"
"""ConfigMap whose key ``public-key`` is the matching public key: mounted as a file in every pod that loads or checks
a snapshot (rollout workers, weight_sync, evaluate, register_model, trainer pods), which refuses one the trainer did
not sign. Required, as the signing Secret is."""
WEIGHTS_PUBLIC_MOUNT_PATH = "/etc/tidal/weights-public"
WEIGHTS_PUBLIC_KEY_FILE = f"{WEIGHTS_PUBLIC_MOUNT_PATH}/public-key"
"""The staged config's ``weights.public_key_file``."""

MLFLOW_STATIC_PREFIX = "/tidal/mlflow"
"""The MLflow server's --static-prefix (manifests/base/mlflow.yaml): every route, the REST API included, is under it,
and components/kubeflow-gateway routes the same prefix of the Kubeflow gateway to it."""
MLFLOW_URL = f"http://tidal-mlflow:5000{MLFLOW_STATIC_PREFIX}"
"""The in-cluster tracking URI (the ``tracking-uri`` of Secret tidal-mlflow)."""
MLFLOW_SECRET = "tidal-mlflow"
"""Secret with the MLflow tracking URI (required: a missing Secret stops the pod from starting, naming it,
instead of the run falling back to a local store) and optional basic-auth credentials."""
MLFLOW_SECRET_REQUIRED_ENV = {"tracking-uri": "MLFLOW_TRACKING_URI"}
MLFLOW_UI_URL_ENV = "TIDAL_MLFLOW_UI_URL"
"""Where people open the MLflow UI (e.g. https://kubeflow.example.com/tidal/mlflow/), when the ``mlflow_ui_url``
pipeline parameter is empty: the run's MLflow link then works without every submitter passing it."""
MLFLOW_SECRET_OPTIONAL_ENV = {"username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD", "ui-url": MLFLOW_UI_URL_ENV}
MLFLOW_SECRET_ENV = {**MLFLOW_SECRET_REQUIRED_ENV, **MLFLOW_SECRET_OPTIONAL_ENV}
MLFLOW_STORES_SECRET = "tidal-mlflow-stores"
"""Secret of the MLflow server's Postgres and S3 credentials (manifests/components/mlflow-postgres-s3)."""

WORKLOAD_SERVICE_ACCOUNT = "tidal-workload"
"""Service account of trainer pods: no API permissions, token not mounted."""
PIPELINE_SERVICE_ACCOUNT = "pipeline-runner"
"""Standalone KFP's service account for pipeline pods; allowed to manage PyTorchJobs."""
PIPELINE_SERVICE_ACCOUNTS = (PIPELINE_SERVICE_ACCOUNT, "default-editor")
"""Every account that runs pipeline pods: standalone KFP's, and multi-user Kubeflow's in a profile namespace."""


@dataclass(frozen=True)
class StorageClassInfo:
    """A storage class an overlay may name for ``tidal-data``: where it exists and what it provides."""

    where: str
    access_modes: tuple[str, ...]


RWO, RWOP, ROX, RWX = "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany", "ReadWriteMany"
FILE_SHARE_MODES = (RWO, ROX, RWX)

STORAGE_CLASSES: dict[str, StorageClassInfo] = {
    # kind's default (rancher local-path-provisioner): "Only support ReadWriteOnce access mode".
    "standard": StorageClassInfo("kind (local-path; also minikube's default, GKE's pd-standard)", (RWO, RWOP)),
    "efs-sc": StorageClassInfo("EKS, AWS EFS CSI driver (a class you create with your file system id)", FILE_SHARE_MODES),
    "standard-rwx": StorageClassInfo("GKE, Filestore CSI add-on (basic HDD, 1 TiB minimum)", FILE_SHARE_MODES),
    "premium-rwx": StorageClassInfo("GKE, Filestore CSI add-on (basic SSD, 2.5 TiB minimum)", FILE_SHARE_MODES),
    "enterprise-rwx": StorageClassInfo("GKE, Filestore CSI add-on (enterprise, 1 TiB minimum)", FILE_SHARE_MODES),
    "azurefile-csi": StorageClassInfo("AKS, built in (Azure Files, standard)", FILE_SHARE_MODES),
    "azurefile-csi-premium": StorageClassInfo("AKS, built in (Azure Files, premium)", FILE_SHARE_MODES),
    "csi-nas": StorageClassInfo("Huawei Cloud CCE, built in (SFS)", FILE_SHARE_MODES),
    "csi-sfsturbo": StorageClassInfo("Huawei Cloud CCE, built in (SFS Turbo)", FILE_SHARE_MODES),
    "nfs-client": StorageClassInfo("on premises, nfs-subdir-external-provisioner's default", FILE_SHARE_MODES),
}
"""Classes the overlays and docs/kubernetes.md name, with the access modes their provisioners grant.
A claim asking for a mode its class lacks stays Pending (or fails to provision) without a clear error."""


def storage_problems(claim_name: str, storage_class: str | None, access_modes: list[str], multi_node: bool) -> list[str]:
    """What is wrong with a claim's class and access modes; empty when the class grants them.

    ``storage_class`` None means the cluster's default class, which grants ReadWriteOnce on every cloud
    and on kind, and ReadWriteMany nowhere. ``multi_node``: pods on several nodes mount the claim."""
    if storage_class is None:
        problems = [f"{claim_name}: no storageClassName: the default class grants ReadWriteOnce only"] if set(access_modes) - {RWO} else []
    elif storage_class not in STORAGE_CLASSES:
        problems = [f"{claim_name}: storage class {storage_class!r} is not one of the known classes ({', '.join(sorted(STORAGE_CLASSES))})"]
    else:
        lacking = sorted(set(access_modes) - set(STORAGE_CLASSES[storage_class].access_modes))
        problems = [f"{claim_name}: class {storage_class!r} does not grant {', '.join(lacking)}"] if lacking else []
    if multi_node and RWX not in access_modes:
        problems.append(f"{claim_name}: pods on several nodes mount it, so it must be {RWX}")
    return problems


RUN_AS_USER = 1000
RUN_AS_GROUP = 1000
TIDAL_POD_LABEL = {"app.kubernetes.io/part-of": "tidal"}
"""Pods with this label may reach NATS and MLflow (see manifests/base/networkpolicy.yaml)."""
WORKER_POD_LABEL = {"app.kubernetes.io/component": "rollout-worker"}
"""On every rollout-worker pod, the fixed pool's tasks and the elastic pool's Deployment alike: the pods the reward
server's NetworkPolicy admits (manifests/components/reward-server)."""
TRAINER_POD_LABEL = {"app.kubernetes.io/component": "trainer"}
"""On every trainer pod (the trainer job's replicas, the train step with trainer_backend=local): the pods rollout
workers exchange the NCCL weight transfer with (manifests/base/networkpolicy.yaml)."""
TRAINER_JOB_LABEL = "tidal.trainer-job"
"""On each trainer job's pods: the job's name. The job's own NetworkPolicy admits its rendezvous from these pods only
(tidal.kube.trainer.shared.rendezvous_network_policy)."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's LocalQueue label: on a trainer job (PyTorchJob, TrainJob) and on worker pods (Kueue's pod integration)."""

REWARD_SERVER = "tidal-reward-server"
"""The in-cluster reward server of manifests/components/reward-server: its Deployment, Service and NetworkPolicy."""
REWARD_SERVER_PORT = 8000
REWARD_SERVER_URL = f"http://{REWARD_SERVER}:{REWARD_SERVER_PORT}"
"""What a reward_model entry's ``url`` names on the cluster (the Service in the run's own namespace); vLLM serves
``/classify`` at its root."""
REWARD_SERVER_MODEL = "reward-model"
"""The server's ``--served-model-name``: the entry's ``model``, whatever model the overlay serves."""
REWARD_SECRET = "tidal-rewards"
"""Optional Secret of served rewards' API keys: each key present becomes its variable in every rollout-worker pod,
for a reward entry's ``api_key_env``."""
REWARD_SECRET_ENV = {"reward-model-api-key": "TIDAL_REWARD_MODEL_API_KEY", "judge-api-key": "TIDAL_JUDGE_API_KEY"}

RUN_LABEL = "tidal.run"
"""On each trainer job: the run directory's name, as :func:`label_value` makes it a label value."""
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
"""Kubernetes' label-value rule (at most 63 characters besides)."""
MAX_LABEL_VALUE = 63
LABEL_HASH_CHARS = 8


def is_label_value(text: str) -> bool:
    return len(text) <= MAX_LABEL_VALUE and LABEL_VALUE.fullmatch(text) is not None


def label_value(text: str) -> str:
    """``text`` itself when it is a valid label value; otherwise its allowed characters (others become '-'),
    cut to fit, with a short hash of ``text`` so that two names that clean up alike keep different values."""
    if is_label_value(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:LABEL_HASH_CHARS]
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", text)
    cleaned = cleaned[: MAX_LABEL_VALUE - LABEL_HASH_CHARS - 1].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


@dataclass(frozen=True)
class Toleration:
    key: str
    operator: str = "Exists"
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class AcceleratorProfile:
    """What a pod needs to get one kind of accelerator, and the image that drives it."""

    name: str
    resource: str | None
    image: str
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    shm_size: str = "8Gi"

    @property
    def has_accelerator(self) -> bool:
        return self.resource is not None


IMAGE_REPOSITORY = "ghcr.io/tidal-rl"
IMAGE_TAG = "0.1.0"

PROFILES: dict[str, AcceleratorProfile] = {
    "nvidia": AcceleratorProfile(
        name="nvidia",
        resource="nvidia.com/gpu",
        image=f"{IMAGE_REPOSITORY}/tidal-cuda:{IMAGE_TAG}",
        tolerations=(Toleration(key="nvidia.com/gpu"),),
    ),
    "ascend": AcceleratorProfile(
        name="ascend",
        resource="huawei.com/Ascend910",
        image=f"{IMAGE_REPOSITORY}/tidal-ascend:{IMAGE_TAG}",
        node_selector={"accelerator": "huawei-Ascend910"},
        tolerations=(Toleration(key="huawei.com/Ascend910"),),
    ),
    "cpu": AcceleratorProfile(
        name="cpu",
        resource=None,
        image=f"{IMAGE_REPOSITORY}/tidal-cpu:{IMAGE_TAG}",
        shm_size="1Gi",
    ),
}


def accelerator_profile(name: str) -> AcceleratorProfile:
    """The profile called ``name``; a clear error lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown accelerator profile {name!r}; choose one of: {known}") from None


DEFAULT_TERMINATION_GRACE_S = 120
"""How long a preempted or scaled-down pool pod may take to stop: its worker hands back its work items and
shuts its engine down (a spot node's notice is often 30 s to 2 min)."""

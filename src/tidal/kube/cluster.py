"""Names and accelerator profiles shared by the pipeline, the PyTorchJob and ``manifests/``.

A cluster set up from ``manifests/`` provides exactly these objects; the
compiled pipeline and the trainer job refer to them by these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The Kubernetes version the manifests and jobs are validated against (offline schemas).
KUBERNETES_VERSION = "1.31.0"

DATA_PVC = "tidal-data"
"""ReadWriteMany PVC holding run directories: weights, checkpoints, staged data."""
DATA_MOUNT_PATH = "/mnt/tidal"
RUNS_ROOT = f"{DATA_MOUNT_PATH}/runs"

NATS_URL = "nats://tidal-nats:4222"
NATS_SECRET = "tidal-nats"
"""Secret with the NATS client credentials; the NATS server reads the same keys."""
NATS_SECRET_ENV = {"user": "NATS_USER", "password": "NATS_PASSWORD"}

MLFLOW_URL = "http://tidal-mlflow:5000"
MLFLOW_SECRET = "tidal-mlflow"
"""Secret with the MLflow tracking URI and (optional) basic-auth credentials."""
MLFLOW_SECRET_ENV = {
    "tracking-uri": "MLFLOW_TRACKING_URI",
    "username": "MLFLOW_TRACKING_USERNAME",
    "password": "MLFLOW_TRACKING_PASSWORD",
}

WORKLOAD_SERVICE_ACCOUNT = "tidal-workload"
"""Service account of trainer pods: no API permissions, token not mounted."""
PIPELINE_SERVICE_ACCOUNT = "pipeline-runner"
"""Standalone KFP's service account for pipeline pods; allowed to manage PyTorchJobs."""
PIPELINE_SERVICE_ACCOUNTS = (PIPELINE_SERVICE_ACCOUNT, "default-editor")
"""Every account that runs pipeline pods: standalone KFP's, and multi-user Kubeflow's in a profile namespace."""

RUN_AS_USER = 1000
RUN_AS_GROUP = 1000
TIDAL_POD_LABEL = {"app.kubernetes.io/part-of": "tidal"}
"""Pods with this label may reach NATS and MLflow (see manifests/base/networkpolicy.yaml)."""


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

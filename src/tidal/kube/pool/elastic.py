"""The elastic rollout-worker pool (``worker_pool=elastic``): one Deployment per run, scaled by KEDA.

Instead of a fixed set of rollout-worker tasks in every round, the ``worker_pool`` step creates, once per
run, a Deployment of rollout-worker pods (:mod:`tidal.kube.pool.pod_entry` is their entry) and a KEDA
``ScaledObject`` that sizes it from the WORK stream: KEDA's ``nats-jetstream`` scaler reads the
``workers`` consumer's pending plus unacknowledged items from nats-server's monitoring port and asks for
``ceil(lag / lagThreshold)`` pods, between the pool's minimum and maximum.

Both objects are owned by the run's owner object (the Argo Workflow that owns the step's pod), so deleting
the KFP run deletes them; finalize deletes them as soon as the run ends. Both are created with strict field
validation. The run records the pool before creating it (``RUN_DIR/kube/worker-pool.json``), so finalize
finds what a killed step left.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client as k8s

from tidal.kube import cluster
from tidal.kube.cluster import DEFAULT_TERMINATION_GRACE_S, AcceleratorProfile, Toleration
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.kube.trainer.shared import (
    POD_ANNOTATIONS,
    STRICT,
    key_mounts,
    key_volumes,
    name_violations,
    reward_key_env,
    secret_env,
    trainer_pod_security,
)
from tidal.rundir import RunDir

KEDA_GROUP, KEDA_VERSION, KEDA_PLURAL = "keda.sh", "v1alpha1", "scaledobjects"
KEDA_CRD = f"{KEDA_PLURAL}.{KEDA_GROUP}"
KEDA_MIN_VERSION = "2.16"
"""The oldest KEDA release whose ScaledObject schema and nats-jetstream scaler the tests check (tests/data/crds)."""
NATS_MONITOR_PORT = 8222
NATS_ACCOUNT = "$G"
"""nats-server's global account: manifests/base/nats.yaml declares users, no accounts, so every stream is in it."""
SCALER_TYPE = "nats-jetstream"
POOL_LABEL = "tidal.pool"
CONTAINER = "rollout-worker"
POLLING_INTERVAL_S = 10
COOLDOWN_S = 300
MAX_POOL_NAME = 40
"""A Deployment's pods are named ``<name>-<replica set hash>-<5 characters>``; this keeps pod names well under 63."""


@dataclass(frozen=True)
class OwnerRef:
    api_version: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class PoolSpec:
    """Everything that varies between pools; names of Secrets, volume and service account come from :mod:`cluster`."""

    name: str
    namespace: str
    run_label: str
    config_path: str
    run_dir: str
    stream: str
    profile: AcceleratorProfile
    image: str
    min_workers: int
    max_workers: int
    lag_threshold: int
    accelerators: int = 1
    cpu: str = "8"
    memory: str = "32Gi"
    node_selector: dict[str, str] = field(default_factory=dict)
    preferred_nodes: dict[str, str] = field(default_factory=dict)  # labels the scheduler prefers, not requires
    tolerations: tuple[Toleration, ...] = ()
    termination_grace_s: int = DEFAULT_TERMINATION_GRACE_S
    queue_name: str = ""
    owner: OwnerRef | None = None
    consumer: str = "workers"

    @property
    def monitoring_endpoint(self) -> str:
        """Where KEDA's operator (another namespace) reads nats-server's /jsz: the Service's monitor port."""
        host = cluster.NATS_URL.removeprefix("nats://").split(":")[0]
        return f"{host}.{self.namespace}.svc:{NATS_MONITOR_PORT}"


def pool_name(run_name: str) -> str:
    """``tidal-pool-<run>-<hash>``: a DNS-1035 label unique per run, short enough for its pods' names."""
    digest = hashlib.sha256(run_name.encode()).hexdigest()[:6]
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    head = ("tidal-pool-" + slug)[: MAX_POOL_NAME - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


def parse_node_selector(text: str, parameter: str = "pool_node_selector") -> dict[str, str]:
    """``key=value`` pairs, comma-separated (the pool's extra node labels, e.g. a spot pool's); empty: none."""
    selector = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise PipelineStepError(f"{parameter}: {part!r} must look like label=value (several: comma-separated)")
        selector[key.strip()] = value.strip()
    return selector


def most_workers(workers) -> int:
    """The staged ``rollout.workers`` (prepare sets it from ``rollout_workers``): a number, or a range's ``max``."""
    return workers if isinstance(workers, int) else int(workers.max)


def pool_sizes(min_workers: int, max_workers: int, lag_threshold: int, rollout_workers: int, prompts_per_iteration: int) -> tuple[int, int, int]:
    """``(min, max, lagThreshold)``. ``max_workers`` 0: ``rollout_workers`` (the config's, after the run form's
    override). ``lag_threshold`` 0: the items per worker that put the whole pool to work at an iteration's
    start, ``ceil(prompts_per_iteration / max)``: KEDA asks for ``ceil(lag / threshold)`` pods."""
    maximum = max_workers or rollout_workers
    if min_workers < 0 or maximum < 1 or min_workers > maximum:
        raise PipelineStepError(f"pool_min_workers ({min_workers}) and pool_max_workers ({maximum}) must satisfy 0 <= min <= max, max >= 1")
    if lag_threshold < 0:
        raise PipelineStepError(f"pool_lag_threshold must be 0 (derived) or positive, got {lag_threshold}")
    return min_workers, maximum, lag_threshold or max(1, math.ceil(prompts_per_iteration / maximum))


# ---------------------------------------------------------------- the objects


def pool_labels(spec: PoolSpec) -> dict[str, str]:
    return {**cluster.TIDAL_POD_LABEL, **cluster.WORKER_POD_LABEL, cluster.RUN_LABEL: spec.run_label, POOL_LABEL: spec.name}


def owner_references(spec: PoolSpec) -> list[dict] | None:
    """The run's owner, not as controller (the Deployment controls its pods) and without ``blockOwnerDeletion``
    (that would need ``update`` on the owner's finalizers)."""
    if spec.owner is None:
        return None
    o = spec.owner
    return [{"apiVersion": o.api_version, "kind": o.kind, "name": o.name, "uid": o.uid, "controller": False, "blockOwnerDeletion": False}]


def metadata(spec: PoolSpec) -> dict:
    meta = {"name": spec.name, "namespace": spec.namespace, "labels": pool_labels(spec)}
    refs = owner_references(spec)
    if refs:
        meta["ownerReferences"] = refs
    return meta


def pool_env() -> list[k8s.V1EnvVar]:
    """As the fixed pool's worker step: the worker NATS user and its password, served rewards' API keys (optional);
    and the pod's name, the worker id. The snapshots' public key is a file (key_volumes)."""
    pod_name = k8s.V1EnvVar(name="POD_NAME", value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name")))
    return [pod_name, *secret_env("worker"), *reward_key_env()]


def pool_command(spec: PoolSpec) -> list[str]:
    """The container's entry is the pool worker itself (no shell between): it is PID 1 and gets the pod's SIGTERM.
    ``python3``: the interpreter's name in every Tidal image (the CUDA image's venv, python:3.11-slim, vllm-ascend's)."""
    return ["python3", "-m", "tidal.kube.pool.pod_entry", "--config", spec.config_path, "--run-dir", spec.run_dir]


def preferred_node_affinity(labels: dict[str, str]) -> k8s.V1Affinity | None:
    """Nodes with all of ``labels`` preferred, others still allowed: a pool that runs on spot nodes while there
    are some and on on-demand ones when spot capacity is gone (a nodeSelector would leave its pods Pending)."""
    if not labels:
        return None
    term = k8s.V1NodeSelectorTerm(match_expressions=[k8s.V1NodeSelectorRequirement(key=k, operator="In", values=[v]) for k, v in labels.items()])
    preferred = [k8s.V1PreferredSchedulingTerm(weight=100, preference=term)]
    return k8s.V1Affinity(node_affinity=k8s.V1NodeAffinity(preferred_during_scheduling_ignored_during_execution=preferred))


def build_deployment(spec: PoolSpec) -> dict:
    resources = {"cpu": spec.cpu, "memory": spec.memory}
    limits = {"memory": spec.memory}
    if spec.profile.has_accelerator and spec.accelerators > 0:
        resources[spec.profile.resource] = limits[spec.profile.resource] = str(spec.accelerators)
    queue_label = {cluster.QUEUE_LABEL: spec.queue_name} if spec.queue_name else {}
    pod_labels = pool_labels(spec) | queue_label
    tolerations = [*spec.profile.tolerations, *spec.tolerations]
    container = k8s.V1Container(
        name=CONTAINER,
        image=spec.image,
        command=pool_command(spec),
        env=pool_env(),
        resources=k8s.V1ResourceRequirements(requests=resources, limits=limits),
        volume_mounts=[
            k8s.V1VolumeMount(name="data", mount_path=cluster.DATA_MOUNT_PATH),
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
            *key_mounts("worker"),
        ],
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"])),
    )
    pod = k8s.V1PodSpec(
        containers=[container],
        service_account_name=cluster.WORKLOAD_SERVICE_ACCOUNT,
        automount_service_account_token=False,
        termination_grace_period_seconds=spec.termination_grace_s,
        restart_policy="Always",
        security_context=trainer_pod_security(),
        node_selector={**spec.profile.node_selector, **spec.node_selector} or None,
        affinity=preferred_node_affinity(spec.preferred_nodes),
        tolerations=[k8s.V1Toleration(key=t.key, operator=t.operator, effect=t.effect or None) for t in tolerations] or None,
        volumes=[
            k8s.V1Volume(name="data", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=cluster.DATA_PVC)),
            k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.profile.shm_size)),
            *key_volumes("worker"),
        ],
    )
    deployment = k8s.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        # Kueue's Deployment integration reads the queue from the Deployment's own labels, its pod integration from the pods'
        metadata={**metadata(spec), "labels": metadata(spec)["labels"] | queue_label},
        spec=k8s.V1DeploymentSpec(
            replicas=spec.min_workers,
            revision_history_limit=1,
            selector=k8s.V1LabelSelector(match_labels={POOL_LABEL: spec.name}),
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=pod_labels, annotations=dict(POD_ANNOTATIONS)), spec=pod),
        ),
    )
    manifest = k8s.ApiClient().sanitize_for_serialization(deployment)
    problems = deployment_violations(manifest)
    if problems:
        raise PipelineStepError("the worker pool's Deployment would be refused: " + "; ".join(problems))
    return manifest


def build_scaled_object(spec: PoolSpec) -> dict:
    """KEDA's ScaledObject on the pool's Deployment; trigger metadata names as KEDA's nats_jetstream_scaler.go reads them."""
    trigger = {
        "type": SCALER_TYPE,
        "metadata": {
            "natsServerMonitoringEndpoint": spec.monitoring_endpoint,
            "account": NATS_ACCOUNT,
            "stream": spec.stream,
            "consumer": spec.consumer,
            "lagThreshold": str(spec.lag_threshold),
            "activationLagThreshold": "0",
        },
    }
    return {
        "apiVersion": f"{KEDA_GROUP}/{KEDA_VERSION}",
        "kind": "ScaledObject",
        "metadata": metadata(spec),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicaCount": spec.min_workers,
            "maxReplicaCount": spec.max_workers,
            "pollingInterval": POLLING_INTERVAL_S,
            "cooldownPeriod": COOLDOWN_S,
            "triggers": [trigger],
        },
    }


def deployment_violations(manifest: dict) -> list[str]:
    """The apps/v1 rules a Deployment's API server checks that a schema does not: the name and label values, a
    selector its template's labels match, containers with names and images, the owner references' fields."""
    problems = name_violations(manifest["metadata"])
    spec = manifest.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if not selector:
        problems.append("spec.selector.matchLabels: required")
    elif any(template_labels.get(k) != v for k, v in selector.items()):
        problems.append("spec.template.metadata.labels: must match spec.selector")
    for key, value in template_labels.items():
        if not cluster.is_label_value(value):
            problems.append(f"spec.template.metadata.labels.{key}: {value!r} is not a label value")
    pod = (spec.get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or []
    if not containers:
        problems.append("spec.template.spec.containers: required")
    problems += [
        f"spec.template.spec.containers[{i}]: name and image are required" for i, c in enumerate(containers) if not (c.get("name") and c.get("image"))
    ]
    if pod.get("restartPolicy", "Always") != "Always":
        problems.append("spec.template.spec.restartPolicy: a Deployment's pods must restart Always")
    if spec.get("replicas", 1) < 0:
        problems.append("spec.replicas: must be >= 0")
    refs = manifest["metadata"].get("ownerReferences") or []
    for i, ref in enumerate(refs):
        missing = [key for key in ("apiVersion", "kind", "name", "uid") if not ref.get(key)]
        if missing:
            problems.append(f"metadata.ownerReferences[{i}]: {', '.join(missing)} required")
    if sum(1 for ref in refs if ref.get("controller")) > 1:
        problems.append("metadata.ownerReferences: at most one controller")
    return problems


# ---------------------------------------------------------------- on the cluster


class KedaNotInstalled(PipelineStepError):
    """The cluster has no KEDA ScaledObject CRD (or not the version Tidal's objects need)."""


def check_keda_installed(extensions_api) -> None:
    try:
        crd = extensions_api.read_custom_resource_definition(KEDA_CRD)
    except k8s.ApiException as err:
        if err.status == 404:
            raise KedaNotInstalled(
                f"worker_pool=elastic needs KEDA >= {KEDA_MIN_VERSION}: no CRD {KEDA_CRD} on the cluster (docs/kubernetes.md, 'Elastic worker pool')"
            ) from None
        raise
    versions = {v.name for v in crd.spec.versions if v.served}
    if KEDA_VERSION not in versions:
        raise KedaNotInstalled(f"worker_pool=elastic needs KEDA >= {KEDA_MIN_VERSION}: CRD {KEDA_CRD} serves {sorted(versions)}, not {KEDA_VERSION}")


def run_owner(core_api, pod_name: str, namespace: str) -> OwnerRef | None:
    """The controller of this step's pod (the run's Argo Workflow): what the pool is deleted with. None outside a cluster run."""
    if not pod_name:
        return None
    pod = core_api.read_namespaced_pod(pod_name, namespace)
    for ref in pod.metadata.owner_references or []:
        if ref.controller:
            return OwnerRef(api_version=ref.api_version, kind=ref.kind, name=ref.name, uid=ref.uid)
    return None


def create_pool(spec: PoolSpec, api_client) -> list[str]:
    """Create the Deployment, then the ScaledObject; an object of that name already there (a retried step) is kept."""
    apps, custom = k8s.AppsV1Api(api_client), k8s.CustomObjectsApi(api_client)
    done = []
    for what, create in (
        ("Deployment", lambda: apps.create_namespaced_deployment(spec.namespace, build_deployment(spec), field_validation=STRICT)),
        (
            "ScaledObject",
            lambda: custom.create_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, spec.namespace, KEDA_PLURAL, build_scaled_object(spec), field_validation=STRICT
            ),
        ),
    ):
        try:
            create()
            done.append(f"created {what} {spec.namespace}/{spec.name}")
        except k8s.ApiException as err:
            if err.status != 409:
                raise PipelineStepError(
                    f"the API server refused the worker pool's {what}: {err.status} {err.reason}: {(err.body or '')[:300]}"
                ) from None
            done.append(f"{what} {spec.namespace}/{spec.name} is already there (an earlier attempt of this step)")
    return done


def record_pool(run: RunDir, namespace: str, name: str) -> None:
    records = StepRecords(run).create()
    records.write(pool_record(run), {"namespace": namespace, "name": name})


def pool_record(run: RunDir) -> Path:
    return StepRecords(run).folder / "worker-pool.json"


def delete_pool(run: RunDir, api_client=None) -> list[str]:
    """Finalize: the recorded pool's ScaledObject (first, so KEDA does not scale what is going) and Deployment."""
    path = pool_record(run)
    if not path.is_file():
        return []
    record = StepRecords(run).read(path)
    namespace, name = record["namespace"], record["name"]
    from tidal.kube.in_cluster import is_not_found

    if api_client is None:
        from tidal.kube.in_cluster import cluster_api_client

        api_client = cluster_api_client()
    apps, custom = k8s.AppsV1Api(api_client), k8s.CustomObjectsApi(api_client)
    done = []
    for what, delete in (
        ("ScaledObject", lambda: custom.delete_namespaced_custom_object(KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL, name)),
        ("Deployment", lambda: apps.delete_namespaced_deployment(name, namespace)),
    ):
        try:
            delete()
            done.append(f"deleted {what} {namespace}/{name}")
        except Exception as err:
            if not is_not_found(err):
                raise
    return done


def step_pod_name() -> str:
    from tidal.kube.in_cluster import POD_NAME_ENV

    return next((os.environ[k] for k in POD_NAME_ENV if os.environ.get(k)), "")

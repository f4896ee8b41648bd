"""The trainer as a Kubeflow Trainer v2 TrainJob (``trainer.kubeflow.org/v1alpha1``, ``kubeflow`` SDK 0.5.0).

The job runs on the ``torch-distributed`` ClusterTrainingRuntime: the runtime supplies the JobSet,
the ``node`` replicated job and torchrun's ``PET_*`` rendezvous variables; the TrainJob sets image,
command, nodes, processes per node, resources and env (``spec.trainer``) and patches the pod
template (``spec.runtimePatches``: volumes, mounts, security contexts, placement, the service
account, the Istio opt-out and the NetworkPolicy label).

Same layers as :mod:`tidal.kube.trainer.pytorchjob`, around the same trainer pod, from the same
:class:`~tidal.kube.trainer.shared.TrainerJobSpec` (:mod:`tidal.kube.trainer.shared`):

- :func:`build_trainjob` turns the spec into the manifest and checks it with :func:`check_trainjob`
  (the SDK's typed models must keep every field, plus the Trainer webhook's rules);
- :class:`TrainJobBackend` submits it and waits, streams logs and deletes through ``TrainerClient``.

Why the manifest is built here and not by ``TrainerClient.train()``: ``train()`` takes env as plain
``str -> str`` (no ``secretKeyRef``: credentials would have to be in the job spec) and the Trainer
refuses ``runtimePatches`` env on the ``node`` container; and it sets only name, labels and
annotations in the metadata, so no ownerReference. The manifest is made of the SDK's own models
(``kubeflow_trainer_api``) and created over the client's Kubernetes connection.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s

from tidal.kube import cluster
from tidal.kube.trainer.shared import (
    POD_ANNOTATIONS,
    STRICT,
    JobOutcome,
    TrainerJobSpec,
    container_resources,
    job_labels,
    key_mounts,
    name_violations,
    owner_references,
    pod_ip_env,
    secret_env,
    trainer_command,
    trainer_pod_security,
    trainer_volumes,
)

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainJob"
PLURAL = "trainjobs"
CRD_NAME = f"{PLURAL}.{GROUP}"
RUNTIME = "torch-distributed"
RUNTIME_PLURAL = "clustertrainingruntimes"
REQUIRED_SPEC_FIELDS = ("runtimePatches", "activeDeadlineSeconds")
"""TrainJob fields Tidal sets that Kubeflow Trainer v2.2.0 added: an older API server drops them."""
MIN_TRAINER = "Kubeflow Trainer >= v2.2"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
NODE = "node"
"""The torch-distributed runtime's replicated job and its trainer container."""
PATCH_MANAGER = "tidal-rl.github.io/launcher"
RESERVED_CONTAINERS = (NODE, "dataset-initializer", "model-initializer")
"""Containers whose env the Trainer takes only from ``spec.trainer`` / ``spec.initializer``, never from a runtime patch."""
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
"""Set by the torch plugin from numNodes / numProcPerNode; the Trainer rejects a TrainJob that sets them."""


class TrainJobRejected(ValueError):
    """The TrainJob breaks a rule of the Trainer's webhook or the fields of its API."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("TrainJob rejected:\n  - " + "\n  - ".join(problems))


def _serialize(obj: Any) -> Any:
    return k8s.ApiClient().sanitize_for_serialization(obj)


# ---------------------------------------------------------------- building


def nproc_per_node(spec: TrainerJobSpec) -> int:
    """TrainJob's numProcPerNode is an integer (no ``auto``): one rank per accelerator, else 1."""
    value = spec.nproc_per_node
    if not value.isdigit():
        raise TrainJobRejected([f"spec.trainer.numProcPerNode: {value!r} must be a positive integer (TrainJob has no 'auto', 'cpu' or 'gpu')"])
    return int(value)


def trainer_section(spec: TrainerJobSpec) -> dict:
    env = secret_env() + [k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"), pod_ip_env()]
    return {
        "image": spec.container_image,
        "command": trainer_command(spec),
        "env": _serialize(env),
        "numNodes": spec.nodes,
        "numProcPerNode": nproc_per_node(spec),
        "resourcesPerNode": _serialize(container_resources(spec)),
    }


def pod_patch(spec: TrainerJobSpec) -> dict:
    """What the launcher patches into the runtime's ``node`` pods: the same pod as a PyTorchJob replica's."""
    labels = {**cluster.TIDAL_POD_LABEL, **cluster.TRAINER_POD_LABEL, **spec.labels}
    tolerations = [k8s.V1Toleration(key=t.key, operator=t.operator, effect=t.effect) for t in spec.profile.tolerations] or None
    pod_security = trainer_pod_security()
    volumes = trainer_volumes(spec)
    container = {
        "name": NODE,
        "volumeMounts": _serialize(
            [
                k8s.V1VolumeMount(name="data", mount_path=cluster.DATA_MOUNT_PATH),
                k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
                *key_mounts("trainer"),
            ]
        ),
        "securityContext": _serialize(k8s.V1SecurityContext(allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"]))),
    }
    pod_spec = {
        "serviceAccountName": cluster.WORKLOAD_SERVICE_ACCOUNT,
        "securityContext": _serialize(pod_security),
        "nodeSelector": dict(spec.profile.node_selector) or None,
        "tolerations": _serialize(tolerations),
        "volumes": _serialize(volumes),
        "containers": [container],
    }
    template = {"metadata": {"labels": labels, "annotations": dict(POD_ANNOTATIONS)}, "spec": {k: v for k, v in pod_spec.items() if v}}
    replicated_job = {"name": NODE, "template": {"spec": {"template": template}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated_job]}}}}


def build_trainjob(spec: TrainerJobSpec, runtime: str = RUNTIME) -> dict:
    """The TrainJob for ``spec`` as the API server receives it; raises :class:`TrainJobRejected` if the Trainer would."""
    metadata = {"name": spec.name, "namespace": spec.namespace, "labels": job_labels(spec)}
    owners = owner_references(spec)
    if owners:
        metadata["ownerReferences"] = _serialize(owners)
    job_spec = {
        "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": runtime},
        "trainer": trainer_section(spec),
        "runtimePatches": [pod_patch(spec)],
    }
    if spec.active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    manifest = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": job_spec}
    check_trainjob(manifest)
    return manifest


# ---------------------------------------------------------------- checks


def check_trainjob(manifest: dict) -> None:
    """Unknown or mistyped fields first (the SDK's models), then the webhook's rules; one error listing every problem."""
    problems = model_violations(manifest) or webhook_rule_violations(manifest)
    if problems:
        raise TrainJobRejected(problems)


def model_violations(manifest: dict) -> list[str]:
    """Every field must survive a round trip through the SDK's typed models (``kubeflow_trainer_api``, generated
    from the Trainer's API): a misspelled key is dropped there, as the API server's structural schema prunes it."""
    from kubeflow_trainer_api import models
    from pydantic import ValidationError

    try:
        typed = models.TrainerV1alpha1TrainJob.from_dict(manifest)
    except ValidationError as err:
        return [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
    return [f"{path}: not a field of the TrainJob API" for path in _dropped_paths(manifest, typed.to_dict())]


def _dropped_paths(sent: Any, kept: Any, path: str = "") -> list[str]:
    if isinstance(sent, dict) and isinstance(kept, dict):
        dropped = []
        for key, value in sent.items():
            child = f"{path}.{key}" if path else key
            dropped += [child] if key not in kept else _dropped_paths(value, kept[key], child)
        return dropped
    if isinstance(sent, list) and isinstance(kept, list):
        return [p for i, (s, k) in enumerate(zip(sent, kept)) for p in _dropped_paths(s, k, f"{path}[{i}]")]
    return []


def webhook_rule_violations(manifest: dict) -> list[str]:
    """The Trainer's TrainJob rules that Tidal's jobs could break, as messages naming the field."""
    spec = manifest.get("spec") or {}
    problems = name_violations(manifest.get("metadata") or {})
    problems += _runtime_ref_violations(spec.get("runtimeRef") or {})
    problems += _trainer_violations(spec.get("trainer") or {})
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and (not isinstance(deadline, int) or deadline < 1):
        problems.append(f"spec.activeDeadlineSeconds: must be a positive integer, got {deadline!r}")
    problems += _runtime_patch_violations(spec.get("runtimePatches") or [])
    return problems


def _runtime_ref_violations(ref: dict) -> list[str]:
    problems = [] if ref.get("name") else ["spec.runtimeRef.name: must be specified"]
    if ref.get("kind", "ClusterTrainingRuntime") not in RUNTIME_KINDS:
        problems.append(f"spec.runtimeRef.kind: {ref.get('kind')!r} must be one of {', '.join(RUNTIME_KINDS)}")
    if ref.get("apiGroup", GROUP) != GROUP:
        problems.append(f"spec.runtimeRef.apiGroup: must be {GROUP}")
    return problems


def _trainer_violations(trainer: dict) -> list[str]:
    problems = []
    for key in ("numNodes", "numProcPerNode"):
        value = trainer.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"spec.trainer.{key}: must be at least 1, got {value!r}")
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(TORCH_RESERVED_ENV))
    if reserved:
        problems.append(f"spec.trainer.env: {', '.join(reserved)} are set by the torch runtime from numNodes / numProcPerNode")
    return problems


def _runtime_patch_violations(patches: list[dict]) -> list[str]:
    problems = []
    managers = [p.get("manager") for p in patches]
    if any(not m for m in managers) or len(set(managers)) != len(managers):
        problems.append(f"spec.runtimePatches: each patch needs its own manager, got {managers}")
    for i, patch in enumerate(patches):
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
        for j, job in enumerate(jobs):
            path = f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            problems += _replicated_job_violations(path, job)
    return problems


def _replicated_job_violations(path: str, job: dict) -> list[str]:
    if job.get("name") != NODE:
        return [f"{path}.name: {job.get('name')!r} is not a replicated job of the {RUNTIME} runtime ({NODE})"]
    template = ((job.get("template") or {}).get("spec") or {}).get("template") or {}
    metadata = template.get("metadata") or {}
    problems = [
        f"{path}.template.spec.template.metadata.{key}: only labels and annotations may be patched"
        for key in metadata
        if key not in ("labels", "annotations")
    ]
    for k, container in enumerate((template.get("spec") or {}).get("containers") or []):
        if container.get("name") != NODE:
            problems.append(f"{path}.template.spec.template.spec.containers[{k}].name: the runtime has no container {container.get('name')!r}")
        if container.get("env") and container.get("name") in RESERVED_CONTAINERS:
            problems.append(f"{path}.template.spec.template.spec.containers[{k}].env: env of {container['name']!r} is set through spec.trainer only")
    return problems


# ---------------------------------------------------------------- submission


class TrainJobBackend:
    """:class:`~tidal.kube.trainer.shared.TrainerJobBackend` on Kubeflow Trainer v2, through ``TrainerClient``.

    ``client_factory(namespace)`` defaults to a ``TrainerClient`` on the in-cluster service account
    (or ``~/.kube/config``) for that namespace; one client per namespace, made on first use.
    """

    def __init__(self, client_factory: Callable[[str], Any] | None = None, polling_interval_s: int = 15, start_timeout_s: int = 3600):
        self._client_factory = client_factory or _default_trainer_client
        self._clients: dict[str, Any] = {}
        self._installs_checked: set[str] = set()
        self.polling_interval_s = polling_interval_s
        self.start_timeout_s = start_timeout_s

    def client(self, namespace: str) -> Any:
        if namespace not in self._clients:
            self._clients[namespace] = self._client_factory(namespace)
        return self._clients[namespace]

    def submit(self, spec: TrainerJobSpec) -> str:
        manifest = build_trainjob(spec)
        api = self.client(spec.namespace).backend.custom_api
        if spec.namespace not in self._installs_checked:
            check_trainer_installed(k8s.ApiextensionsV1Api(api.api_client), api)
            self._installs_checked.add(spec.namespace)
        api.create_namespaced_custom_object(GROUP, VERSION, spec.namespace, PLURAL, manifest, field_validation=STRICT)
        return spec.name

    def stream_logs(self, name: str, namespace: str) -> None:
        trainer = self.client(namespace)
        started = {"Running", "Complete", "Failed"}
        trainer.wait_for_job_status(name, status=started, timeout=self.start_timeout_s, polling_interval=self.polling_interval_s)
        for line in trainer.get_job_logs(name, follow=True):
            print(line, end="" if line.endswith("\n") else "\n", flush=True)

    def wait(self, name: str, namespace: str, timeout_s: int) -> JobOutcome:
        trainer = self.client(namespace)
        job = trainer.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=timeout_s, polling_interval=self.polling_interval_s)
        if job.status == "Complete":
            return JobOutcome(name=name, succeeded=True)
        return JobOutcome(name=name, succeeded=False, message=failure_message(trainer, namespace, name))

    def delete(self, name: str, namespace: str) -> None:
        self.client(namespace).delete_job(name)


class TrainerNotInstalled(RuntimeError):
    """The cluster's Kubeflow Trainer cannot run Tidal's TrainJob; the message says what to install."""


def missing_trainjob_fields(crd: dict) -> list[str]:
    """The fields of :data:`REQUIRED_SPEC_FIELDS` the TrainJob CRD's served ``v1alpha1`` does not describe."""
    served = [v for v in crd.get("spec", {}).get("versions", []) if v.get("name") == VERSION and v.get("served")]
    if not served:
        return [f"version {VERSION}"]
    schema = served[0].get("schema", {}).get("openAPIV3Schema", {})
    known = schema.get("properties", {}).get("spec", {}).get("properties", {})
    return [f"spec.{field}" for field in REQUIRED_SPEC_FIELDS if field not in known]


def check_trainer_installed(apiextensions_api: Any, custom_api: Any, runtime: str = RUNTIME) -> None:
    """Refuse, in one line, a cluster whose Trainer would drop Tidal's TrainJob fields or lacks the runtime."""
    crd = _read_or_none(lambda: apiextensions_api.read_custom_resource_definition(CRD_NAME))
    if crd is None:
        raise TrainerNotInstalled(f"no CRD {CRD_NAME}: install {MIN_TRAINER}, or use trainer_backend=pytorchjob")
    missing = missing_trainjob_fields(_serialize(crd))
    if missing:
        raise TrainerNotInstalled(
            f"the installed TrainJob CRD has no {', '.join(missing)}: Tidal needs {MIN_TRAINER} (upgrade it, or use trainer_backend=pytorchjob)"
        )
    if _read_or_none(lambda: custom_api.get_cluster_custom_object(GROUP, VERSION, RUNTIME_PLURAL, runtime)) is None:
        raise TrainerNotInstalled(
            f"no ClusterTrainingRuntime {runtime!r}: the Trainer's Helm chart leaves it out (runtimes.defaultEnabled=false); "
            "install it as docs/kubernetes.md says"
        )


def _read_or_none(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except k8s.ApiException as err:
        if err.status == 404:
            return None
        raise


TRAINJOB_EVENT_KINDS = frozenset({"TrainJob", "JobSet", "Job", "Pod"})


def failure_message(trainer: Any, namespace: str, name: str, last: int = 3) -> str:
    """The TrainJob's last events (OOMKilled, DeadlineExceeded, BackoffLimitExceeded, FailedScheduling…), read over
    `trainer`'s (a TrainerClient's) Kubernetes connection; best effort."""
    try:
        events = trainjob_events(trainer.backend.core_api, namespace, name)
    except Exception as err:
        return f"status Failed (events unavailable: {err})"
    lines = [f"{e.involved_object.kind}/{e.involved_object.name}: {e.reason}: {e.message}" for e in events[-last:]]
    return "status Failed" + ("; " + "; ".join(lines) if lines else "")


def trainjob_events(core_api: Any, namespace: str, name: str) -> list:
    """The events of TrainJob `name` and of what it made (its JobSet, Jobs and Pods, named after it), oldest
    first. Read here, not through TrainerClient.get_job_events, which drops every event without a
    firstTimestamp: those written through the events.k8s.io/v1 API (the scheduler's FailedScheduling among
    them) carry an eventTime instead."""
    events = core_api.list_namespaced_event(namespace).items

    def ours(event) -> bool:
        ref = event.involved_object
        return ref is not None and ref.kind in TRAINJOB_EVENT_KINDS and (ref.name == name or (ref.name or "").startswith(f"{name}-"))

    return sorted(filter(ours, events), key=event_time)


def event_time(event) -> datetime:
    """When an event first happened, by whichever of the two APIs wrote it (the oldest possible when neither says)."""
    created = event.metadata.creation_timestamp if event.metadata is not None else None
    return event.first_timestamp or event.event_time or created or datetime.min.replace(tzinfo=UTC)


def _default_trainer_client(namespace: str) -> Any:
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    return TrainerClient(backend_config=KubernetesBackendConfig(namespace=namespace))

"""The trainer as a Kubeflow PyTorchJob (Training Operator v1, kubeflow-training 1.9.4).

Three layers, each usable alone:

- :func:`build_pytorchjob` turns a :class:`~tidal.kube.trainer.shared.TrainerJobSpec` into the SDK's
  typed ``KubeflowOrgV1PyTorchJob`` (a misspelled field is a ``TypeError`` there), around the
  trainer pod every job kind shares (:mod:`tidal.kube.trainer.shared`);
- :func:`check_webhook_rules` applies the operator's admission-webhook rules and
  :func:`schema_violations` checks the serialized object strictly
  against a schema made from the SDK's models and Kubernetes' own pod schema,
  so a job that the API server would reject fails here, offline;
- :class:`PyTorchJobBackend` implements :class:`~tidal.kube.trainer.shared.TrainerJobBackend`
  with ``TrainingClient`` (:class:`tidal.kube.trainer.trainjob.TrainJobBackend`, Kubeflow Trainer v2,
  with ``TrainerClient``).

Training Operator v1 is deprecated: PyTorchJob stays for clusters that run it; new clusters use TrainJob.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from kubeflow.training import models as kf
from kubeflow.training.api_client import ApiClient
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

GROUP = "kubeflow.org"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "pytorchjobs"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"
REPLICA_TYPES = ("Master", "Worker")
CLEAN_POD_POLICIES = ("None", "Running", "All")
NPROC_KEYWORDS = ("auto", "cpu", "gpu")


class PyTorchJobRejected(ValueError):
    """The job breaks a rule that the Training Operator's webhook or the CRD schema enforces."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("PyTorchJob rejected:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------- building


def trainer_container(spec: TrainerJobSpec) -> k8s.V1Container:
    return k8s.V1Container(
        name=CONTAINER_NAME,
        image=spec.container_image,
        command=trainer_command(spec),
        env=secret_env() + [k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"), pod_ip_env()],
        resources=container_resources(spec),
        volume_mounts=[
            k8s.V1VolumeMount(name="data", mount_path=cluster.DATA_MOUNT_PATH),
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
            *key_mounts("trainer"),
        ],
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),
    )


def pod_template(spec: TrainerJobSpec) -> k8s.V1PodTemplateSpec:
    labels = {**cluster.TIDAL_POD_LABEL, **cluster.TRAINER_POD_LABEL, **spec.labels}
    tolerations = [k8s.V1Toleration(key=t.key, operator=t.operator, effect=t.effect) for t in spec.profile.tolerations] or None
    pod_spec = k8s.V1PodSpec(
        containers=[trainer_container(spec)],
        service_account_name=cluster.WORKLOAD_SERVICE_ACCOUNT,
        automount_service_account_token=False,
        node_selector=dict(spec.profile.node_selector) or None,
        tolerations=tolerations,
        security_context=trainer_pod_security(),
        volumes=trainer_volumes(spec),
    )
    return k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels, annotations=dict(POD_ANNOTATIONS)), spec=pod_spec)


def replica_specs(spec: TrainerJobSpec) -> dict[str, kf.KubeflowOrgV1ReplicaSpec]:
    if spec.nodes < 1:
        raise ValueError(f"trainer nodes must be at least 1, got {spec.nodes}")
    replicas = {"Master": kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="OnFailure", template=pod_template(spec))}
    if spec.nodes > 1:
        replicas["Worker"] = kf.KubeflowOrgV1ReplicaSpec(replicas=spec.nodes - 1, restart_policy="OnFailure", template=pod_template(spec))
    return replicas


def build_pytorchjob(spec: TrainerJobSpec) -> kf.KubeflowOrgV1PyTorchJob:
    """The typed job for ``spec``; raises :class:`PyTorchJobRejected` if the operator would."""
    run_policy = kf.KubeflowOrgV1RunPolicy(
        backoff_limit=spec.backoff_limit,
        ttl_seconds_after_finished=spec.ttl_seconds_after_finished,
        clean_pod_policy=spec.clean_pod_policy,
        active_deadline_seconds=spec.active_deadline_seconds,
    )
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version=API_VERSION,
        kind=KIND,
        metadata=k8s.V1ObjectMeta(name=spec.name, namespace=spec.namespace, labels=job_labels(spec), owner_references=owner_references(spec)),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=spec.nproc_per_node,
            pytorch_replica_specs=replica_specs(spec),
            run_policy=run_policy,
        ),
    )
    check_pytorchjob(job)
    return job


def pytorchjob_to_dict(job: Any) -> dict:
    """The job as the API server receives it (camelCase keys, no ``None``)."""
    if isinstance(job, dict):
        return job
    return ApiClient().sanitize_for_serialization(job)


# ---------------------------------------------------------------- webhook rules


def check_pytorchjob(job: Any) -> None:
    """Webhook rules, then the strict schema; one error listing every problem."""
    manifest = pytorchjob_to_dict(job)
    problems = webhook_rule_violations(manifest)
    if not problems:
        problems = schema_violations(manifest)
    if problems:
        raise PyTorchJobRejected(problems)


def check_webhook_rules(job: Any) -> None:
    problems = webhook_rule_violations(pytorchjob_to_dict(job))
    if problems:
        raise PyTorchJobRejected(problems)


def webhook_rule_violations(manifest: dict) -> list[str]:
    """The Training Operator v1.9 PyTorchJob webhook's checks, as messages naming the field."""
    problems = name_violations(manifest.get("metadata") or {})
    spec = manifest.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        return problems + ["spec.pytorchReplicaSpecs: must be specified"]
    problems += _elastic_policy_violations(spec, replicas)
    problems += _nproc_violations(spec)
    problems += _run_policy_violations(spec.get("runPolicy") or {})
    for replica_type, replica in replicas.items():
        problems += _replica_violations(replica_type, replica or {})
    if "Master" not in replicas:
        problems.append("spec.pytorchReplicaSpecs.Master: exactly one Master replica is required")
    return problems


def _elastic_policy_violations(spec: dict, replicas: dict) -> list[str]:
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        return []
    problems = []
    if "Worker" not in replicas:
        problems.append("spec.pytorchReplicaSpecs.Worker: must be configured if elasticPolicy is used")
    if spec.get("nprocPerNode") is not None and elastic.get("nProcPerNode") is not None:
        problems.append("spec.elasticPolicy.nProcPerNode: must not be used together with spec.nprocPerNode")
    return problems


def _nproc_violations(spec: dict) -> list[str]:
    nproc = spec.get("nprocPerNode")
    if nproc is None or nproc in NPROC_KEYWORDS or (str(nproc).isdigit() and int(nproc) > 0):
        return []
    return [f"spec.nprocPerNode: {nproc!r} must be a positive integer or one of {', '.join(NPROC_KEYWORDS)}"]


def _run_policy_violations(run_policy: dict) -> list[str]:
    """CRD enum and minimums the API server enforces before the webhook sees the job."""
    problems = []
    policy = run_policy.get("cleanPodPolicy")
    if policy is not None and policy not in CLEAN_POD_POLICIES:
        problems.append(f"spec.runPolicy.cleanPodPolicy: {policy!r} must be one of {', '.join(CLEAN_POD_POLICIES)}")
    for key in ("backoffLimit", "ttlSecondsAfterFinished", "activeDeadlineSeconds"):
        value = run_policy.get(key)
        if value is not None and (not isinstance(value, int) or value < 0):
            problems.append(f"spec.runPolicy.{key}: must be a non-negative integer, got {value!r}")
    return problems


def _replica_violations(replica_type: str, replica: dict) -> list[str]:
    path = f"spec.pytorchReplicaSpecs.{replica_type}"
    if replica_type not in REPLICA_TYPES:
        return [f"{path}: replica type must be one of {', '.join(REPLICA_TYPES)}"]
    problems = []
    if replica_type == "Master" and replica.get("replicas", 1) != 1:
        problems.append(f"{path}.replicas: must be 1, got {replica.get('replicas')}")
    containers = ((replica.get("template") or {}).get("spec") or {}).get("containers") or []
    if not containers:
        return problems + [f"{path}.template.spec.containers: must be specified"]
    for index, container in enumerate(containers):
        if not container.get("image"):
            problems.append(f"{path}.template.spec.containers[{index}].image: must be specified")
    if not any(c.get("name") == CONTAINER_NAME for c in containers):
        names = [c.get("name") for c in containers]
        problems.append(f"{path}.template.spec.containers: one container must be named {CONTAINER_NAME!r} (found {names})")
    return problems


# ---------------------------------------------------------------- schema


def schema_violations(manifest: dict, kubernetes_version: str = cluster.KUBERNETES_VERSION) -> list[str]:
    """Strict structural check: unknown or mistyped fields anywhere in the job, pod templates included."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(pytorchjob_json_schema(kubernetes_version))
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    return [f"{_json_path(e.absolute_path)}: {e.message}" for e in errors]


def _json_path(parts) -> str:
    return ".".join(str(p) for p in parts) or "<root>"


@lru_cache(maxsize=4)
def pytorchjob_json_schema(kubernetes_version: str) -> dict:
    """A JSON schema for ``kubeflow.org/v1`` PyTorchJob.

    The kubeflow part is generated from the SDK's model classes (``openapi_types``
    and ``attribute_map``, themselves generated from the operator's Go types);
    Kubernetes types (pod templates, object metadata) reference the strict
    definitions that ``kubernetes-validate`` ships for ``kubernetes_version``.
    """
    definitions = _kubernetes_definitions(kubernetes_version)
    defs = dict(definitions["$defs"])
    _add_model_definition(kf.KubeflowOrgV1PyTorchJob, defs)
    root = dict(defs[_model_key(kf.KubeflowOrgV1PyTorchJob)])
    root["properties"] = {**root["properties"], "apiVersion": {"const": API_VERSION}, "kind": {"const": KIND}}
    root["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {"$schema": definitions["$schema"], "$defs": defs, **root}


def _kubernetes_definitions(kubernetes_version: str) -> dict:
    from importlib import resources

    major_minor = ".".join(kubernetes_version.split(".")[:2])
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{major_minor}.0-local-strict"
    path = folder / "_definitions.json"
    if not path.is_file():
        raise ValueError(f"kubernetes-validate has no strict schemas for Kubernetes {kubernetes_version}")
    return json.loads(path.read_text())


def _model_key(model: type) -> str:
    return f"kubeflow.{model.__name__}"


def _add_model_definition(model: type, defs: dict) -> None:
    key = _model_key(model)
    if key in defs:
        return
    defs[key] = {}  # placeholder against recursion
    properties = {model.attribute_map[attr]: _type_schema(type_name, defs) for attr, type_name in model.openapi_types.items()}
    defs[key] = {"type": "object", "properties": properties, "additionalProperties": False}


_SCALARS = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "bool": {"type": "boolean"},
    "float": {"type": "number"},
    "datetime": {"type": "string"},
    "object": {},
}


def _type_schema(type_name: str, defs: dict) -> dict:
    if type_name in _SCALARS:
        return dict(_SCALARS[type_name])
    if type_name.startswith("list[") and type_name.endswith("]"):
        return {"type": "array", "items": _type_schema(type_name[5:-1], defs)}
    if type_name.startswith("dict(str, ") and type_name.endswith(")"):
        return {"type": "object", "additionalProperties": _type_schema(type_name[10:-1], defs)}
    if type_name == "Quantity":
        return {"$ref": "#/$defs/io.k8s.apimachinery.pkg.api.resource.Quantity"}
    if type_name.startswith("KubeflowOrgV1"):
        _add_model_definition(getattr(kf, type_name), defs)
        return {"$ref": f"#/$defs/kubeflow.{type_name}"}
    return {"$ref": f"#/$defs/{_kubernetes_definition_key(type_name, defs)}"}


def _kubernetes_definition_key(type_name: str, defs: dict) -> str:
    """``V1PodTemplateSpec`` -> ``io.k8s.api.core.v1.PodTemplateSpec``; ``K8sIoApiAutoscalingV2MetricSpec`` too."""
    match = re.match(r"^(?:K8sIoApi(?P<group>[A-Z][a-z]+))?(?P<version>V\d+(?:(?:alpha|beta)\d+)?)(?P<kind>[A-Z]\w*)$", type_name)
    if not match:
        raise ValueError(f"cannot map SDK type {type_name!r} to a Kubernetes definition")
    version, kind = match["version"].lower(), match["kind"]
    group = match["group"].lower() if match["group"] else None
    candidates = [key for key in defs if key.endswith(f".{version}.{kind}") and (group is None or f".{group}." in key)]
    preferred = [key for key in candidates if ".api.core." in key or ".apis.meta." in key]
    chosen = preferred or candidates
    if len(chosen) != 1:
        raise ValueError(f"SDK type {type_name!r} matches {len(chosen)} Kubernetes definitions: {chosen}")
    return chosen[0]


# ---------------------------------------------------------------- submission


class PyTorchJobBackend:
    """:class:`TrainerJobBackend` on the Training Operator v1, through ``TrainingClient``.

    ``client`` defaults to a ``TrainingClient`` built from the in-cluster service
    account (or ``~/.kube/config`` outside a cluster), created on first use.
    """

    def __init__(
        self, client: Any = None, client_factory: Callable[[], Any] | None = None, polling_interval_s: int = 15, start_timeout_s: int = 3600
    ):
        self._client = client
        self._client_factory = client_factory or _default_training_client
        self.polling_interval_s = polling_interval_s
        self.start_timeout_s = start_timeout_s

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def submit(self, spec: TrainerJobSpec) -> str:
        # Through the custom-objects API, not create_job: create_job cannot ask for strict field validation.
        manifest = pytorchjob_to_dict(build_pytorchjob(spec))
        self.client.custom_api.create_namespaced_custom_object(GROUP, VERSION, spec.namespace, PLURAL, manifest, field_validation=STRICT)
        return spec.name

    def stream_logs(self, name: str, namespace: str) -> None:
        started = {"Running", "Succeeded", "Failed"}
        self.client.wait_for_job_conditions(
            name=name, namespace=namespace, expected_conditions=started, wait_timeout=self.start_timeout_s, polling_interval=self.polling_interval_s
        )
        self.client.get_job_logs(name=name, namespace=namespace, follow=True)

    def wait(self, name: str, namespace: str, timeout_s: int) -> JobOutcome:
        finished = {"Succeeded", "Failed"}
        job = self.client.wait_for_job_conditions(
            name=name, namespace=namespace, expected_conditions=finished, wait_timeout=timeout_s, polling_interval=self.polling_interval_s
        )
        conditions = (job.status.conditions or []) if job.status else []
        succeeded = any(c.type == "Succeeded" and c.status == "True" for c in conditions)
        message = conditions[-1].message if conditions else ""
        return JobOutcome(name=name, succeeded=succeeded, message=message or "")

    def delete(self, name: str, namespace: str) -> None:
        self.client.delete_job(name=name, namespace=namespace)


def _default_training_client() -> Any:
    from kubeflow.training import TrainingClient

    return TrainingClient(job_kind=KIND)

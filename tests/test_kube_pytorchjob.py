"""The trainer PyTorchJob: shape for 1 and 4 nodes on GPU and Ascend, webhook rules, strict schema."""

import copy

import pytest
from kubernetes import client as k8s

from tests.crd_schema import load_crd
from tests.stand_in_api import StandInApi
from tidal.kube import cluster
from tidal.kube.trainer.pytorchjob import (
    PyTorchJobBackend,
    PyTorchJobRejected,
    build_pytorchjob,
    check_pytorchjob,
    pytorchjob_to_dict,
)
from tidal.kube.trainer.shared import JobOutcome, TrainerJobSpec, run_trainer_job


def make_spec(profile="nvidia", nodes=1, accelerators=8, **extra):
    return TrainerJobSpec(
        name="tidal-demo-r3",
        config_path="/mnt/tidal/runs/demo/config.yaml",
        run_dir="/mnt/tidal/runs/demo",
        profile=cluster.PROFILES[profile],
        nodes=nodes,
        accelerators_per_node=accelerators,
        iterations=20,
        **extra,
    )


def manifest_for(**kwargs):
    return pytorchjob_to_dict(build_pytorchjob(make_spec(**kwargs)))


def pod_spec(manifest, replica="Master"):
    return manifest["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]


@pytest.mark.parametrize("profile,resource", [("nvidia", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910")])
@pytest.mark.parametrize("nodes", [1, 4])
def test_job_shape_for_nodes_and_accelerators(profile, resource, nodes):
    manifest = manifest_for(profile=profile, nodes=nodes, accelerators=8)

    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if nodes == 1:
        assert set(replicas) == {"Master"}
    else:
        assert replicas["Worker"]["replicas"] == nodes - 1
    assert manifest["spec"]["nprocPerNode"] == "8"
    run_policy = manifest["spec"]["runPolicy"]
    assert run_policy["cleanPodPolicy"] == "Running"
    assert run_policy["backoffLimit"] == 2 and run_policy["ttlSecondsAfterFinished"] == 3600

    for replica in replicas:
        spec = pod_spec(manifest, replica)
        (container,) = spec["containers"]
        assert container["name"] == "pytorch"
        assert container["command"][:4] == ["torchrun", "--no-python", "tidal", "train"]
        assert container["command"][container["command"].index("--iterations") + 1] == "20"
        assert container["resources"]["limits"][resource] == "8"
        assert container["resources"]["requests"][resource] == "8"
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        claim = {v["name"]: v for v in spec["volumes"]}["data"]["persistentVolumeClaim"]["claimName"]
        assert claim == cluster.DATA_PVC
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts == {
            cluster.DATA_MOUNT_PATH: "data",
            "/dev/shm": "dshm",
            cluster.WEIGHTS_SIGNING_MOUNT_PATH: "weights-signing",  # signs the snapshots it publishes
            cluster.WEIGHTS_PUBLIC_MOUNT_PATH: "weights-public",
        }
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["weights-signing"]["secret"] == {"secretName": cluster.WEIGHTS_SIGNING_SECRET, "optional": False}
        assert volumes["weights-public"]["configMap"] == {"name": cluster.WEIGHTS_PUBLIC_CONFIG_MAP, "optional": False}
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "fieldRef" in e.get("valueFrom", {})}
        assert fields == {"POD_IP": "status.podIP"}  # the NCCL weight transfer's rendezvous address
        assert secrets["NATS_PASSWORD"] == cluster.NATS_SECRET
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        users = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert (users["NATS_USER"], keys["NATS_PASSWORD"]) == ("tidal-trainer", "trainer-password")  # the trainer's own NATS user
        assert secrets["MLFLOW_TRACKING_URI"] == cluster.MLFLOW_SECRET
        assert set(secrets.values()) == {cluster.NATS_SECRET, cluster.MLFLOW_SECRET}  # the keys are files, in no variable
        optional = {e["name"]: e["valueFrom"]["secretKeyRef"].get("optional") for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        # a missing tidal-mlflow Secret stops the replica from starting, naming the Secret; only basic auth is optional
        assert not optional["MLFLOW_TRACKING_URI"] and not optional["NATS_PASSWORD"]
        assert optional["MLFLOW_TRACKING_USERNAME"] and optional["MLFLOW_TRACKING_PASSWORD"]
        assert {t["key"] for t in spec["tolerations"]} == {resource}
        assert spec["automountServiceAccountToken"] is False


def test_ascend_job_selects_ascend_nodes_and_image():
    spec = pod_spec(manifest_for(profile="ascend"))
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert "tidal-ascend" in spec["containers"][0]["image"]


def test_cpu_job_requests_no_accelerator():
    container = pod_spec(manifest_for(profile="cpu", accelerators=0))["containers"][0]
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}


def test_typed_models_reject_a_misspelled_field():
    with pytest.raises(TypeError, match="replicass"):
        k8s.V1Container(name="pytorch", image="x", replicass=2)


def break_job(mutate):
    manifest = copy.deepcopy(manifest_for(nodes=2))
    mutate(manifest)
    with pytest.raises(PyTorchJobRejected) as caught:
        check_pytorchjob(manifest)
    return str(caught.value)


def test_container_not_named_pytorch_is_rejected():
    def rename(m):
        pod_spec(m)["containers"][0]["name"] = "trainer"

    message = break_job(rename)
    assert "spec.pytorchReplicaSpecs.Master.template.spec.containers" in message and "'pytorch'" in message


def test_container_without_image_is_rejected():
    def drop_image(m):
        del pod_spec(m, "Worker")["containers"][0]["image"]

    assert "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].image: must be specified" in break_job(drop_image)


def test_two_masters_are_rejected():
    def two_masters(m):
        m["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2

    assert "spec.pytorchReplicaSpecs.Master.replicas: must be 1" in break_job(two_masters)


def test_missing_master_is_rejected():
    def no_master(m):
        del m["spec"]["pytorchReplicaSpecs"]["Master"]

    assert "exactly one Master replica" in break_job(no_master)


def test_elastic_policy_without_worker_is_rejected():
    def elastic_single(m):
        del m["spec"]["pytorchReplicaSpecs"]["Worker"]
        m["spec"]["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": 2}

    assert "Worker: must be configured if elasticPolicy is used" in break_job(elastic_single)


def test_unknown_replica_type_and_bad_name_are_rejected():
    def chief(m):
        m["metadata"]["name"] = "Tidal_Run"
        m["spec"]["pytorchReplicaSpecs"]["Chief"] = m["spec"]["pytorchReplicaSpecs"]["Worker"]

    message = break_job(chief)
    assert "metadata.name: 'Tidal_Run' must be a DNS-1035 label" in message
    assert "spec.pytorchReplicaSpecs.Chief: replica type must be one of Master, Worker" in message


def test_bad_nproc_and_clean_pod_policy_are_rejected():
    def bad(m):
        m["spec"]["nprocPerNode"] = "many"
        m["spec"]["runPolicy"]["cleanPodPolicy"] = "Sometimes"

    message = break_job(bad)
    assert "spec.nprocPerNode: 'many'" in message and "spec.runPolicy.cleanPodPolicy: 'Sometimes'" in message


def test_schema_rejects_misspelled_field_in_serialized_job():
    def typo(m):
        pod_spec(m, "Worker")["containers"][0]["imagePullPolicyy"] = "Always"
        m["spec"]["runPolicy"]["backofLimit"] = 3

    message = break_job(typo)
    assert "'imagePullPolicyy' was unexpected" in message and "'backofLimit' was unexpected" in message


def test_bad_spec_fails_when_building():
    with pytest.raises(PyTorchJobRejected, match="metadata.name"):
        build_pytorchjob(TrainerJobSpec(name="Round 1", config_path="c", run_dir="r", profile=cluster.PROFILES["cpu"]))
    with pytest.raises(ValueError, match="trainer nodes must be at least 1"):
        build_pytorchjob(make_spec(nodes=0))


@pytest.fixture
def stand_in_api():
    """A Kubernetes API server with the Training Operator v1.9.0's PyTorchJob CRD."""
    with StandInApi([load_crd("training-operator-v1.9.0-pytorchjobs.json")]) as api:
        yield api


class RecordingTrainingClient:
    """Stands in for TrainingClient, its Kubernetes client speaking to the stand-in API server; records the calls."""

    def __init__(self, api, succeed=True):
        self.calls = []
        self.succeed = succeed
        self.custom_api = RecordingCustomObjectsApi(api.api_client(), self.calls)

    def wait_for_job_conditions(self, name, namespace, expected_conditions, wait_timeout, polling_interval):
        self.calls.append(("wait", tuple(sorted(expected_conditions))))
        kind = "Succeeded" if self.succeed else "Failed"
        condition = k8s.V1JobCondition(type=kind, status="True", message=f"job {kind.lower()}")
        return type("Job", (), {"status": type("Status", (), {"conditions": [condition]})()})()

    def get_job_logs(self, name, namespace, follow):
        self.calls.append(("logs", name, follow))

    def delete_job(self, name, namespace):
        self.calls.append(("delete", name))


class RecordingCustomObjectsApi(k8s.CustomObjectsApi):
    def __init__(self, api_client, calls):
        super().__init__(api_client)
        self.calls = calls

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
        self.calls.append(("create", body["metadata"]["name"], namespace))
        return super().create_namespaced_custom_object(group, version, namespace, plural, body, **kwargs)


def test_run_trainer_job_with_a_stand_in_api_creates_strictly_streams_and_waits(stand_in_api):
    client = RecordingTrainingClient(stand_in_api)
    outcome = run_trainer_job(PyTorchJobBackend(client=client), make_spec())
    assert outcome == JobOutcome(name="tidal-demo-r3", succeeded=True, message="job succeeded")
    assert [c[0] for c in client.calls] == ["create", "wait", "logs", "wait"]
    assert client.calls[0] == ("create", "tidal-demo-r3", "tidal")
    assert client.calls[2] == ("logs", "tidal-demo-r3", True)
    ((path, query, body),) = stand_in_api.created
    assert path == "/apis/kubeflow.org/v1/namespaces/tidal/pytorchjobs" and query["fieldValidation"] == "Strict"
    assert body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}


def test_failed_trainer_job_with_a_stand_in_api_raises_with_operator_message(stand_in_api):
    with pytest.raises(RuntimeError, match="tidal/tidal-demo-r3 failed: job failed"):
        run_trainer_job(PyTorchJobBackend(client=RecordingTrainingClient(stand_in_api, succeed=False)), make_spec())

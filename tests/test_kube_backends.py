"""The compiled pipeline against the KFP backends in the field (2.5.0, Kubeflow 1.10's, and later).

tests/data/kfp_protos/ holds, per KFP backend release, the executor-config and pipeline-spec protos it is built
with and how it parses a task's executor config (releases.json: its driver, strict up to 2.4.0; its API server's
workflow compiler, strict in every release, which up to 2.5.x leaves the pod's labels unset on an unknown field
and from 2.14.0 refuses the run). For every profile, with and without a Kueue queue, each task's executor config
and the pipeline spec are checked against each release: which fields it does not know, and what it then does.
The IR is the same for both worker pools (``worker_pool`` is a run parameter; the elastic pool's Deployment is
created through the Kubernetes API, not by KFP), so each compiled file covers both.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests import kfp_proto
from tidal.kube import cluster
from tidal.kube.pipeline.definition import compile_pipeline
from tidal.kube.steps import parent_run, run_state
from tidal.kube.steps.pod_env import KFP_POD_ENV, check_pod_env, empty_credential_problem, root_problem
from tidal.kube.steps.records import PipelineStepError
from tidal.kube.submit.backend import (
    BACKEND_FLOOR,
    COMPILER_FAILS_FROM,
    DRIVER_STRICT_THROUGH,
    FIELD_SINCE,
    NAME_PARAMETER_FALLBACK,
    NOT_CARRIED,
    PIPELINE_STORE_FROM,
    BackendTooOld,
    check_backend,
    consequence,
    executor_config_fields,
    parse_version,
    unknown_to,
    version_of,
)
from tidal.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [(profile, queue) for profile in ("nvidia", "ascend", "cpu") for queue in ("", "team-a")]
OUTCOME = {
    "strict": "its driver refuses them: every task fails before its pod starts",
    "fails": "its API server refuses them: the run is not created",
    "ignores-error": "its API server then sets no pod labels: no NetworkPolicy admission to NATS or MLflow, no Kueue queue",
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    return {(p, q): list(yaml.safe_load_all(compile_pipeline(out / f"{p}-{q or 'none'}.yaml", p, queue_name=q).read_text())) for p, q in VARIANTS}


def executor_configs(documents: list[dict]) -> dict[str, dict]:
    return documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def known_to(schema: dict, path: str) -> bool:
    message = "KubernetesExecutorConfig"
    for part in path.replace("[]", "").split("."):
        if part not in schema[message]:
            return False
        kind, target = schema[message][part]
        message = target if kind == "message" else message
    return True


def what_the_release_does(tag: str, unknown: set[str]) -> str | None:
    """From releases.json alone (not from tidal's rules): what release ``tag`` does with these unknown fields."""
    if not unknown:
        return None
    rule = kfp_proto.releases()[tag]
    return OUTCOME["strict"] if rule["driver"] == "strict" else OUTCOME[rule["compiler"]]


def release_view(tag: str, documents: list[dict]) -> tuple[set[str], set[str]]:
    """``(read, unknown)`` executor-config field paths of the compiled pipeline, by release ``tag``'s proto."""
    schema = kfp_proto.load(tag)
    unknown = set().union(*(kfp_proto.unknown_fields(config, schema) for config in executor_configs(documents).values()))
    return executor_config_fields(documents) - unknown, unknown


def test_each_field_is_known_from_the_release_the_table_says(compiled):
    used = set().union(*(executor_config_fields(docs) for docs in compiled.values()))
    assert {f.split("[]")[0] for f in used} <= set(FIELD_SINCE)  # every field the IR uses has a rule (its parts: the list's)
    assert {"tolerations[].key", "emptyDirMounts[].mountPath"} & used  # list items' fields are kept
    for tag in kfp_proto.tags():
        schema = kfp_proto.load(tag)
        for path, since in FIELD_SINCE.items():
            assert known_to(schema, path) == (kfp_proto.version(tag) >= since), (tag, path)


def test_tidals_rules_are_each_releases_as_its_source_says():
    releases = kfp_proto.releases()
    for tag, rule in releases.items():
        version = parse_version(tag)
        assert (rule["driver"] == "strict") == (version <= DRIVER_STRICT_THROUGH), tag
        assert (rule["compiler"] == "fails") == (version >= COMPILER_FAILS_FROM), tag
        assert rule["pipeline_store"] == (version >= PIPELINE_STORE_FROM), tag
        for unknown in (set(), {"securityContext"}):
            assert consequence(version, unknown) == what_the_release_does(tag, unknown), tag
    assert kfp_proto.tags()[0] == "2.4.0" and "2.5.0" in releases and kfp_proto.tags()[-1] == "2.17.0"  # the newest tag


@pytest.mark.parametrize("profile,queue", VARIANTS)
def test_the_ir_of_every_profile_against_each_release(compiled, profile, queue):
    documents = compiled[(profile, queue)]
    configs = executor_configs(documents)
    assert len(configs) >= 9
    for tag in kfp_proto.tags():
        read, unknown = release_view(tag, documents)
        assert unknown == unknown_to(parse_version(tag), executor_config_fields(documents)), tag  # Tidal's table = the proto
        if kfp_proto.version(tag) >= BACKEND_FLOOR:
            assert unknown == set() and read == executor_config_fields(documents), tag  # every field read, none dropped
        else:
            assert "pvcMount[].pvcNameParameter" in unknown and unknown <= set(NAME_PARAMETER_FALLBACK), tag
            assert what_the_release_does(tag, unknown) is not None, tag
        # the API server parses the pipeline spec and the platform spec strictly on upload; the driver the containers
        spec = kfp_proto.load_pipeline_spec(tag)
        assert kfp_proto.unknown_fields(documents[0], spec, "PipelineSpec") == [], tag
        assert kfp_proto.unknown_fields(documents[0]["deploymentSpec"], spec, "PipelineDeploymentConfig") == [], tag
        assert kfp_proto.unknown_fields(documents[1], spec, "PlatformSpec") == [], tag
    labels = [c.get("podMetadata", {}).get("labels", {}) for c in configs.values()]
    assert all(cluster.TIDAL_POD_LABEL.items() <= label.items() for label in labels)
    assert any(cluster.QUEUE_LABEL in label for label in labels) == bool(queue)
    assert "worker_pool" in documents[0]["root"]["inputDefinitions"]["parameters"]  # one IR for both pools


def test_the_ir_as_kfp_kubernetes_writes_it_breaks_on_2_5_to_2_15_as_the_sources_say(compiled):
    """Before this IR left them out, kfp-kubernetes 2.17 wrote ``optional`` and ``securityContext``: 2.5.0 then set
    no pod labels (NATS's NetworkPolicy shut the steps out), 2.14.x and 2.15.x refused the run."""
    documents = json.loads(json.dumps(compiled[("cpu", "team-a")]))
    for config in executor_configs(documents).values():
        config["securityContext"] = {"runAsUser": "1000", "runAsGroup": "1000", "runAsNonRoot": True}
        for entry in config.get("secretAsEnv", []):
            entry["optional"] = False
    seen = {}
    for tag in kfp_proto.tags():
        _, unknown = release_view(tag, documents)
        seen[tag] = what_the_release_does(tag, unknown)
    assert seen["2.5.0"] == OUTCOME["ignores-error"]
    assert seen["2.14.4"] == seen["2.15.0"] == OUTCOME["fails"]
    assert seen["2.16.0"] is None and seen["2.17.0"] is None
    assert set(NOT_CARRIED) == {f for f, since in FIELD_SINCE.items() if since > BACKEND_FLOOR}


def test_the_proto_check_finds_a_field_a_release_does_not_know():
    schema = kfp_proto.load("2.5.0")
    config = {"secretAsEnv": [{"secretName": "s", "optional": True, "keyToEnv": [{"secretKey": "k", "envVar": "E", "nope": 1}]}], "bogus": {}}
    assert kfp_proto.unknown_fields(config, schema) == ["bogus", "secretAsEnv[].keyToEnv[].nope", "secretAsEnv[].optional"]
    assert kfp_proto.unknown_fields(config, kfp_proto.load("2.17.0")) == ["bogus", "secretAsEnv[].keyToEnv[].nope"]
    spec = {"components": {"comp-a": {"executorLabel": "exec-a", "nope": 1}}, "root": {"dag": {"tasks": {"t": {"taskInfo": {"x": 1}}}}}}
    assert kfp_proto.unknown_fields(spec, kfp_proto.load_pipeline_spec("2.5.0"), "PipelineSpec") == [
        "components[comp-a].nope",
        "root.dag.tasks[t].taskInfo.x",
    ]


def test_check_backend_refuses_below_the_floor_in_one_line(compiled):
    documents = compiled[("nvidia", "")]
    for version, because in (("2.4.0", "its driver refuses them"), ("2.4.1", "its API server then sets no pod labels")):
        with pytest.raises(BackendTooOld) as refused:
            check_backend(version, documents)
        message = str(refused.value)
        assert "\n" not in message and f"KFP backend {version} is below Tidal's floor 2.5.0" in message and because in message
        assert "pvcMount[].pvcNameParameter" in message
    assert check_backend("v2.5.0", documents) == [] and check_backend("2.17.0", documents) == []


def test_the_version_of_a_backend_from_its_healthz_answer():
    assert version_of({"tag_name": "2.16.0", "multi_user": False}) == ("2.16.0", [])
    assert version_of({"tag_name": "unknown", "pipeline_store": "database"})[0] == "2.14.0"
    assert version_of({"tag_name": "unknown", "multi_user": True}, stated="2.4.0")[0] == "2.4.0"
    version, (note,) = version_of({"commit_sha": "unknown", "tag_name": "unknown", "multi_user": False})
    assert version == "unknown" and "older than 2.14.0: Tidal needs 2.5.0 or later" in note and "--backend-version" in note


def tidal_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def test_compile_check_backend_refuses_2_4_and_passes_2_5(tmp_path):
    old = tidal_cli("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "cpu", "--check-backend", "2.4.0")
    assert old.returncode == 2 and old.stderr.count("\n") == 1 and "below Tidal's floor 2.5.0" in old.stderr
    floor = tidal_cli("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "cpu", "--check-backend", "2.5.0")
    assert floor.returncode == 0 and floor.stdout.strip() == f"wrote {tmp_path / 'p.yaml'}"  # nothing dropped, nothing to note
    bad = tidal_cli("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "cpu", "--check-backend", "latest")
    assert bad.returncode == 2 and bad.stderr == "tidal compile: --check-backend 'latest' is not a KFP release (like 2.5.0)\n"


class StandInKfpBackend:
    """Stands in for a KFP API server: healthz answers ``healthz`` (what a release's image reports), experiments, runs."""

    def __init__(self, healthz: dict):
        self.healthz, self.calls = healthz, []

    def answer(self, method: str, path: str, body: dict | None) -> dict:
        self.calls.append((method, path))
        if path == "/apis/v2beta1/healthz":
            return self.healthz
        if method == "POST" and path == "/apis/v2beta1/experiments":
            return {"experiment_id": "exp-1", "display_name": body["display_name"]}
        if method == "POST" and path == "/apis/v2beta1/runs":
            return {"run_id": "run-1", "experiment_id": body["experiment_id"]}
        return {}


def healthz_as_released(tag: str, tag_name: str | None = None) -> dict:
    """``/apis/v2beta1/healthz`` of release ``tag``'s image (releases.json), its ``tag_name`` overridden if given."""
    rule = kfp_proto.releases()[tag]
    payload = {"commit_sha": "unknown", "tag_name": tag_name or rule["healthz_tag_name"], "multi_user": False}
    return {**payload, "pipeline_store": "database"} if rule["pipeline_store"] else payload


@pytest.fixture
def stand_in_backend():
    servers = []

    def start(healthz):
        backend = StandInKfpBackend(healthz)

        class Handler(BaseHTTPRequestHandler):
            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                data = json.dumps(backend.answer(self.command, self.path.split("?")[0], json.loads(self.rfile.read(length)) if length else None))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data.encode())

            do_GET = do_POST = _reply

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}", backend

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def submit(host: str, *extra: str) -> subprocess.CompletedProcess:
    return tidal_cli("submit", str(ROOT / "examples" / "arithmetic.yaml"), "--host", host, *extra, env={**os.environ, "KFP_TOKEN": "t"})


def test_submit_to_a_stand_in_backend_reporting_2_4_0_is_refused_before_anything_is_created(stand_in_backend):
    host, backend = stand_in_backend(healthz_as_released("2.4.0", tag_name="2.4.0"))  # an image built with its TAG_NAME
    result = submit(host)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tidal submit: KFP backend 2.4.0 is below Tidal's floor 2.5.0" in result.stderr
    assert set(backend.calls) == {("GET", "/apis/v2beta1/healthz")}  # only asked its health and version: no experiment, no run


def test_submit_to_2_4_0_as_released_is_refused_once_its_version_is_stated(stand_in_backend):
    host, backend = stand_in_backend(healthz_as_released("2.4.0"))  # reports "unknown", as KFP's 2.4.0 image does
    result = submit(host, "--backend-version", "2.4.0")
    assert result.returncode == 2 and "KFP backend 2.4.0 is below Tidal's floor 2.5.0" in result.stderr
    assert set(backend.calls) == {("GET", "/apis/v2beta1/healthz")}


def test_submit_to_a_stand_in_backend_reporting_2_5_0_creates_the_run(stand_in_backend):
    host, backend = stand_in_backend(healthz_as_released("2.5.0", tag_name="2.5.0"))
    result = submit(host)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("/#/runs/details/run-1") and ("POST", "/apis/v2beta1/runs") in backend.calls
    assert "note:" not in result.stderr  # 2.5.0 reads every field the pipeline uses


@pytest.mark.parametrize("tag", ["2.5.0", "2.14.4"])
def test_submit_to_a_release_image_that_reports_no_version_creates_the_run_and_says_what_it_knows(stand_in_backend, tag):
    host, backend = stand_in_backend(healthz_as_released(tag))
    result = submit(host)
    assert result.returncode == 0, result.stderr
    assert ("POST", "/apis/v2beta1/runs") in backend.calls
    expected = "so it is 2.14.0 or later" if tag == "2.14.4" else "older than 2.14.0: Tidal needs 2.5.0 or later"
    assert expected in result.stderr


# ---------------------------------------------------------------- a step's pod as the 2.5.0 driver builds it


def secrets_as_the_docs_create_them() -> dict[str, dict[str, str]]:
    """Every ``kubectl create secret generic NAME --from-literal=key=value ...`` of docs/kubernetes.md: its keys."""
    text = (ROOT / "docs" / "kubernetes.md").read_text().replace("\\\n", " ")
    secrets = {}
    for name, rest in re.findall(r"kubectl -n tidal create secret generic (\S+)((?: +--from-literal=[\w-]+=\S*)+)", text):
        secrets[name] = dict(re.findall(r"--from-literal=([\w-]+)=(\S*)", rest))
    return secrets


class CreateContainerConfigError(Exception):
    pass


def pod_env_as_the_driver_builds_it(tag: str, documents: list[dict], executor: str, secrets: dict, config_maps: dict) -> dict[str, str]:
    """A stand-in for KFP release ``tag`` building a task's container env (the driver's Secret and ConfigMap keys,
    field paths; the workflow compiler's ``KFP_POD_NAME``/``KFP_POD_UID``), then the kubelet resolving it: a key
    whose reference is not optional must exist, and ``optional`` counts only where the tag's proto knows it."""
    schema = kfp_proto.load(tag)
    config = executor_configs(documents)[executor]
    container = documents[0]["deploymentSpec"]["executors"][executor]["container"]
    env = {item["name"]: item["value"] for item in container.get("env", [])}
    env.update({KFP_POD_ENV: f"stand-in-{executor}-pod", "KFP_POD_UID": "stand-in-uid"})
    for group, store, kind, key_field, name_field in (
        ("secretAsEnv", secrets, "secret", "secretKey", "secretName"),
        ("configMapAsEnv", config_maps, "configmap", "configMapKey", "configMapName"),
    ):
        honours_optional = "optional" in schema["SecretAsEnv" if group == "secretAsEnv" else "ConfigMapAsEnv"]
        for entry in config.get(group, []):
            optional = bool(entry.get("optional")) and honours_optional
            data = store.get(entry[name_field])
            for pair in entry["keyToEnv"]:
                if data is None or pair[key_field] not in data:
                    if optional:
                        continue
                    where = f'{kind} "{entry[name_field]}"'
                    raise CreateContainerConfigError(f"couldn't find key {pair[key_field]} in {where}" if data else f"{where} not found")
                env[pair["envVar"]] = data[pair[key_field]]
    for item in config.get("fieldPathAsEnv", []):
        env[item["name"]] = f"stand-in-{item['fieldPath']}"
    return env


def as_the_images_user() -> list[str]:
    """A command prefix running a child as uid/gid 1000, the images' USER (the pipeline sets no security context: the
    image's USER is what the pod runs as): as is when this test is not root, else in a user namespace."""
    if os.geteuid() != 0:
        return []
    prefix = [shutil.which("unshare") or "unshare", "--user", "--map-user=1000", "--map-group=1000"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import os; print(os.geteuid())"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "1000":
        pytest.skip(f"running as root and cannot run a child as uid 1000 (unshare --user: {probe.stderr.strip()[:200]})")
    return prefix


@pytest.fixture
def open_round_pod(tmp_path, nats_server, tiny_config_dict, compiled, monkeypatch):
    """The open_round step of round 0, ready to run: prepare's leftovers (the round lease, the MLflow parent run)."""
    run = RunDir(tmp_path / "runs" / "run-1")
    run.root.mkdir(parents=True)
    config_path = run.root / "config.yaml"
    config_path.write_text(yaml.safe_dump(dict(tiny_config_dict, transport={"nats_url": nats_server.url})))
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    parent_run.open_parent_run(run, str(config_path))
    run_state.reset_rounds(run, str(config_path), "job-1")
    secrets = secrets_as_the_docs_create_them()
    secrets[cluster.MLFLOW_SECRET] = {**secrets[cluster.MLFLOW_SECRET], "tracking-uri": tracking_uri}

    def start(tag: str, secrets: dict = secrets, user: list[str] | None = None) -> subprocess.CompletedProcess:
        env = pod_env_as_the_driver_builds_it(tag, compiled[("cpu", "")], "exec-open-round", secrets, {})
        env.update(PATH=os.environ["PATH"], HOME=str(tmp_path / "home"), PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        step = "from tidal.kube.steps import rounds; import sys; rounds.open_round(sys.argv[1], sys.argv[2], 0, 'job-1')"
        command = [*(as_the_images_user() if user is None else user), sys.executable, "-c", step, str(run.root), str(config_path)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    return run, str(config_path), secrets, start


def test_a_step_built_as_the_2_5_driver_builds_it_starts_with_the_platforms_secrets(open_round_pod):
    run, config_path, secrets, start = open_round_pod
    assert set(secrets[cluster.MLFLOW_SECRET]) == set(cluster.MLFLOW_SECRET_ENV)  # every key present, some empty
    assert set(secrets[cluster.REWARD_SECRET]) == set(cluster.REWARD_SECRET_ENV)
    assert secrets[cluster.MLFLOW_SECRET]["username"] == ""
    step = start("2.5.0")
    assert step.returncode == 0, step.stderr[-2000:]
    assert run_state.read_run_state(run, config_path) == "running"  # it really opened the round


@pytest.mark.parametrize("tag", ["2.5.0", "2.17.0"])
def test_a_secret_missing_a_key_stops_the_pod_on_every_release(open_round_pod, tag):
    """The IR carries no ``optional`` (2.5.0 does not know it), so a key the docs create empty must exist everywhere."""
    _, _, secrets, start = open_round_pod
    without_auth = {**secrets, cluster.MLFLOW_SECRET: {"tracking-uri": secrets[cluster.MLFLOW_SECRET]["tracking-uri"]}}
    with pytest.raises(CreateContainerConfigError, match='couldn\'t find key username in secret "tidal-mlflow"'):
        start(tag, without_auth)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the step's pod running as uid 0")
def test_a_step_in_a_kfp_pod_running_as_root_stops_in_one_line(open_round_pod):
    run, config_path, _, start = open_round_pod
    step = start("2.5.0", user=[])  # as root: an image whose USER is root, and no security context in the pipeline
    assert step.returncode != 0
    assert step.stderr.strip().splitlines()[-1] == (
        "tidal.kube.steps.records.PipelineStepError: this step runs as root (uid 0) in pod stand-in-exec-open-round-pod: "
        "Tidal's steps run as uid 1000 (the images' USER; the pipeline sets no security context, which KFP 2.5.0 does not "
        "know), so run the image as a non-root user"
    )
    assert run_state.read_run_state(run, config_path) != "running"  # refused before it did anything


def test_the_root_check_holds_only_in_a_kfp_pod():
    assert root_problem({KFP_POD_ENV: "p"}, uid=0) is not None
    assert root_problem({KFP_POD_ENV: "p"}, uid=1000) is None
    assert root_problem({}, uid=0) is None  # kfp-local: steps are processes of the user's machine, not pods
    with pytest.raises(PipelineStepError, match="runs as root"):
        check_pod_env({KFP_POD_ENV: "p", cluster.MLFLOW_SECRET_REQUIRED_ENV["tracking-uri"]: "http://m"}, uid=0)
    check_pod_env({KFP_POD_ENV: "p"}, uid=1000)


def test_a_step_whose_required_credential_is_empty_fails_with_one_clear_line(open_round_pod):
    _, _, secrets, start = open_round_pod
    empty_uri = {**secrets, cluster.MLFLOW_SECRET: {**secrets[cluster.MLFLOW_SECRET], "tracking-uri": ""}}
    step = start("2.5.0", empty_uri)
    assert step.returncode != 0
    assert step.stderr.strip().splitlines()[-1] == (
        "tidal.kube.steps.records.PipelineStepError: MLFLOW_TRACKING_URI is empty: set key 'tracking-uri' of Secret tidal-mlflow "
        "(the step cannot run without it)"
    )


def test_empty_optional_credentials_count_as_unset_where_tidal_reads_them(monkeypatch):
    from types import SimpleNamespace

    from tidal.rewards.served import ServedReward

    assert empty_credential_problem({"MLFLOW_TRACKING_USERNAME": "", "TIDAL_MLFLOW_UI_URL": "", "MLFLOW_TRACKING_URI": "http://m"}) is None
    assert "NATS_PASSWORD is empty" in empty_credential_problem({"NATS_PASSWORD": " "})
    monkeypatch.setenv("TIDAL_JUDGE_API_KEY", "")
    cfg = SimpleNamespace(label="judge", api_key_env="TIDAL_JUDGE_API_KEY", error_window=10, max_error_rate=0.5)  # the fields it reads
    with pytest.raises(Exception, match="which is not set \\(or empty\\)"):
        ServedReward(cfg, url="http://judge:8000/v1").headers()

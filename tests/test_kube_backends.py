"""The compiled pipeline against the KFP backends in the field (2.5.0, Kubeflow 1.10's, and later).

Each KFP backend tag's executor-config proto is in tests/data/kfp_protos/ (with its source tag). For every
profile, with and without a Kueue queue, each task's executor config is checked against each proto: the fields
that release's driver does not know (2.4.x refuses them, 2.5.0 on drops them) must be exactly what
``tidal.kube.submit.backend`` says, and none of them load-bearing. The IR is the same for both worker pools
(``worker_pool`` is a run parameter; the elastic pool's Deployment is created through the Kubernetes API, not by
the KFP driver), so each compiled file covers both.
"""

import json
import os
import re
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
from tidal.kube.steps.pod_env import empty_credential_problem
from tidal.kube.submit.backend import (
    BACKEND_FLOOR,
    FIELD_SINCE,
    NOT_LOAD_BEARING,
    BackendTooOld,
    check_backend,
    driver_view,
    executor_config_fields,
    parse_version,
)
from tidal.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [(profile, queue) for profile in ("nvidia", "ascend", "cpu") for queue in ("", "team-a")]
REFUSED_BY_2_4 = {"pvcMount[].pvcNameParameter", "secretAsEnv[].secretNameParameter", "secretAsEnv[].optional", "securityContext"}


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


def test_each_field_is_read_from_the_release_the_table_says(compiled):
    used = set().union(*(executor_config_fields(docs) for docs in compiled.values()))
    assert {f.split("[]")[0] for f in used} <= set(FIELD_SINCE)  # every field the IR uses has a rule (its parts: the parent's)
    for tag in kfp_proto.tags():
        schema = kfp_proto.load(tag)
        for path, since in FIELD_SINCE.items():
            assert known_to(schema, path) == (kfp_proto.version(tag) >= since), (tag, path)


@pytest.mark.parametrize("profile,queue", VARIANTS)
def test_the_ir_of_every_profile_against_each_drivers_proto(compiled, profile, queue):
    documents = compiled[(profile, queue)]
    configs = executor_configs(documents)
    assert len(configs) >= 9
    for tag in kfp_proto.tags():
        schema = kfp_proto.load(tag)
        unknown = set().union(*(kfp_proto.unknown_fields(config, schema) for config in configs.values()))
        _, dropped = driver_view(parse_version(tag), executor_config_fields(documents))
        assert unknown == dropped, tag  # the rule Tidal applies is what the proto says
        if kfp_proto.version(tag) < BACKEND_FLOOR:
            assert REFUSED_BY_2_4 <= unknown, tag  # a strict driver fails every task
        else:
            assert unknown <= set(NOT_LOAD_BEARING), (tag, unknown - set(NOT_LOAD_BEARING))
    newest = kfp_proto.tags()[-1]
    assert set().union(*(kfp_proto.unknown_fields(c, kfp_proto.load(newest)) for c in configs.values())) == set()
    labels = [c.get("podMetadata", {}).get("labels", {}) for c in configs.values()]
    assert any(cluster.QUEUE_LABEL in label for label in labels) == bool(queue)


def test_the_proto_check_finds_a_field_a_release_does_not_know():
    schema = kfp_proto.load("2.5.0")
    config = {"secretAsEnv": [{"secretName": "s", "optional": True, "keyToEnv": [{"secretKey": "k", "envVar": "E", "nope": 1}]}], "bogus": {}}
    assert kfp_proto.unknown_fields(config, schema) == ["bogus", "secretAsEnv[].keyToEnv[].nope", "secretAsEnv[].optional"]
    assert kfp_proto.unknown_fields(config, kfp_proto.load("2.17.0")) == ["bogus", "secretAsEnv[].keyToEnv[].nope"]


def test_check_backend_refuses_below_the_floor_in_one_line_and_notes_what_a_later_one_drops(compiled):
    documents = compiled[("nvidia", "")]
    with pytest.raises(BackendTooOld) as refused:
        check_backend("2.4.1", documents)
    message = str(refused.value)
    assert "\n" not in message and "below Tidal's floor 2.5.0" in message and "securityContext" in message
    notes = check_backend("v2.5.0", documents)
    assert any(n.startswith("KFP backend 2.5.0 drops secretAsEnv[].optional: harmless") for n in notes)
    assert check_backend("2.17.0", documents) == []
    assert check_backend("unknown", documents) == ["the KFP backend reports version 'unknown', not a release: Tidal needs 2.5.0 or later"]


def tidal_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def test_compile_check_backend_refuses_2_4_and_passes_2_5(tmp_path):
    old = tidal_cli("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "cpu", "--check-backend", "2.4.0")
    assert old.returncode == 2 and old.stderr.count("\n") == 1 and "below Tidal's floor 2.5.0" in old.stderr
    floor = tidal_cli("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "cpu", "--check-backend", "2.5.0")
    assert floor.returncode == 0 and "note: KFP backend 2.5.0 drops securityContext: harmless" in floor.stdout


class StandInKfpBackend:
    """Stands in for a KFP API server of release ``tag_name``: healthz as 2.x reports it, experiments and runs."""

    def __init__(self, tag_name: str):
        self.tag_name, self.calls = tag_name, []

    def answer(self, method: str, path: str, body: dict | None) -> dict:
        self.calls.append((method, path))
        if path == "/apis/v2beta1/healthz":
            return {"commit_sha": "0123abc", "tag_name": self.tag_name, "multi_user": False}
        if method == "POST" and path == "/apis/v2beta1/experiments":
            return {"experiment_id": "exp-1", "display_name": body["display_name"]}
        if method == "POST" and path == "/apis/v2beta1/runs":
            return {"run_id": "run-1", "experiment_id": body["experiment_id"]}
        return {}


@pytest.fixture
def stand_in_backend():
    servers = []

    def start(tag_name):
        backend = StandInKfpBackend(tag_name)

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


def test_submit_to_a_stand_in_backend_reporting_2_4_0_is_refused_before_anything_is_created(stand_in_backend):
    host, backend = stand_in_backend("2.4.0")
    result = tidal_cli("submit", str(ROOT / "examples" / "arithmetic.yaml"), "--host", host, env={**os.environ, "KFP_TOKEN": "t"})
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tidal submit: KFP backend 2.4.0 is below Tidal's floor 2.5.0" in result.stderr
    assert set(backend.calls) == {("GET", "/apis/v2beta1/healthz")}  # only asked its health and version: no experiment, no run


def test_submit_to_a_stand_in_backend_reporting_2_5_0_creates_the_run(stand_in_backend):
    host, backend = stand_in_backend("2.5.0")
    result = tidal_cli("submit", str(ROOT / "examples" / "arithmetic.yaml"), "--host", host, env={**os.environ, "KFP_TOKEN": "t"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("/#/runs/details/run-1") and ("POST", "/apis/v2beta1/runs") in backend.calls
    assert "note: KFP backend 2.5.0 drops secretAsEnv[].optional: harmless" in result.stderr


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
    """A stand-in for the KFP driver of ``tag`` building a task's container env, then the kubelet resolving it: a key
    whose reference is not optional must exist, and ``optional`` counts only where the tag's proto knows it."""
    schema = kfp_proto.load(tag)
    config = executor_configs(documents)[executor]
    container = documents[0]["deploymentSpec"]["executors"][executor]["container"]
    env = {item["name"]: item["value"] for item in container.get("env", [])}
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

    def start(tag: str, secrets: dict = secrets) -> subprocess.CompletedProcess:
        env = pod_env_as_the_driver_builds_it(tag, compiled[("cpu", "")], "exec-open-round", secrets, {})
        env.update(PATH=os.environ["PATH"], HOME=str(tmp_path / "home"), PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
        step = "from tidal.kube.steps import rounds; import sys; rounds.open_round(sys.argv[1], sys.argv[2], 0, 'job-1')"
        return subprocess.run([sys.executable, "-c", step, str(run.root), str(config_path)], env=env, capture_output=True, text=True, timeout=300)

    return run, str(config_path), secrets, start


def test_a_step_built_as_the_2_5_driver_builds_it_starts_with_the_platforms_secrets(open_round_pod):
    run, config_path, secrets, start = open_round_pod
    assert set(secrets[cluster.MLFLOW_SECRET]) == set(cluster.MLFLOW_SECRET_ENV)  # every key present, some empty
    assert set(secrets[cluster.REWARD_SECRET]) == set(cluster.REWARD_SECRET_ENV)
    assert secrets[cluster.MLFLOW_SECRET]["username"] == ""
    step = start("2.5.0")
    assert step.returncode == 0, step.stderr[-2000:]
    assert run_state.read_run_state(run, config_path) == "running"  # it really opened the round


def test_on_2_5_a_secret_missing_an_optional_key_stops_the_pod_which_2_15_would_start(open_round_pod):
    _, _, secrets, start = open_round_pod
    without_auth = {**secrets, cluster.MLFLOW_SECRET: {"tracking-uri": secrets[cluster.MLFLOW_SECRET]["tracking-uri"]}}  # as the old docs made it
    with pytest.raises(CreateContainerConfigError, match='couldn\'t find key username in secret "tidal-mlflow"'):
        start("2.5.0", without_auth)
    assert start("2.15.0", without_auth).returncode == 0


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

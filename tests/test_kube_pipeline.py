"""The pipeline compiled by the real KFP compiler, the `tidal compile` / `tidal submit` verbs,
and the pipeline steps' own logic."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from tidal.kube import cluster, roles
from tidal.kube.kfp_local import KfpLocalError, split_loop_overrides
from tidal.kube.submit import SubmitError, parse_params, submit_run

ROOT = Path(__file__).resolve().parents[1]


def tidal(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "tidal.yaml"
    result = tidal("compile", "--output", str(out), "--accelerator", "nvidia")
    assert result.returncode == 0, result.stderr
    spec, platform = yaml.safe_load_all(out.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def dag_tasks(spec):
    for name, component in spec["components"].items():
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            yield name, task_name, task
    for task_name, task in spec["root"]["dag"]["tasks"].items():
        yield "root", task_name, task


def test_every_parameter_has_a_default(compiled):
    spec, _ = compiled
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert {
        "config_yaml",
        "config_path",
        "rounds",
        "iterations_per_round",
        "rollout_workers",
        "trainer_backend",
        "trainer_nodes",
        "registered_model_name",
    } <= set(parameters)
    missing = [name for name, p in parameters.items() if not p.get("isOptional") or "defaultValue" not in p]
    assert missing == []


def test_rounds_run_one_after_another_with_lanes_in_parallel(compiled):
    spec, _ = compiled
    loops = {c: t for c, _, t in dag_tasks(spec) if "parameterIterator" in t}
    assert loops["comp-tidal-grpo-loop"]["iteratorPolicy"] == {"parallelismLimit": 1}
    assert "iteratorPolicy" not in loops["comp-tidal-grpo-round"]  # lanes: all at once
    conditions = [t["triggerPolicy"]["condition"] for _, _, t in dag_tasks(spec) if "triggerPolicy" in t and "condition" in t["triggerPolicy"]]
    assert any("== 'trainer'" in c and not c.startswith("!") for c in conditions)
    round_tasks = spec["components"]["comp-tidal-grpo-round"]["dag"]["tasks"]
    assert set(round_tasks["evaluate"]["dependentTasks"]) == {"weight-sync"}
    assert "for-loop-1" in round_tasks["weight-sync"]["dependentTasks"]


def test_no_step_is_cached_or_installs_packages(compiled):
    spec, _ = compiled
    assert not [t for _, t, task in dag_tasks(spec) if task.get("cachingOptions", {}).get("enableCache")]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        command = " ".join(executor["container"]["command"])
        assert "pip install" not in command, name
        assert executor["container"]["image"] == cluster.PROFILES["nvidia"].image


def test_workers_request_gpus_and_every_step_gets_storage_and_secrets(compiled):
    spec, k8s = compiled
    resources = spec["deploymentSpec"]["executors"]["exec-rollout-worker"]["container"]["resources"]
    assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert "worker_accelerators" in resources["accelerator"]["resourceCount"]
    assert resources["resourceCpuRequest"] and resources["resourceMemoryRequest"]
    worker = k8s["exec-rollout-worker"]
    assert worker["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert worker["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    for name, executor in k8s.items():
        assert executor["pvcMount"][0]["mountPath"] == cluster.DATA_MOUNT_PATH, name
        assert cluster.MLFLOW_SECRET in {s["secretName"] for s in executor["secretAsEnv"]}, name


def test_compile_rejects_an_unknown_accelerator(tmp_path):
    result = tidal("compile", "--output", str(tmp_path / "p.yaml"), "--accelerator", "tpu")
    assert result.returncode != 0 and "invalid choice: 'tpu'" in result.stderr


class FakeKfpApi(BaseHTTPRequestHandler):
    """Answers the three KFP v2beta1 calls that `create_run_from_pipeline_package` makes."""

    requests: list = []

    def _reply(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        FakeKfpApi.requests.append((self.command, self.path.split("?")[0], self.headers.get("Authorization"), body))
        if self.command == "POST" and self.path.startswith("/apis/v2beta1/experiments"):
            payload = {"experiment_id": "exp-7", "display_name": body["display_name"]}
        elif self.command == "POST" and self.path.startswith("/apis/v2beta1/runs"):
            payload = {"run_id": "run-42", "experiment_id": body["experiment_id"]}
        else:
            payload = {}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _reply

    def log_message(self, *args):
        pass


@pytest.fixture
def kfp_api_server():
    FakeKfpApi.requests = []
    server = HTTPServer(("127.0.0.1", 0), FakeKfpApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_submit_with_mocked_kfp_api_server(kfp_api_server, monkeypatch):
    monkeypatch.setenv("KFP_TOKEN", "token-from-env")
    config = ROOT / "examples" / "arithmetic.yaml"
    run = submit_run(str(config), host=kfp_api_server, experiment="ci", params={"rounds": 3}, accelerator="ascend")
    assert run.run_id == "run-42" and run.url == f"{kfp_api_server}/#/runs/details/run-42"
    (create_run,) = [r for r in FakeKfpApi.requests if r[:2] == ("POST", "/apis/v2beta1/runs")]
    _, _, auth, body = create_run
    assert auth == "Bearer token-from-env"
    assert body["experiment_id"] == "exp-7"
    assert body["runtime_config"]["parameters"]["config_yaml"] == config.read_text()
    assert body["runtime_config"]["parameters"]["rounds"] == 3
    executors = body["pipeline_spec"]["pipeline_spec"]["deploymentSpec"]["executors"]
    assert executors["exec-rollout-worker"]["container"]["resources"]["accelerator"]["resourceType"] == "huawei.com/Ascend910"


def test_submit_cli_prints_the_run_url_with_mocked_kfp_api_server(kfp_api_server, monkeypatch):
    env = {**__import__("os").environ, "KFP_HOST": kfp_api_server, "KFP_TOKEN": "t"}
    result = tidal("submit", str(ROOT / "examples" / "arithmetic.yaml"), "--experiment", "ci", "-p", "rounds=2", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("/#/runs/details/run-42")


def test_submit_without_a_host_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("KFP_HOST", raising=False)
    result = tidal("submit", str(ROOT / "examples" / "arithmetic.yaml"), env={k: v for k, v in __import__("os").environ.items() if k != "KFP_HOST"})
    assert result.returncode == 2 and "pass --host URL or set KFP_HOST" in result.stderr


def test_submit_rejects_a_bad_config_before_contacting_the_server(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {iterashuns: 3}\n")
    with pytest.raises(SubmitError, match="trainer.iterashuns: unknown key"):
        submit_run(str(bad), host="http://127.0.0.1:9")
    with pytest.raises(SubmitError, match="must look like name=value"):
        parse_params(["rounds"])


def test_pipeline_knobs_become_config_overrides():
    knobs = roles.PipelineKnobs(
        rounds=3, iterations_per_round=4, rollout_workers=2, group_size=0, mode="sync", overrides="# comment\nseed=7; rollout.max_new_tokens=5\n"
    )
    assert knobs.config_overrides() == ["trainer.iterations=12", "rollout.workers=2", "mode=sync", "seed=7", "rollout.max_new_tokens=5"]
    with pytest.raises(roles.PipelineStepError, match="must both be at least 1"):
        roles.PipelineKnobs(rounds=0, iterations_per_round=1, rollout_workers=1).config_overrides()
    with pytest.raises(roles.PipelineStepError, match="'seed' must look like key=value"):
        roles.PipelineKnobs(rounds=1, iterations_per_round=1, rollout_workers=1, overrides="seed").config_overrides()


def test_lanes_put_the_trainer_first():
    assert roles.worker_lanes(2) == ["trainer", "rollout-0", "rollout-1"]
    with pytest.raises(roles.PipelineStepError, match="rollout_workers must be at least 1"):
        roles.worker_lanes(0)


def test_trainer_job_names_are_dns_labels():
    name = roles.trainer_job_name("3F2A_very-long-pipeline-job-id-" + "x" * 80, 12)
    assert len(name) <= 63 and name.endswith("-r012") and name.startswith("tidal-3f2a-very")


def test_kfp_local_loop_settings():
    loop = split_loop_overrides(["kfp.rounds=2", "seed=1"], lambda rest: 5)
    assert (loop.rounds, loop.iterations_per_round, loop.overrides) == (2, 3, ["seed=1"])
    with pytest.raises(KfpLocalError, match="unknown kfp-local option 'kfp.round'"):
        split_loop_overrides(["kfp.round=2"], lambda rest: 5)


def sleeper(seconds: float, code: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def test_worker_step_stops_a_worker_that_outlives_its_round():
    process = sleeper(600)
    roles.supervise_worker(process, lambda: "round_done", poll_s=0.05, grace_s=0.2)
    assert process.poll() is not None


def test_worker_step_fails_when_the_worker_crashes_mid_round():
    with pytest.raises(roles.PipelineStepError, match="exited with status 3 while the run was 'running'"):
        roles.supervise_worker(sleeper(0, code=3), lambda: "running", poll_s=0.05, grace_s=0.2)


def test_worker_step_stops_when_the_trainer_failed():
    process = sleeper(600)
    with pytest.raises(roles.PipelineStepError, match="trainer marked the run as failed"):
        roles.supervise_worker(process, lambda: "failed", poll_s=0.05, grace_s=0.2)
    process.wait(10)

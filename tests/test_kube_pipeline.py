"""The pipeline compiled by the real KFP compiler, the `tidal compile` / `tidal submit` verbs,
and the pipeline steps' own logic."""

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from tidal import tracking
from tidal.kube import cluster
from tidal.kube.pipeline.ir_check import driver_resolution_violations
from tidal.kube.pool import fixed as fixed_pool
from tidal.kube.steps import parent_run, rounds, run_start, staging
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.kube.submit.client import SubmitError, parse_params, submit_run
from tidal.kube.submit.kfp_local import KfpLocalError, split_loop_overrides
from tidal.kube.trainer import launch as trainer_launch
from tidal.rundir import RunDir

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


STEP_CREDENTIALS = {
    # step: (its NATS user, logs to MLflow, which snapshot keys: None, "public", or "signing" (private and public))
    "prepare": ("control", True, None),
    "worker-pool": (None, False, None),  # the Deployment it creates names Secrets; the step reads none
    "open-round": ("control", True, None),
    "job launcher": ("control", False, None),  # the trainer job's pods get the trainer's credentials, not the launcher
    "train in step": ("trainer", True, "signing"),
    "rollout-worker": ("worker", False, "public"),
    "weight-sync": (None, True, "public"),
    "evaluate": ("control", True, "public"),
    "register-model": (None, True, "public"),
    "finalize": ("control", True, None),
}


def step_credentials(executor: dict) -> tuple[str | None, bool, str | None]:
    """What a compiled step's pod is given, in STEP_CREDENTIALS' terms."""
    secrets = {s["secretName"]: {k["secretKey"] for k in s["keyToEnv"]} for s in executor.get("secretAsEnv", [])}
    (password,) = secrets.get(cluster.NATS_SECRET, {None})
    public = [c for c in executor.get("configMapAsVolume", []) if c["configMapName"] == cluster.WEIGHTS_PUBLIC_CONFIG_MAP]
    signing = [s for s in executor.get("secretAsVolume", []) if s["secretName"] == cluster.WEIGHTS_SIGNING_SECRET]
    keys = "signing" if signing else "public" if public else None
    return password and password.removesuffix("-password"), cluster.MLFLOW_SECRET in secrets, keys


@pytest.mark.parametrize("accelerator", sorted(cluster.PROFILES))
def test_each_step_gets_only_the_secrets_it_uses(tmp_path, accelerator):
    """least privilege over the compiled IR: the private key in the trainer's step alone (every other step that
    loads or checks a snapshot gets the public key), both as files where the staged config names them, never in
    a step's environment; MLflow's credentials only where a step logs to MLflow, and no Secret beyond those (the
    rollout worker's served-reward keys aside)."""
    from tidal.kube.pipeline.definition import compile_pipeline

    spec, platform = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", accelerator).read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    train = train_executors_by_backend(spec)
    names = {train["job"].removeprefix("exec-"): "job launcher", train["local"].removeprefix("exec-"): "train in step"}
    given = {names.get(name.removeprefix("exec-"), name.removeprefix("exec-")): step_credentials(e) for name, e in executors.items()}
    assert given == STEP_CREDENTIALS
    for name, executor in executors.items():
        allowed = {cluster.NATS_SECRET, cluster.MLFLOW_SECRET}
        allowed |= {cluster.REWARD_SECRET} if name == "exec-rollout-worker" else set()
        assert {s["secretName"] for s in executor.get("secretAsEnv", [])} <= allowed, name
        assert "configMapAsEnv" not in executor, name
        files = {(c["configMapName"], c["mountPath"], c["optional"]) for c in executor.get("configMapAsVolume", [])}
        files |= {(s["secretName"], s["mountPath"], s["optional"]) for s in executor.get("secretAsVolume", [])}
        assert files <= {
            (cluster.WEIGHTS_PUBLIC_CONFIG_MAP, cluster.WEIGHTS_PUBLIC_MOUNT_PATH, False),
            (cluster.WEIGHTS_SIGNING_SECRET, cluster.WEIGHTS_SIGNING_MOUNT_PATH, False),
        }, name
    assert Path(cluster.WEIGHTS_PUBLIC_KEY_FILE).parent == Path(cluster.WEIGHTS_PUBLIC_MOUNT_PATH)
    assert Path(cluster.WEIGHTS_SIGNING_KEY_FILE).parent == Path(cluster.WEIGHTS_SIGNING_MOUNT_PATH)


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
    knobs = staging.PipelineKnobs(
        rounds=3, iterations_per_round=4, rollout_workers=2, group_size=0, mode="sync", overrides="# comment\nseed=7; rollout.max_new_tokens=5\n"
    )
    assert knobs.config_overrides() == ["trainer.iterations=12", "rollout.workers=2", "mode=sync", "seed=7", "rollout.max_new_tokens=5"]
    with pytest.raises(PipelineStepError, match="must both be at least 1"):
        staging.PipelineKnobs(rounds=0, iterations_per_round=1, rollout_workers=1).config_overrides()
    with pytest.raises(PipelineStepError, match="'seed' must look like key=value"):
        staging.PipelineKnobs(rounds=1, iterations_per_round=1, rollout_workers=1, overrides="seed").config_overrides()


def test_lanes_put_the_trainer_first():
    assert run_start.worker_lanes(2) == ["trainer", "rollout-0", "rollout-1"]
    with pytest.raises(PipelineStepError, match="rollout_workers must be at least 1"):
        run_start.worker_lanes(0)


def test_trainer_job_names_are_dns_labels():
    name = trainer_launch.trainer_job_name("3F2A_very-long-pipeline-job-id-" + "x" * 80, 12)
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
    fixed_pool.supervise_worker(process, lambda: "round_done", poll_s=0.05, grace_s=0.2)
    assert process.poll() is not None


def test_worker_step_fails_when_the_worker_crashes_mid_round():
    with pytest.raises(PipelineStepError, match="exited with status 3 while the run was 'running'"):
        fixed_pool.supervise_worker(sleeper(0, code=3), lambda: "running", poll_s=0.05, grace_s=0.2)


def test_worker_step_stops_when_the_trainer_failed():
    process = sleeper(600)
    with pytest.raises(PipelineStepError, match="trainer marked the run as failed"):
        fixed_pool.supervise_worker(process, lambda: "failed", poll_s=0.05, grace_s=0.2)
    process.wait(10)


# ---------------------------------------------------------------- the KFP driver's input resolution


def compiled_spec(tmp_path, accelerator, image=""):
    from tidal.kube.pipeline.definition import compile_pipeline

    path = compile_pipeline(tmp_path / f"{accelerator}.yaml", accelerator=accelerator, image=image)
    return next(yaml.safe_load_all(path.read_text()))


@pytest.mark.parametrize("image", ["", "registry.example/tidal:dev"])
@pytest.mark.parametrize("accelerator", sorted(cluster.PROFILES))
def test_every_task_input_resolves_from_its_parent_dag(tmp_path, accelerator, image):
    """The driver's rule, on every variant the compiler produces (profiles × step image). Runtime
    parameters (trainer_backend pytorchjob/local, the lane conditions) choose branches of this same IR,
    so both branches of every condition are checked here."""
    from tidal.kube.pipeline.ir_check import driver_resolution_violations

    spec = compiled_spec(tmp_path, accelerator, image)
    assert driver_resolution_violations(spec) == []
    tasks = {t: task for _, t, task in dag_tasks(spec)}
    conditions = [task for task in tasks.values() if "condition" in task.get("triggerPolicy", {})]
    assert len(conditions) == 4  # trainer lane and rollout lane; in the trainer lane, job launcher and trainer in the step
    if accelerator != "cpu":
        worker_dag = next(c for c in spec["components"].values() if "rollout-worker" in c.get("dag", {}).get("tasks", {}))
        declared = worker_dag["inputDefinitions"]["parameters"]
        assert {"pipelinechannel--worker_accelerators", "pipelinechannel--worker_cpu", "pipelinechannel--worker_memory"} <= set(declared)


def test_driver_check_flags_a_resource_parameter_read_from_an_outer_scope():
    """Defect 1 in miniature: `set_cpu_request(param)` inside ParallelFor + If compiles, runs under
    kfp.local, and fails on a cluster; the check names the task and the channel."""
    from kfp import compiler, dsl

    from tidal.kube.pipeline.ir_check import driver_resolution_violations
    from tidal.kube.pipeline.task_settings import consume_channels

    @dsl.component(base_image="python:3.11")
    def step(x: str):
        pass

    def build(fixed: bool):
        @dsl.pipeline(name="p")
        def p(items: list[str] = ["a"], cpu: str = "1"):  # noqa: B006
            with dsl.ParallelFor(items) as item:
                with dsl.If(item == "a"):
                    task = step(x=item).set_cpu_request(cpu)
                    if fixed:
                        consume_channels(task, cpu)

        return p

    def violations(fixed):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            compiler.Compiler().compile(build(fixed), f"{tmp}/p.yaml")
            return driver_resolution_violations(yaml.safe_load(Path(f"{tmp}/p.yaml").read_text()))

    (problem,) = violations(fixed=False)
    assert "step" in problem and "'pipelinechannel--cpu'" in problem and "parent DAG does not declare" in problem
    assert violations(fixed=True) == []


def test_driver_check_flags_outputs_of_tasks_outside_the_dag_and_undeclared_placeholders():
    from tidal.kube.pipeline.ir_check import driver_resolution_violations

    spec = {
        "components": {"comp-a": {"outputDefinitions": {"parameters": {"out": {}}}}, "comp-b": {}},
        "root": {
            "inputDefinitions": {"parameters": {"p": {}}},
            "dag": {
                "tasks": {
                    "a": {"componentRef": {"name": "comp-a"}},
                    "b": {
                        "componentRef": {"name": "comp-b"},
                        "inputs": {
                            "parameters": {
                                "x": {"taskOutputParameter": {"producerTask": "a", "outputParameterKey": "missing"}},
                                "y": {"taskOutputParameter": {"producerTask": "elsewhere", "outputParameterKey": "out"}},
                                "z": {"runtimeValue": {"constant": "{{$.inputs.parameters['pipelinechannel--q']}}"}},
                            }
                        },
                        "triggerPolicy": {"condition": "inputs.parameter_values['pipelinechannel--c'] == 'x'"},
                    },
                }
            },
        },
    }
    problems = "\n".join(driver_resolution_violations(spec))
    assert "output 'missing' of 'a'" in problems and "'elsewhere', which is not a task of the same DAG" in problems
    assert "'pipelinechannel--q', which is not an input" in problems and "its condition reads 'pipelinechannel--c'" in problems


# ---------------------------------------------------------------- images


def test_image_flag_is_also_the_trainer_image_default(tmp_path):
    spec = compiled_spec(tmp_path, "nvidia", image="registry.example/tidal:dev")
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["trainer_image"]["defaultValue"] == "registry.example/tidal:dev"
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {"registry.example/tidal:dev"}
    assert (
        compiled_spec(tmp_path, "ascend")["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"]
        == cluster.PROFILES["ascend"].image
    )


def test_submit_with_image_sends_a_pipeline_whose_trainer_image_is_that_image_with_mocked_kfp_api_server(kfp_api_server, monkeypatch):
    monkeypatch.setenv("KFP_TOKEN", "t")
    submit_run(str(ROOT / "examples" / "arithmetic.yaml"), host=kfp_api_server, image="registry.example/tidal:ci")
    (create_run,) = [r for r in FakeKfpApi.requests if r[:2] == ("POST", "/apis/v2beta1/runs")]
    spec = create_run[3]["pipeline_spec"]["pipeline_spec"]
    assert spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"] == "registry.example/tidal:ci"


# ---------------------------------------------------------------- config text and data paths


def test_submit_maps_relative_data_paths_of_the_examples_into_the_image():
    from tidal.kube.submit.client import pipeline_arguments

    text = pipeline_arguments(str(ROOT / "examples" / "gsm8k.yaml"), {})["config_yaml"]
    data = yaml.safe_load(text)["data"]
    assert data["path"] == "/opt/tidal/examples/data/gsm8k/train.jsonl"
    assert data["eval_path"] == "/opt/tidal/examples/data/gsm8k/test.jsonl"
    for image in ("cpu", "cuda", "ascend"):  # the images carry that folder there
        assert "COPY examples /opt/tidal/examples" in (ROOT / "images" / image / "Dockerfile").read_text()


def test_submit_refuses_a_relative_data_path_the_pods_cannot_read(tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    config = tmp_path / "mine.yaml"
    config.write_text("data: {task: jsonl, path: mine.jsonl}\n")
    with pytest.raises(SubmitError, match=r"data.path: 'mine.jsonl' is a file on this machine .*cannot read"):
        submit_run(str(config), host="http://127.0.0.1:9")
    config.write_text("data: {task: jsonl, path: missing.jsonl}\n")
    with pytest.raises(SubmitError, match="does not exist"):
        submit_run(str(config), host="http://127.0.0.1:9")


def test_prepare_refuses_relative_data_paths_in_config_text_and_missing_data_files(tmp_path):
    (tmp_path / "kube").mkdir()
    with pytest.raises(PipelineStepError, match=r"config_yaml has relative data paths \(data.path: 'data/train.jsonl'\)"):
        staging.stage_config(RunDir(tmp_path), "data: {task: jsonl, path: data/train.jsonl}\n", "", [])
    with pytest.raises(PipelineStepError, match="data files not found in the pipeline's pods: data.path=/nowhere/train.jsonl"):
        staging.stage_config(RunDir(tmp_path), "data: {task: jsonl, path: /nowhere/train.jsonl}\n", "", [])
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    staged = staging.stage_config(RunDir(tmp_path), f"data: {{task: jsonl, path: {data}}}\n", "", [])
    assert yaml.safe_load(Path(staged).read_text())["data"]["path"] == str(data)


def test_the_staged_config_names_the_snapshot_keys_where_the_pods_mount_them(tmp_path, monkeypatch):
    """every role reads its snapshot key from the file the staged config names: the cluster's mounts (unless the
    config names others); under --via kfp-local, where nothing is mounted, the run directory's (the default)."""
    from tidal.kube.steps.pod_sandbox import POD_SANDBOX_ENV

    (tmp_path / "kube").mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    text = f"data: {{task: jsonl, path: {data}}}\n"
    monkeypatch.delenv(POD_SANDBOX_ENV, raising=False)
    weights = yaml.safe_load(Path(staging.stage_config(RunDir(tmp_path), text, "", [])).read_text())["weights"]
    assert (weights["public_key_file"], weights["signing_key_file"]) == (cluster.WEIGHTS_PUBLIC_KEY_FILE, cluster.WEIGHTS_SIGNING_KEY_FILE)
    weights = yaml.safe_load(Path(staging.stage_config(RunDir(tmp_path), text, "", ["weights.public_key_file=/keys/pub"])).read_text())["weights"]
    assert (weights["public_key_file"], weights["signing_key_file"]) == ("/keys/pub", cluster.WEIGHTS_SIGNING_KEY_FILE)
    monkeypatch.setenv(POD_SANDBOX_ENV, str(tmp_path / "pods"))
    weights = yaml.safe_load(Path(staging.stage_config(RunDir(tmp_path), text, "", [])).read_text())["weights"]
    assert weights["public_key_file"] is None and weights["signing_key_file"] is None


def test_prepare_runs_the_checks_tidal_run_runs_before_anything_starts(tmp_path):
    """Bad input in the pipeline: a bad reward name or data row fails the prepare step in one line naming it."""
    (tmp_path / "kube").mkdir()
    with pytest.raises(PipelineStepError, match=r"reward function 'no_such_module:score': cannot import module 'no_such_module'"):
        staging.stage_config(RunDir(tmp_path), "reward: {functions: [{name: 'no_such_module:score'}]}\n", "", [])
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n{"question": 3}\n')
    with pytest.raises(PipelineStepError, match=rf"{data}:2"):
        staging.stage_config(RunDir(tmp_path), f"data: {{task: jsonl, path: {data}}}\n", "", [])
    assert not (tmp_path / "config.yaml").exists()  # nothing staged


@pytest.mark.parametrize("name", ["", "team/policy", "policy:v2", "..", "..policy"])
def test_prepare_refuses_a_registered_model_name_the_registry_would_refuse_before_anything_is_staged(tmp_path, name):
    """The last step registers the model: a name MLflow's registry refuses would fail the run only after all its
    training. The prepare step refuses it first, in one line, and writes nothing."""
    knobs = staging.PipelineKnobs(rounds=1, iterations_per_round=1, rollout_workers=1)
    run_dir = tmp_path / "run"
    with pytest.raises(PipelineStepError, match=rf"registered_model_name {re.escape(repr(name))}: a registered model's name must not"):
        run_start.prepare("", "", str(run_dir), "job-1", knobs, trainer_backend="local", registered_model_name=name)
    assert not run_dir.exists()
    run_start.check_registered_model_name("tidal-policy")  # the pipeline's default passes


@pytest.mark.parametrize("name", ["policy", ".policy", "policy..", "a.b", " .", "", " ", ".", "..", "..policy", "...", "a/b", "a:b"])
def test_the_registry_name_rule_is_mlflows_own(name):
    """The name check stands in for the registry's: what it passes, MLflow's registry accepts, and what MLflow
    refuses (a name starting with '..' too: names are also paths), it refuses first."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_name

    from tidal.tracking import registry_name_problem

    try:
        _validate_model_name(name)
        mlflow_refuses = False
    except MlflowException:
        mlflow_refuses = True
    assert (registry_name_problem(name) is not None) == mlflow_refuses


# ---------------------------------------------------------------- trainer resources


def train_executors_by_backend(spec):
    """``{"job": executor, "local": executor}``: the train task under each branch of the trainer_backend condition."""
    components = spec["components"]
    found = {}
    for component in components.values():
        for task in component.get("dag", {}).get("tasks", {}).values():
            condition = task.get("triggerPolicy", {}).get("condition", "")
            if "trainer_backend" not in condition:
                continue
            branch = components[task["componentRef"]["name"]]
            (train_task,) = [t for name, t in branch["dag"]["tasks"].items() if name.startswith("train")]
            executor = components[train_task["componentRef"]["name"]]["executorLabel"]
            found["local" if condition.startswith("!") else "job"] = executor
    return found


@pytest.mark.parametrize("accelerator", ["nvidia", "ascend", "cpu"])
def test_the_trainer_in_step_gets_the_trainers_resources_and_the_launcher_stays_small(tmp_path, accelerator):
    """trainer_backend=local trains inside the train step's pod: that pod must get trainer_cpu / trainer_memory
    and trainer_accelerators_per_node accelerators; the job launcher only waits, so it keeps 500m / 1Gi."""
    from tidal.kube.pipeline.definition import compile_pipeline

    spec, platform = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", accelerator).read_text())
    executors = spec["deploymentSpec"]["executors"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    by_backend = train_executors_by_backend(spec)
    assert set(by_backend) == {"job", "local"}

    launcher = executors[by_backend["job"]]["container"]["resources"]
    assert (launcher["resourceCpuRequest"], launcher["resourceMemoryRequest"]) == ("500m", "1Gi") and "accelerator" not in launcher

    in_step = executors[by_backend["local"]]["container"]["resources"]
    assert "trainer_cpu" in in_step["resourceCpuRequest"]
    assert "trainer_memory" in in_step["resourceMemoryRequest"] and "trainer_memory" in in_step["resourceMemoryLimit"]
    profile = cluster.PROFILES[accelerator]
    if profile.has_accelerator:
        assert in_step["accelerator"]["resourceType"] == profile.resource
        assert "trainer_accelerators_per_node" in in_step["accelerator"]["resourceCount"]
        assert k8s[by_backend["local"]]["tolerations"] == [{"key": t.key, "operator": t.operator, "effect": t.effect} for t in profile.tolerations]
    else:
        assert "accelerator" not in in_step
    assert k8s[by_backend["local"]]["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    for backend in ("job", "local"):
        assert {e["name"] for e in k8s[by_backend[backend]]["fieldPathAsEnv"]} == {"TIDAL_POD_NAME", "TIDAL_POD_UID"}


def test_the_trainer_in_step_uses_every_accelerator_of_its_pod_and_refuses_several_nodes():
    local = trainer_launch.TrainerPlacement(backend="local", accelerator="nvidia", accelerators_per_node=4)
    command = trainer_launch.local_trainer_command("/r/config.yaml", RunDir("/r"), "nats://n:4222", 5, local)
    assert command[1:4] == ["--standalone", "--nproc-per-node=4", "--no-python"] and command[0].endswith("torchrun")
    assert command[-8:] == ["train", "/r/config.yaml", "--run-dir", "/r", "--nats-url", "nats://n:4222", "--iterations", "5"]
    one = trainer_launch.local_trainer_command(
        "/r/config.yaml", RunDir("/r"), "nats://n:4222", 5, trainer_launch.TrainerPlacement(backend="local", accelerator="cpu")
    )
    assert one[0].endswith("tidal") and one[1] == "train"
    with pytest.raises(PipelineStepError, match="trainer_nodes must be 1 \\(got 2\\)"):
        trainer_launch.local_trainer_command(
            "/r/config.yaml", RunDir("/r"), "nats://n:4222", 5, trainer_launch.TrainerPlacement(backend="local", nodes=2)
        )


def test_a_step_without_a_tracking_uri_fails_naming_the_secret_instead_of_logging_to_a_local_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(PipelineStepError, match="key 'tracking-uri' of Secret 'tidal-mlflow'"):
        parent_run.tracking_uri_for(RunDir(tmp_path), None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tidal-mlflow:5000")
    assert parent_run.tracking_uri_for(RunDir(tmp_path), None) == "http://tidal-mlflow:5000"
    assert parent_run.tracking_uri_for(RunDir(tmp_path), "sqlite:///x.db") == "sqlite:///x.db"


# ---------------------------------------------------------------- finalize, the exit handler


@pytest.mark.parametrize("accelerator", sorted(cluster.PROFILES))
def test_finalize_is_the_exit_handler_of_everything_the_run_does(tmp_path, accelerator):
    """KFP runs an exit task after the group it guards ends, succeeded, failed or cancelled: finalize must guard
    prepare (it creates the streams), the worker pool, the rounds (trainer jobs, workers) and the model registration."""
    from tidal.kube.pipeline.definition import compile_pipeline

    spec, platform = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", accelerator).read_text())
    root = spec["root"]["dag"]["tasks"]
    (guarded,) = [name for name in root if name != "finalize"]
    finalize = root["finalize"]
    assert finalize["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}  # runs after failures too
    assert finalize["dependentTasks"] == [guarded]
    # no dsl.PipelineTaskFinalStatus input: KFP backends before 2.14 cannot resolve it (finalize reads the run directory)
    assert "status" not in finalize["inputs"]["parameters"]
    inside = spec["components"][root[guarded]["componentRef"]["name"]]["dag"]["tasks"]
    assert set(inside) == {"prepare", "worker-pool", "tidal-grpo-loop", "register-model"}
    # the name the last step registers under is checked by the first, before any training
    named = inside["prepare"]["inputs"]["parameters"]["registered_model_name"]
    assert named == inside["register-model"]["inputs"]["parameters"]["registered_model_name"] and "componentInputParameter" in named
    # it reads only pipeline parameters (a KFP rule for exit tasks), and finds the run directory as prepare does
    params = finalize["inputs"]["parameters"]
    assert params["run_dir"] == {"componentInputParameter": "run_dir"}
    assert params["job_id"] == inside["prepare"]["inputs"]["parameters"]["job_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-finalize"]
    assert {s["secretName"] for s in k8s["secretAsEnv"]} == {cluster.NATS_SECRET, cluster.MLFLOW_SECRET}
    assert k8s["pvcMount"][0]["mountPath"] == cluster.DATA_MOUNT_PATH


def test_each_round_takes_and_releases_the_round_lease_of_its_pipeline_run(tmp_path):
    """open_round takes the lease, evaluate (the round's last step) releases it, both under the pipeline run's id,
    the one prepare resets the lease with: what lets a backend that ignores parallelism=1 fail clearly."""
    from tidal.kube.pipeline.definition import compile_pipeline

    spec, _ = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", "nvidia").read_text())
    round_tasks = spec["components"]["comp-tidal-grpo-round"]["dag"]["tasks"]
    job_id = {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}
    assert round_tasks["open-round"]["inputs"]["parameters"]["job_id"] == job_id
    assert round_tasks["evaluate"]["inputs"]["parameters"]["job_id"] == job_id
    assert round_tasks["evaluate"]["dependentTasks"] == ["weight-sync"]  # the last step of the round
    assert not [t for t, task in round_tasks.items() if "evaluate" in task.get("dependentTasks", [])]


# ---------------------------------------------------------------- issue 14: hygiene, Kueue, run links


def test_loops_and_branches_have_their_own_display_names(compiled):
    """The KFP UI shows a group's taskInfo.name: without names both loops read 'for-loop-1'."""
    spec, _ = compiled
    groups = [(name, task["taskInfo"]["name"]) for _, name, task in dag_tasks(spec) if name.startswith(("for-loop", "condition-", "exit-handler"))]
    named = [(name, shown) for name, shown in groups if not name.startswith("condition-branches")]  # If/Else wrappers take no name
    assert named and not [name for name, shown in named if shown == name]  # every loop, branch and the exit handler
    loops = [shown for name, shown in groups if name.startswith("for-loop")]
    assert len(loops) == 2 and len(set(loops)) == 2


RETRIED = {"prepare", "worker-pool", "open-round", "weight-sync", "evaluate", "finalize"}


def test_only_steps_that_can_run_again_are_retried_and_bookkeeping_steps_have_a_timeout(compiled):
    spec, executors = compiled
    retried = {task_name for _, task_name, task in dag_tasks(spec) if task.get("retryPolicy", {}).get("maxRetryCount", 0) > 0}
    assert retried == RETRIED  # never train (it marked the run failed) nor rollout-worker
    for name in RETRIED:
        assert int(executors[f"exec-{name}"]["activeDeadlineSeconds"]) > 0  # protobuf int64: a string in the YAML
    for name in ("exec-train", "exec-train-2", "exec-rollout-worker"):
        assert "activeDeadlineSeconds" not in executors[name]


def test_trainjob_is_the_default_trainer_backend(compiled):
    spec, _ = compiled
    assert spec["root"]["inputDefinitions"]["parameters"]["trainer_backend"]["defaultValue"] == "trainjob"


def test_queue_name_labels_the_accelerator_pods_and_reaches_the_trainer_job_launcher(tmp_path):
    from tidal.kube.pipeline.definition import compile_pipeline

    documents = list(yaml.safe_load_all(compile_pipeline(tmp_path / "q.yaml", queue_name="team-a-gpus").read_text()))
    executors = documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    queued = {name for name, e in executors.items() if e.get("podMetadata", {}).get("labels", {}).get(cluster.QUEUE_LABEL) == "team-a-gpus"}
    assert queued == {"exec-rollout-worker", "exec-evaluate", "exec-train-2"}  # workers, eval, the trainer in its step
    launcher = next(t for c, n, t in dag_tasks(documents[0]) if n == "train" and c == "comp-condition-4")
    assert launcher["inputs"]["parameters"]["queue_name"]["runtimeValue"]["constant"] == "team-a-gpus"
    assert driver_resolution_violations(documents[0]) == []
    unqueued = compiled_spec(tmp_path, "nvidia")
    assert "team-a-gpus" not in yaml.safe_dump(unqueued)


def test_run_metrics_are_an_output_of_a_task_at_the_top_of_the_run(compiled):
    spec, _ = compiled
    finalize = spec["root"]["dag"]["tasks"]["finalize"]
    outputs = spec["components"][finalize["componentRef"]["name"]]["outputDefinitions"]["artifacts"]
    assert outputs["run_metrics"]["artifactType"]["schemaTitle"] == "system.Metrics"
    prepare_outputs = spec["components"]["comp-prepare"]["outputDefinitions"]["artifacts"]
    assert prepare_outputs["mlflow_run"]["artifactType"]["schemaTitle"] == "system.Markdown"


def test_the_mlflow_run_links_to_its_kfp_run_and_the_final_metrics_are_the_last_rounds(tmp_path, tiny_config_dict, monkeypatch):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "job-7"
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config_dict))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    links = parent_run.RunLinks(kfp_ui_url="https://kf.example/pipeline/", mlflow_ui_url="https://kf.example/tidal-mlflow")
    parent = parent_run.open_parent_run(RunDir(run_dir), str(config_path), "job-7", links)
    client = MlflowClient(parent.tracking_uri)
    run = client.get_run(parent.run_id)
    tags = run.data.tags
    assert tags["kfp.run_id"] == "job-7" and tags["kfp.run_url"] == "https://kf.example/pipeline/#/runs/details/job-7"
    assert run.data.params["trainer.iterations"] == "3" and "rollout.group_size" in run.data.params  # the config, dotted keys
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the MLflow UI's model-training view
    assert experiment.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()  # beside the store, as for `tidal run`
    markdown = parent_run.mlflow_run_markdown(str(run_dir))
    assert f"(https://kf.example/tidal-mlflow/#/experiments/{run.info.experiment_id}/runs/{parent.run_id}?workflowType=machine_learning)" in markdown

    assert rounds.final_metrics(str(run_dir), "") == {}
    records = StepRecords(RunDir(run_dir))
    for round_index, accuracy in ((0, 0.25), (1, 0.5)):
        records.write(records.eval_file(round_index), {"round": round_index, "metrics": {"accuracy": accuracy}})
    assert rounds.final_metrics(str(run_dir), "") == {"final_accuracy": 0.5, "rounds_evaluated": 2.0}


@pytest.mark.parametrize(
    "parameter, secret_ui_url, tracking_uri, expected",
    [
        (
            "",
            "https://kubeflow.example.com/tidal/mlflow/",
            "http://tidal-mlflow:5000/tidal/mlflow",
            "https://kubeflow.example.com/tidal/mlflow/#/experiments/3/runs/abc?workflowType=machine_learning",
        ),
        (
            "https://ml.example/tidal/mlflow",
            "https://kubeflow.example.com/tidal/mlflow/",
            "http://x",
            "https://ml.example/tidal/mlflow/#/experiments/3/runs/abc?workflowType=machine_learning",
        ),
        (
            "",
            "",
            "http://tidal-mlflow:5000/tidal/mlflow",
            "http://tidal-mlflow:5000/tidal/mlflow/#/experiments/3/runs/abc?workflowType=machine_learning",
        ),
        ("", "", "sqlite:///tmp/m.db", ""),
    ],
)
def test_the_mlflow_link_keeps_the_gateway_prefix_and_comes_from_the_parameter_the_secret_or_the_tracking_uri(
    parameter, secret_ui_url, tracking_uri, expected, monkeypatch
):
    """Behind the Kubeflow gateway the UI is https://<host>/tidal/mlflow/ and its run pages are fragments of that path."""
    monkeypatch.setenv(cluster.MLFLOW_UI_URL_ENV, secret_ui_url)
    base = parent_run.mlflow_ui_base(parent_run.RunLinks(mlflow_ui_url=parameter), tracking_uri)
    assert (tracking.run_page_url(base, "3", "abc") if base else "") == expected

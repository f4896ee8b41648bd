"""`tidal scale`: the rollout pool of a running `tidal run` grows and shrinks, and nothing is lost."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import background_run, read_jsonl, run_cli, trained_in, wait_until
from tests.rewards import REWARD_GATE_ENV
from tidal.config import ConfigError, config_from_dict

ITERATIONS = 5
PROMPTS = 6  # the tiny config's trainer.prompts_per_iteration


def paced_config(write_config, name: str = "config.yaml", **extra) -> Path:
    """Deterministic rollouts, a group at a time, a slow reward: a worker joins and leaves mid-run."""
    rewards = [{"name": "tests.rewards:paced_exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}]
    overrides = {
        "rollout.deterministic": True,
        "eval.enabled": False,
        "transport.ack_wait_seconds": 2.0,
        "rollout.groups_per_batch": 1,
        "rollout.workers": {"min": 1, "max": 2},
        "trainer.iterations": ITERATIONS,
        "weights.keep_last": None,  # the start stays, to show training moved the weights
        "reward.functions": rewards,
        "reward.timeout_seconds": 900.0,  # a call held at the reward gate is not a timed-out one
    }
    return write_config({**overrides, **extra}, name)


def loaded_versions(run_dir: Path, worker: str) -> list[int]:
    log = run_dir / "logs" / f"{worker}.log"
    return [int(v) for v in re.findall(rf"worker {worker} loaded weights v(\d+)", log.read_text())] if log.is_file() else []


def groups_of(run_dir: Path, worker: str) -> list[dict]:
    """The trained groups `worker` generated (groups.jsonl gets an iteration's records at its boundary)."""
    return [r for r in read_jsonl(run_dir / "groups.jsonl") if r["worker_id"] == worker]


def scale(run_dir: Path, workers: int):
    return run_cli("scale", str(run_dir), str(workers))


def final_weights(run_dir: Path, version: int = ITERATIONS) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "weights" / f"v{version:06d}" / "model.safetensors"))


def test_a_worker_joins_and_leaves_a_running_run_and_every_group_is_trained_once(tmp_path, write_config, monkeypatch):
    """1 worker, `tidal scale 2` once it has loaded weights; once worker-1's groups of an iteration are
    trained, `tidal scale 1` in the middle of the next one (its unacked work is redelivered); the run
    trains every group once and ends at the weights of an unscaled run. The rewards wait at a gate
    while the pool changes, so the run cannot end first however slowly a worker starts."""
    config = paced_config(write_config)
    reference = run_cli("run", str(config), "--run-dir", str(tmp_path / "ref"), "--no-progress")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    gate = tmp_path / "reward-gate"
    gate.touch()
    monkeypatch.setenv(REWARD_GATE_ENV, str(gate))
    launcher_log = run_dir / "logs" / "launcher.log"
    with background_run(config, run_dir) as proc:
        wait_until(lambda: loaded_versions(run_dir, "worker-0"), proc)
        refused = scale(run_dir, 3)
        assert refused.returncode == 2 and "3 rollout workers is outside the run's rollout.workers range [1, 2]" in refused.stderr
        assert scale(run_dir, 0).returncode == 2
        grown = scale(run_dir, 2)
        assert grown.returncode == 0, grown.stderr
        wait_until(lambda: loaded_versions(run_dir, "worker-1"), proc)
        assert not trained_in(run_dir, 0)  # the gate held iteration 0 until worker-1 was ready
        gate.unlink()
        wait_until(lambda: groups_of(run_dir, "worker-1"), proc)
        contributed_to = max(r["iteration"] for r in groups_of(run_dir, "worker-1"))
        wait_until(lambda: trained_in(run_dir, contributed_to + 1), proc)
        gate.touch()  # worker-1 leaves holding work, before the run can end
        assert scale(run_dir, 1).returncode == 0
        wait_until(lambda: "stopping rollout worker worker-1" in launcher_log.read_text(), proc)
        gate.unlink()
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert contributed_to + 1 < ITERATIONS  # worker-1 left before the last iteration
    keys = [(r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl")]
    assert len(keys) == len(set(keys)) == ITERATIONS * PROMPTS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == ITERATIONS * PROMPTS and summary["staleness_max"] == 0
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert "scaling rollout workers: 1 -> 2" in launcher and "scaling rollout workers: 2 -> 1" in launcher
    assert "rollout worker worker-1 stopped (exit code 143)" in launcher
    assert "rollout worker stopped by SIGTERM" in (run_dir / "logs" / "worker-1.log").read_text()
    assert "worker-1 exited with code" not in launcher  # not taken for a crash
    assert launcher.count("starting rollout worker worker-1") == 1  # and not started again
    assert (run_dir / "weights" / "latest").read_text().strip() == str(ITERATIONS)
    start = final_weights(run_dir, 0)
    scaled, unscaled = final_weights(run_dir), final_weights(tmp_path / "ref")
    assert max((scaled[k] - start[k]).abs().max().item() for k in start) > 1e-4  # training moved the weights
    # the same groups, trained in another order (the learner accumulates them as they arrive): equal up to float rounding
    for name, tensor in unscaled.items():
        torch.testing.assert_close(scaled[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    after = scale(run_dir, 2)
    assert after.returncode == 2 and f"no `tidal run` is running in {run_dir}" in after.stderr


def test_a_config_whose_workers_exceed_max_workers_is_refused(tiny_config_dict):
    with pytest.raises(ConfigError, match=r"rollout.workers \(3\) is above rollout.max_workers \(2\)"):
        config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": 3, "max_workers": 2}})


def rollout(tiny_config_dict, **keys):
    return config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], **keys}}).rollout


def test_workers_take_a_number_auto_or_a_range_and_max_workers_reads_as_a_range(tiny_config_dict):
    assert (rollout(tiny_config_dict, workers=3).initial_workers, rollout(tiny_config_dict, workers=3).worker_bounds) == (3, (1, None))
    ranged = rollout(tiny_config_dict, workers={"min": 2, "max": 4})
    assert (ranged.initial_workers, ranged.worker_bounds, ranged.most_workers, ranged.workers_planned) == (2, (2, 4), 4, False)
    assert rollout(tiny_config_dict, workers={"min": 1, "max": 4, "start": 3}).initial_workers == 3
    assert rollout(tiny_config_dict, workers={"max": 4, "start": "auto"}).workers_planned
    legacy = rollout(tiny_config_dict, workers=2, max_workers=3)
    assert legacy.workers == rollout(tiny_config_dict, workers={"min": 1, "max": 3, "start": 2}).workers
    assert (legacy.initial_workers, legacy.worker_bounds) == (2, (1, 3))
    assert "max_workers" not in config_from_dict({**tiny_config_dict, "rollout": {"workers": 2, "max_workers": 3}}).model_dump()["rollout"]


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"workers": {"min": 3, "max": 2}}, r"rollout.workers: min \(3\) is above max \(2\)"),
        ({"workers": {"min": 1, "max": 2, "start": 5}}, r"rollout.workers: start \(5\) is outside \[min 1, max 2\]"),
        ({"workers": {"min": 1}}, r"rollout.workers: max: Field required"),
        ({"workers": "many"}, r"rollout.workers: a number of at least 1, 'auto' or a range \{min: 1, max: 4\}, not 'many'"),
        ({"workers": {"min": 1, "max": 2}, "max_workers": 3}, r"rollout.max_workers and a range in rollout.workers: write the bound once"),
    ],
)
def test_a_wrong_worker_range_is_one_line_naming_the_key(tiny_config_dict, keys, error):
    with pytest.raises(ConfigError, match=error) as refused:
        config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], **keys}})
    assert "literal" not in str(refused.value) and "constrained-int" not in str(refused.value)


def test_scale_refuses_a_run_directory_without_a_run(tmp_path):
    refused = scale(tmp_path, 2)
    assert refused.returncode == 2 and f"{tmp_path} holds no run (no config.yaml)" in refused.stderr


def taken_lines(run_dir: Path, worker: str) -> list[str]:
    log = run_dir / "logs" / f"{worker}.log"
    return re.findall(rf"worker {worker} took .*", log.read_text()) if log.is_file() else []


def pairs(text: str) -> list[tuple[int, ...]]:
    """The (iteration, prompt[, delivery]) tuples a worker's log line lists."""
    return [tuple(int(x) for x in t if x) for t in re.findall(r"\((\d+), (\d+)(?:, (\d+))?\)", text)]


def test_a_worker_preempted_by_sigterm_hands_back_its_items_and_another_worker_regenerates_them(tmp_path, write_config, monkeypatch):
    """SIGTERM to a worker while it holds a work item: it NAKs what it holds and leaves. The ack deadline
    is an hour, so the items can come back only through the hand-back: the other worker takes them on
    their second delivery, the trainer never asks for them again, every group is trained once by the
    version of its iteration, and the run ends at the weights of an unfaulted run."""
    import os
    import signal

    gate = tmp_path / "reward-gate"
    monkeypatch.setenv(REWARD_GATE_ENV, str(gate))
    config = paced_config(write_config)
    reference = run_cli("run", str(config), "--run-dir", str(tmp_path / "ref"), "--no-progress")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    faulted = paced_config(
        write_config, "preempted.yaml", **{"rollout.workers": {"min": 1, "max": 2, "start": 2}, "transport.ack_wait_seconds": 3600.0}
    )
    with background_run(faulted, run_dir) as proc:
        wait_until(lambda: len(taken_lines(run_dir, "worker-1")) >= 2 and trained_in(run_dir, 1), proc)
        seen = len(taken_lines(run_dir, "worker-1"))
        wait_until(lambda: len(taken_lines(run_dir, "worker-1")) > seen, proc)  # it has just taken an item: it holds it
        gate.touch()  # no group can be scored, so the run cannot end before the launcher sees the worker leave
        os.kill(int((run_dir / "logs" / "worker-1.pid").read_text()), signal.SIGTERM)
        wait_until(lambda: "worker-1 was stopped by SIGTERM" in (run_dir / "logs" / "launcher.log").read_text(), proc)
        gate.unlink()
        out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    worker_log = (run_dir / "logs" / "worker-1.log").read_text()
    (handed_line,) = re.findall(r"worker worker-1 stopping \(SIGTERM\): handed back (\d+) work item\(s\) for redelivery (.*)", worker_log)
    handed = pairs(handed_line[1])
    assert int(handed_line[0]) == len(handed) >= 1
    redelivered = {
        (it, p): n
        for w in ("worker-0", "worker-1")
        for line in taken_lines(run_dir, w)
        if "redelivered" in line
        for it, p, n in pairs(line.split("redelivered")[1])
    }
    assert all(redelivered.get(key) == 2 for key in handed), (handed, redelivered)
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert "rollout worker worker-1 was stopped by SIGTERM (preempted); starting a replacement" in launcher
    assert "worker-1 exited with code" not in launcher  # a preemption is not a crash
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "asking again for" not in trainer_log and "has sent no heartbeat" not in trainer_log
    records = read_jsonl(run_dir / "groups.jsonl")
    keys = [(r["iteration"], r["prompt_id"]) for r in records]
    assert len(keys) == len(set(keys)) == ITERATIONS * PROMPTS
    assert all(r["policy_version"] == r["iteration"] for r in records)  # periodic: staleness 0
    assert json.loads((run_dir / "summary.json").read_text())["staleness_max"] == 0
    faulted, unfaulted = final_weights(run_dir), final_weights(tmp_path / "ref")
    for name, tensor in unfaulted.items():
        torch.testing.assert_close(faulted[name], tensor, atol=1e-5, rtol=1e-4, msg=name)

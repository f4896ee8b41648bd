"""A non-finite loss or gradient norm skips the optimizer step (weights unchanged, counted);
trainer.max_skipped_steps then fails the run. Real tiny model, real forward/backward, real `tidal run`."""

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_jsonl, run_cli
from tidal.config import config_from_dict, load_config
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.protocol import Group, Sample
from tidal.roles import build_learner, ensure_base_model
from tidal.rundir import latest_checkpoint
from tidal.trainer.guard import SkippedStepsError


def group(rewards: list[float], logprob: float = -1.0) -> Group:
    samples = [Sample(np.array([7, 8, 9], dtype=np.int32), np.full(3, logprob, dtype=np.float32), r) for r in rewards]
    return Group(0, 0, 0, "test", np.array([5, 6], dtype=np.int32), samples)


@pytest.fixture
def learner(tiny_config_dict):
    data = copy.deepcopy(tiny_config_dict)
    data["trainer"]["max_skipped_steps"] = 1
    cfg = config_from_dict(data)
    base = prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed))
    return build_learner(cfg, str(base))[0]


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_a_nan_loss_skips_the_step_and_keeps_the_weights(learner):
    before = weights(learner)
    learner.train_on_groups([group([1.0, 0.0, float("nan"), 0.0])])  # NaN advantages through a real backward
    update = learner.step()
    assert update["steps_skipped"] == 1.0 and update["steps_skipped_total"] == 1.0
    after = weights(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None or not p.grad.any() for p in learner.model.parameters())  # the bad gradients are dropped

    learner.train_on_groups([group([1.0, 0.0, 1.0, 0.0])])  # a good group still trains, from clean gradients
    update = learner.step()
    assert update["steps_skipped"] == 0.0 and update["steps_skipped_total"] == 1.0
    moved = weights(learner)
    assert all(torch.isfinite(v).all() for v in moved.values())
    assert any(not torch.equal(before[k], moved[k]) for k in before)


def test_an_infinite_gradient_norm_skips_the_step(learner):
    before = weights(learner)
    learner.train_on_groups([group([1.0, 0.0, 1.0, 0.0])])
    next(learner.model.parameters()).grad.view(-1)[0] = float("inf")  # a finite loss whose backward overflowed
    update = learner.step()
    assert update["steps_skipped"] == 1.0 and not np.isfinite(update["grad_norm"])
    assert all(torch.equal(before[k], v) for k, v in weights(learner).items())


def test_more_skipped_steps_than_the_limit_fail_naming_the_key(learner):
    learner.train_on_groups([group([1.0, 0.0, float("nan"), 0.0])])
    learner.step()  # 1 skipped: within trainer.max_skipped_steps = 1
    learner.train_on_groups([group([1.0, 0.0, float("nan"), 0.0])])
    with pytest.raises(SkippedStepsError, match=r"trainer\.max_skipped_steps \(1\)") as err:
        learner.step()
    assert "\n" not in str(err.value)


def test_the_skipped_count_survives_a_checkpoint(learner):
    learner.train_on_groups([group([1.0, 0.0, float("nan"), 0.0])])
    learner.step()
    tensors = learner.optimizer_tensors()
    learner.steps_skipped_total = 0
    learner.load_optimizer_tensors(tensors)
    assert learner.steps_skipped_total == 1


def test_a_run_whose_loss_is_nan_keeps_finite_weights_and_fails_after_the_limit(tmp_path, write_config):
    """Before the guard: grad_norm nan, every final weight NaN, exit code 0."""
    config = write_config({"trainer.advantage": "tests.rewards:nan_advantage", "trainer.max_skipped_steps": 1, "eval.enabled": False})
    ensure_base_model(load_config(config))  # built here, so the run's stderr holds only its own lines
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trainer.max_skipped_steps (1)" in proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["steps_skipped"] for m in metrics] == [1.0] and metrics[0]["steps_skipped_total"] == 1.0
    v0, v1 = (load_file(str(run_dir / "weights" / v / "model.safetensors")) for v in ("v000000", "v000001"))
    assert all(torch.isfinite(t).all() and torch.equal(t, v1[k]) for k, t in v0.items())
    assert not (run_dir / "weights" / "v000002").exists()  # nothing was published after the failing iteration
    assert "optimizer step skipped" in (run_dir / "logs" / "trainer.log").read_text()
    assert latest_checkpoint(run_dir / "checkpoint").next_version == 1

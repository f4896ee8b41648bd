"""The optimizer checkpoint moves from v to v+1 in one rename (#15 item 7): a trainer killed between
writing its shard and state.json resumes v with v's own optimizer state. Real tiny model, real
optimizer steps, real safetensors files."""

import copy

import numpy as np
import pytest
import torch

from tidal.config import config_from_dict
from tidal.data import load_dataset
from tidal.model.warm_start import prepare_base_model
from tidal.protocol import Group, Sample
from tidal.roles import build_learner
from tidal.rundir import RunFiles
from tidal.trainer import checkpoint
from tidal.trainer.checkpoint import legacy_shard_name, optimizer_snapshot, resume_version, save_checkpoint
from tidal.weights import WeightStore


def group(rewards: list[float]) -> Group:
    samples = [Sample(np.array([7, 8, 9], dtype=np.int32), np.full(3, -1.0, dtype=np.float32), r) for r in rewards]
    return Group(0, 0, 0, "test", np.array([5, 6], dtype=np.int32), samples)


@pytest.fixture
def make_learner(tiny_config_dict):
    cfg = config_from_dict(copy.deepcopy(tiny_config_dict))
    base = prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed))
    return lambda: build_learner(cfg, str(base))[0], base


def step(learner, v: int, store: WeightStore, files: RunFiles) -> dict[str, torch.Tensor]:
    """One optimizer step, then the boundary as the trainer does it: publish v+1, then the checkpoint."""
    learner.train_on_groups([group([1.0, 0.0, 1.0, float(v % 2)])])
    learner.step()
    store.publish(v + 1, learner.model.state_dict())
    save_checkpoint(files, learner, v + 1)
    return optimizer_snapshot(learner)


def shards(files: RunFiles) -> list[str]:
    return sorted(p.name for p in files.checkpoint.glob("optimizer-*"))


def test_a_trainer_killed_between_its_shard_and_state_json_resumes_the_previous_boundary(tmp_path, make_learner, monkeypatch):
    build, base = make_learner
    files, store = RunFiles(tmp_path), WeightStore(tmp_path / "weights", base)
    learner = build()
    at_one = step(learner, 0, store, files)
    assert shards(files) == ["optimizer-v000001-rank0-of-1.safetensors"]

    class Killed(Exception):
        pass

    def killed(ctx):  # the first barrier separates the shard from state.json
        raise Killed

    monkeypatch.setattr(checkpoint, "barrier", killed)
    with pytest.raises(Killed):
        step(learner, 1, store, files)
    monkeypatch.undo()
    # the new shard is on disk, state.json still names version 1, and its shard is untouched
    assert shards(files) == ["optimizer-v000001-rank0-of-1.safetensors", "optimizer-v000002-rank0-of-1.safetensors"]

    fresh = build()
    assert resume_version(files, fresh, store) == 1
    resumed = optimizer_snapshot(fresh)
    assert resumed.keys() == at_one.keys()
    assert all(torch.equal(resumed[k], at_one[k]) for k in at_one)  # v1's moments, not v2's
    assert shards(files) == ["optimizer-v000001-rank0-of-1.safetensors"]  # the orphan is gone


def test_each_boundary_keeps_only_its_own_shard_and_a_legacy_shard_still_resumes(tmp_path, make_learner):
    build, base = make_learner
    files, store = RunFiles(tmp_path), WeightStore(tmp_path / "weights", base)
    learner = build()
    step(learner, 0, store, files)
    at_two = step(learner, 1, store, files)
    assert shards(files) == ["optimizer-v000002-rank0-of-1.safetensors"]

    # a checkpoint written before shards were versioned
    (files.checkpoint / "optimizer-v000002-rank0-of-1.safetensors").rename(files.checkpoint / legacy_shard_name(0, 1))
    fresh = build()
    assert resume_version(files, fresh, store) == 2
    assert all(torch.equal(optimizer_snapshot(fresh)[k], at_two[k]) for k in at_two)
    step(fresh, 2, store, files)
    assert shards(files) == ["optimizer-v000003-rank0-of-1.safetensors"]


def test_a_missing_shard_is_a_clear_error(tmp_path, make_learner):
    build, base = make_learner
    files, store = RunFiles(tmp_path), WeightStore(tmp_path / "weights", base)
    step(build(), 0, store, files)
    (files.checkpoint / "optimizer-v000001-rank0-of-1.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"resumes version 1, but this rank's optimizer shard optimizer-v000001-rank0-of-1.safetensors is missing"
    ):
        resume_version(files, build(), store)

"""The optimizer checkpoint moves from v to v+1 in one rename of its folder: a trainer
killed at any point of the write resumes the version whose folder is in place, with that version's
own optimizer state, and what the interrupted write left is removed. Checkpoints of the two older
layouts still resume. Real tiny model, real optimizer steps, real safetensors files."""

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tidal.config import config_from_dict
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.protocol import Group, Sample
from tidal.roles import build_learner
from tidal.rundir import RunDir, latest_checkpoint, shard_name, versioned_shard_name
from tidal.trainer import checkpoint
from tidal.trainer.checkpoint import optimizer_snapshot, resume_version, save_checkpoint
from tidal.weights import WeightStore


def group(rewards: list[float]) -> Group:
    samples = [Sample(np.array([7, 8, 9], dtype=np.int32), np.full(3, -1.0, dtype=np.float32), r) for r in rewards]
    return Group(0, 0, 0, "test", np.array([5, 6], dtype=np.int32), samples)


@pytest.fixture
def make_learner(tiny_config_dict):
    cfg = config_from_dict(copy.deepcopy(tiny_config_dict))
    base = prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed))
    return lambda: build_learner(cfg, str(base))[0], base


def step(learner, v: int, store: WeightStore, files: RunDir) -> dict[str, torch.Tensor]:
    """One optimizer step, then the boundary as the trainer does it: publish v+1, then the checkpoint."""
    learner.train_on_groups([group([1.0, 0.0, 1.0, float(v % 2)])])
    learner.step()
    store.publish(v + 1, learner.model.state_dict())
    save_checkpoint(files, learner, v + 1)
    return optimizer_snapshot(learner)


def listing(files: RunDir) -> list[str]:
    """checkpoint/ and one level below, e.g. 'v000001/state.json'."""
    root = files.checkpoint
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Killed(Exception):
    pass


def killed(*args, **kwargs):
    raise Killed


# (the step that does not happen, what the kill leaves in checkpoint/, the version a restart resumes)
CRASH_POINTS = [
    ("write_state", ["v000001/optimizer-rank0-of-1.safetensors", "v000001/state.json", ".tmp-v000002/optimizer-rank0-of-1.safetensors"], 1),
    (
        "move_into_place",
        [
            "v000001/optimizer-rank0-of-1.safetensors",
            "v000001/state.json",
            ".tmp-v000002/optimizer-rank0-of-1.safetensors",
            ".tmp-v000002/state.json",
        ],
        1,
    ),
    (
        "remove_stale",
        ["v000001/optimizer-rank0-of-1.safetensors", "v000001/state.json", "v000002/optimizer-rank0-of-1.safetensors", "v000002/state.json"],
        2,
    ),
]


@pytest.mark.parametrize("skipped, left, resumes", CRASH_POINTS, ids=["after-shards", "after-state-in-temp", "after-rename"])
def test_a_trainer_killed_at_each_point_of_the_write_resumes_that_version_with_its_own_optimizer_state(
    tmp_path, make_learner, monkeypatch, skipped, left, resumes
):
    build, base = make_learner
    files, store = RunDir(tmp_path), WeightStore(tmp_path / "weights", base)
    learner = build()
    at = {1: step(learner, 0, store, files)}
    assert listing(files) == ["v000001/optimizer-rank0-of-1.safetensors", "v000001/state.json"]

    monkeypatch.setattr(checkpoint, skipped, killed)
    with pytest.raises(Killed):
        at[2] = step(learner, 1, store, files)
    at[2] = optimizer_snapshot(learner)  # what the killed write was saving
    monkeypatch.undo()
    assert not same(at[1], at[2])
    assert listing(files) == sorted(left)

    fresh = build()
    assert resume_version(files, fresh, store) == resumes
    assert same(optimizer_snapshot(fresh), at[resumes])
    assert listing(files) == [f"v{resumes:06d}/optimizer-rank0-of-1.safetensors", f"v{resumes:06d}/state.json"]  # the rest is gone


def test_each_boundary_keeps_only_its_own_checkpoint_folder(tmp_path, make_learner):
    build, base = make_learner
    files, store = RunDir(tmp_path), WeightStore(tmp_path / "weights", base)
    learner = build()
    step(learner, 0, store, files)
    at_two = step(learner, 1, store, files)
    assert listing(files) == ["v000002/optimizer-rank0-of-1.safetensors", "v000002/state.json"]
    assert latest_checkpoint(files.checkpoint).next_version == 2
    fresh = build()
    assert resume_version(files, fresh, store) == 2
    assert same(optimizer_snapshot(fresh), at_two)


@pytest.mark.parametrize(
    "older_name", [lambda v: versioned_shard_name(0, 1, v), lambda v: shard_name(0, 1)], ids=["versioned-shards", "legacy-shards"]
)
def test_a_checkpoint_of_an_older_layout_resumes_and_the_next_boundary_replaces_it(tmp_path, make_learner, older_name):
    """Before checkpoint folders: state.json directly in checkpoint/, beside shards named by version
    (optimizer-v000002-rank0-of-1) or, before that, not (optimizer-rank0-of-1)."""
    build, base = make_learner
    files, store = RunDir(tmp_path), WeightStore(tmp_path / "weights", base)
    learner = build()
    at_one = step(learner, 0, store, files)
    at_two = step(learner, 1, store, files)
    folder = files.checkpoint / "v000002"
    (folder / "optimizer-rank0-of-1.safetensors").rename(files.checkpoint / older_name(2))
    (folder / "state.json").rename(files.checkpoint / "state.json")
    folder.rmdir()
    older_shard = files.checkpoint / versioned_shard_name(0, 1, 1)  # a superseded shard of the versioned layout
    save_file(at_one, str(older_shard))

    fresh = build()
    assert resume_version(files, fresh, store) == 2
    assert same(optimizer_snapshot(fresh), at_two)
    assert listing(files) == sorted(["state.json", older_name(2)])  # the superseded shard went, the resumed one stays
    step(fresh, 2, store, files)
    assert listing(files) == ["v000003/optimizer-rank0-of-1.safetensors", "v000003/state.json"]


def test_a_missing_shard_is_a_clear_error(tmp_path, make_learner):
    build, base = make_learner
    files, store = RunDir(tmp_path), WeightStore(tmp_path / "weights", base)
    step(build(), 0, store, files)
    (files.checkpoint / "v000001" / "optimizer-rank0-of-1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"resumes version 1, but this rank's optimizer shard optimizer-rank0-of-1.safetensors is missing"):
        resume_version(files, build(), store)

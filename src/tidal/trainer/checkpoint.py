"""Optimizer state at an iteration boundary, as safetensors + JSON (no pickle), and resuming from it."""

from __future__ import annotations

import json
import logging

from safetensors.torch import load_file, save_file

from tidal.rundir import RunFiles
from tidal.trainer.learner import Learner
from tidal.weights import WeightStore

log = logging.getLogger(__name__)


def save_checkpoint(files: RunFiles, learner: Learner, next_version: int) -> None:
    files.checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = files.checkpoint / "optimizer.safetensors.tmp"
    save_file(learner.optimizer_tensors(), str(tmp))
    tmp.replace(files.checkpoint / "optimizer.safetensors")
    (files.checkpoint / "state.json").write_text(json.dumps({"next_version": next_version}))


def resume_version(files: RunFiles, learner: Learner, store: WeightStore) -> int:
    """The version to start from: 0 on a fresh run, else the last completed boundary."""
    state_file = files.checkpoint / "state.json"
    if not state_file.is_file():
        return 0
    version = json.loads(state_file.read_text())["next_version"]
    learner.load_weights(store.load(version))
    learner.load_optimizer_tensors(load_file(str(files.checkpoint / "optimizer.safetensors")))
    log.info("resumed from checkpoint: version %d", version)
    return version

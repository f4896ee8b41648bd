"""Optimizer state at an iteration boundary, as safetensors + JSON (no pickle), and resuming from it.

Each rank writes its own shard (`optimizer-rank{r}-of-{n}.safetensors`): under fsdp2 that is its
slice of the AdamW moments, so a large run never gathers optimizer state on one host. Rank 0 writes
`state.json` last, after every shard is on disk, so a checkpoint is either complete or not there.
A checkpoint resumes on the same number of ranks; another world size is refused with a clear error.
"""

from __future__ import annotations

import json
import logging
import os

from safetensors.torch import load_file, save_file

from tidal.rundir import RunFiles
from tidal.trainer.distributed import DistContext, barrier
from tidal.trainer.learner import Learner
from tidal.weights import WeightStore

log = logging.getLogger(__name__)


def shard_name(rank: int, world_size: int) -> str:
    return f"optimizer-rank{rank}-of-{world_size}.safetensors"


def save_checkpoint(files: RunFiles, learner: Learner, next_version: int) -> None:
    """Every rank calls it (a barrier separates the shards from state.json)."""
    write_checkpoint(files, learner.optimizer_tensors(), next_version, learner.ctx)


def optimizer_snapshot(learner: Learner) -> dict:
    """This rank's optimizer tensors, copied: the next step may change the originals while a
    background writer saves these."""
    return {k: v.detach().clone() for k, v in learner.optimizer_tensors().items()}


def write_checkpoint(files: RunFiles, tensors: dict, next_version: int, ctx: DistContext) -> None:
    files.checkpoint.mkdir(parents=True, exist_ok=True)
    final = files.checkpoint / shard_name(ctx.rank, ctx.world_size)
    tmp = final.with_name(final.name + ".tmp")
    save_file(tensors, str(tmp))
    fsync_file(tmp)
    tmp.replace(final)
    barrier(ctx)
    if ctx.is_main:
        state = files.checkpoint / "state.json"
        tmp = state.with_name("state.json.tmp")
        tmp.write_text(json.dumps({"next_version": next_version, "world_size": ctx.world_size}))
        fsync_file(tmp)
        tmp.replace(state)
    barrier(ctx)


def fsync_file(path) -> None:
    """On disk before the rename that makes it the checkpoint: acks follow the checkpoint (nothing acked before it is durable)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def resume_version(files: RunFiles, learner: Learner, store: WeightStore, ctx: DistContext | None = None) -> int:
    """The version to start from: 0 on a fresh run, else the last completed boundary."""
    ctx = ctx or learner.ctx
    state_file = files.checkpoint / "state.json"
    if not state_file.is_file():
        return 0
    state = json.loads(state_file.read_text())
    saved_world = state.get("world_size", 1)
    if saved_world != ctx.world_size:
        raise ValueError(
            f"the checkpoint in {files.checkpoint} was written by {saved_world} trainer rank(s) and this trainer has "
            f"{ctx.world_size}: resume with trainer.ranks={saved_world} (the optimizer shards do not reshard)"
        )
    version = state["next_version"]
    learner.load_weights(store.load(version))
    learner.load_optimizer_tensors(load_file(str(files.checkpoint / shard_name(ctx.rank, ctx.world_size))))
    log.info("resumed from checkpoint: version %d", version)
    return version

"""Optimizer state at an iteration boundary, as safetensors + JSON (no pickle), and resuming from it.

Each rank writes its own shard (`optimizer-v{version}-rank{r}-of-{n}.safetensors`): under fsdp2
that is its slice of the AdamW moments, so a large run never gathers optimizer state on one host.
Shards are named by the version they resume, so writing one never replaces the shard the current
`state.json` points at: rank 0 renaming `state.json` (after every shard is on disk) is the one step
that moves the checkpoint from v to v+1, and a trainer killed at any point before it resumes v with
v's own optimizer state. The published weights v+1 are already in the store by then (published
first), so the version state.json names always exists. Older shards are removed afterwards.
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
from tidal.weights import CorruptSnapshotError, WeightStore

log = logging.getLogger(__name__)


def shard_name(rank: int, world_size: int, version: int) -> str:
    return f"optimizer-v{version:06d}-rank{rank}-of-{world_size}.safetensors"


def legacy_shard_name(rank: int, world_size: int) -> str:
    """What checkpoints written before shards were versioned call theirs; still resumed."""
    return f"optimizer-rank{rank}-of-{world_size}.safetensors"


def remove_other_shards(files: RunFiles, ctx: DistContext, keep: int) -> list[str]:
    """This rank's shards of versions other than `keep`: superseded ones, or what a trainer killed
    between its shard and state.json left. Each rank removes only its own."""
    suffix = f"-rank{ctx.rank}-of-{ctx.world_size}.safetensors"
    keep_name = shard_name(ctx.rank, ctx.world_size, keep)
    stale = [p for p in files.checkpoint.glob(f"optimizer-*{suffix}") if p.name != keep_name]
    stale += [p for p in [files.checkpoint / legacy_shard_name(ctx.rank, ctx.world_size)] if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def save_checkpoint(files: RunFiles, learner: Learner, next_version: int) -> None:
    """Every rank calls it (a barrier separates the shards from state.json)."""
    write_checkpoint(files, learner.optimizer_tensors(), next_version, learner.ctx)


def optimizer_snapshot(learner: Learner) -> dict:
    """This rank's optimizer tensors, copied: the next step may change the originals while a
    background writer saves these."""
    return {k: v.detach().clone() for k, v in learner.optimizer_tensors().items()}


def write_checkpoint(files: RunFiles, tensors: dict, next_version: int, ctx: DistContext) -> None:
    files.checkpoint.mkdir(parents=True, exist_ok=True)
    final = files.checkpoint / shard_name(ctx.rank, ctx.world_size, next_version)
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
    remove_other_shards(files, ctx, keep=next_version)


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
    try:
        learner.load_weights(store.load(version))
    except CorruptSnapshotError as err:
        raise CorruptSnapshotError(
            f"cannot resume: {state_file} resumes weights v{version}, which do not verify ({err}). "
            "Restore that snapshot from a backup, or start again in a new run directory"
        ) from None
    shard = files.checkpoint / shard_name(ctx.rank, ctx.world_size, version)
    legacy = files.checkpoint / legacy_shard_name(ctx.rank, ctx.world_size)
    if not shard.is_file() and not legacy.is_file():
        raise FileNotFoundError(f"{state_file} resumes version {version}, but this rank's optimizer shard {shard.name} is missing")
    learner.load_optimizer_tensors(load_file(str(shard if shard.is_file() else legacy)))
    removed = remove_other_shards(files, ctx, keep=version) if shard.is_file() else []  # a legacy shard goes at the next write
    if removed:
        log.info("removed optimizer shard(s) of versions the checkpoint does not resume: %s", ", ".join(removed))
    log.info("resumed from checkpoint: version %d", version)
    return version

"""Optimizer state at an iteration boundary, as safetensors + JSON (no pickle), and resuming from it.

One folder per checkpoint, committed by one rename, so it is there whole or not at all. Every rank writes its shard
(`optimizer-rank{r}-of-{n}.safetensors`; under fsdp2 its slice of the AdamW moments, so a large run
never gathers optimizer state on one host) into `checkpoint/.tmp-v{N}/` and fsyncs it; after a
barrier rank 0 writes state.json there, fsyncs it and the folder, renames the folder to
`checkpoint/v{N}/` and fsyncs `checkpoint/`. That rename is the one step that moves the checkpoint
from v to v+1: a trainer killed at any point before it resumes v with v's own optimizer state. The
published weights v+1 are already in the store by then (published first), so the version a
checkpoint names always exists. Superseded checkpoints and interrupted writes are removed after the
commit and on start. Checkpoints of the two older layouts (state.json directly in checkpoint/) still
resume. A checkpoint resumes on the same number of ranks; another world size is refused clearly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tidal.rundir import (
    CHECKPOINT_STATE,
    CHECKPOINT_TEMP_PREFIX,
    Checkpoint,
    RunDir,
    checkpoint_folder_name,
    latest_checkpoint,
    shard_name,
    stale_checkpoint_entries,
)
from tidal.trainer.distributed import DistContext, barrier
from tidal.trainer.learner import Learner
from tidal.weights import CorruptSnapshotError, WeightStore

log = logging.getLogger(__name__)


def save_checkpoint(files: RunDir, learner: Learner, next_version: int) -> None:
    """Every rank calls it (barriers separate the shards from the commit and the commit from the clean-up)."""
    write_checkpoint(files, learner.optimizer_tensors(), next_version, learner.ctx)


def optimizer_snapshot(learner: Learner) -> dict:
    """This rank's optimizer tensors, copied: the next step may change the originals while a
    background writer saves these."""
    return {k: v.detach().clone() for k, v in learner.optimizer_tensors().items()}


def write_checkpoint(files: RunDir, tensors: dict, next_version: int, ctx: DistContext) -> None:
    root = files.checkpoint
    temp = root / f"{CHECKPOINT_TEMP_PREFIX}{next_version:06d}"
    write_shard(temp, tensors, ctx)
    barrier(ctx)
    if ctx.is_main:
        write_state(temp, {"next_version": next_version, "world_size": ctx.world_size})
        move_into_place(temp, root / checkpoint_folder_name(next_version))
    barrier(ctx)
    # rank 0 alone, after the barrier: no rank writes in checkpoint/ again before the next
    # iteration's collectives, which wait for rank 0
    if ctx.is_main:
        remove_stale(root, Checkpoint(root / checkpoint_folder_name(next_version), next_version, ctx.world_size))


def write_shard(temp: Path, tensors: dict, ctx: DistContext) -> None:
    temp.mkdir(parents=True, exist_ok=True)
    shard = temp / shard_name(ctx.rank, ctx.world_size)
    save_file(tensors, str(shard))
    fsync_path(shard)


def write_state(temp: Path, state: dict) -> None:
    path = temp / CHECKPOINT_STATE
    path.write_text(json.dumps(state))
    fsync_path(path)
    fsync_path(temp)  # the folder's entries: every shard and state.json


def move_into_place(temp: Path, final: Path) -> None:
    """The commit point."""
    temp.rename(final)
    fsync_path(final.parent)


def fsync_path(path: Path) -> None:
    """On disk before the checkpoint names it (a file) or before the rename counts (a folder): acks
    follow the checkpoint, so nothing is acknowledged before it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(root: Path, keep: Checkpoint | None) -> list[str]:
    stale = stale_checkpoint_entries(root, keep)
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return [p.name for p in stale]


def resume_version(files: RunDir, learner: Learner, store: WeightStore, ctx: DistContext | None = None) -> int:
    """The version to start from: 0 on a fresh run, else the last committed boundary. Every rank calls it."""
    ctx = ctx or learner.ctx
    found = latest_checkpoint(files.checkpoint)
    version = 0 if found is None else load_checkpoint(found, learner, store, ctx)
    barrier(ctx)  # every rank has read its shard
    if ctx.is_main:
        removed = remove_stale(files.checkpoint, found)
        if removed:
            log.info("removed superseded or interrupted checkpoint files: %s", ", ".join(removed))
    barrier(ctx)
    if found is not None:
        log.info("resumed from checkpoint: version %d", version)
    return version


def load_checkpoint(found: Checkpoint, learner: Learner, store: WeightStore, ctx: DistContext) -> int:
    if found.world_size != ctx.world_size:
        raise ValueError(
            f"the checkpoint in {found.folder} was written by {found.world_size} trainer rank(s) and this trainer has "
            f"{ctx.world_size}: resume with trainer.ranks={found.world_size} (the optimizer shards do not reshard)"
        )
    version = found.next_version
    try:
        learner.load_weights(store.load(version))
    except CorruptSnapshotError as err:
        raise CorruptSnapshotError(
            f"cannot resume: {found.state_file} resumes weights v{version}, which do not verify ({err}). "
            "Restore that snapshot from a backup, or start again in a new run directory"
        ) from None
    shard = found.shard(ctx.rank)
    if not shard.is_file():
        raise FileNotFoundError(f"{found.state_file} resumes version {version}, but this rank's optimizer shard {shard.name} is missing")
    learner.load_optimizer_tensors(load_file(str(shard)))
    return version

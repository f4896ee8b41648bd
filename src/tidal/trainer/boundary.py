"""What the trainer writes at an iteration boundary, and what it removes on start so that every
group and iteration is recorded once: the published weights, groups.jsonl, the optimizer checkpoint
and snapshot retention."""

from __future__ import annotations

import logging

from tidal.config import TidalConfig
from tidal.rundir import RunDir
from tidal.trainer.checkpoint import write_checkpoint
from tidal.trainer.iteration_plan import max_staleness
from tidal.trainer.learner import Learner
from tidal.weights import WeightStore, versions_in_use

log = logging.getLogger(__name__)


def publish_weights(store: WeightStore, version: int, learner: Learner) -> None:
    """Every rank gathers (a collective under fsdp2) and computes the probe's log-probs; rank 0 writes the snapshot."""
    state = learner.full_state_dict()
    probe = learner.probe_logprobs(store.probe) if store.probe else None
    if learner.ctx.is_main:
        store.publish(version, state, probe_logprobs=probe)


def forget_unfinished(files: RunDir, store: WeightStore, start: int) -> None:
    """On start, before anything is written: what a trainer killed mid-iteration left is removed
    (temp folders of an interrupted publish, groups.jsonl and metrics.jsonl records of iterations
    from `start` on, which are trained again; resume_version removed an interrupted checkpoint), so
    every group and iteration is recorded once. metrics.jsonl is appended before the background
    writer has made the boundary durable, so a trainer stopped in between leaves a line for an
    iteration it will redo."""
    removed = store.remove_temp()
    if removed:
        log.info("removed what an interrupted publish left: %s", ", ".join(removed))
    for records in (files.groups, files.metrics):
        dropped = records.drop(lambda r: r["iteration"] >= start)
        if dropped:
            log.info("dropped %d %s record(s) of iterations from %d on (trained again now)", dropped, records.path.name, start)


def prune_snapshots(cfg: TidalConfig, store: WeightStore, published: int, checkpoint: int) -> list[int]:
    """Weight retention (cfg.weights) after ``published`` is out and the checkpoint resumes from ``checkpoint``.
    Kept whatever the policy: what a worker may still load, what a resume needs, and the version an
    eval.every follower evaluates next."""
    protected = versions_in_use(published, max_staleness(cfg)) | {checkpoint}
    if cfg.eval.enabled and cfg.eval.every:
        protected.add(published - published % cfg.eval.every)
    return store.prune(cfg.weights.keep_last, cfg.weights.keep_every, protected)


def boundary_write(cfg: TidalConfig, files: RunDir, store: WeightStore, ctx, records: list[dict], tensors: dict, next_version: int):
    """What makes iteration next_version - 1 durable, in order: its groups.jsonl records (before the
    checkpoint: a trainer that dies in between redoes the iteration and forget_unfinished drops them),
    the optimizer checkpoint, then snapshot retention (which protects that checkpoint's version)."""

    def write() -> None:
        if ctx.is_main:
            files.groups.append_many(records)
        write_checkpoint(files, tensors, next_version, ctx)
        if ctx.is_main:
            prune_snapshots(cfg, store, next_version, next_version)

    return write

"""The one iteration loop, for every mode: `train(cfg, learner, source, ...)`.

Per iteration v: make weights v available, ask for v's prompts (bounded mode: also release the
work of v+1..v+k), take groups as they complete, check their staleness, replace groups without
signal (DAPO dynamic sampling), accumulate gradients, and after the last group step once, publish
v+1, checkpoint, release the groups and report. The modes differ only in the source (in-process
generation for sync, the queue for periodic and bounded) and in how much staleness is allowed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time

import torch

from tidal.config import TidalConfig
from tidal.data import Dataset
from tidal.protocol import Group
from tidal.rundir import RunFiles
from tidal.runtime import tail_threads
from tidal.trainer.boundary import boundary_write, forget_unfinished, prune_snapshots, publish_weights
from tidal.trainer.checkpoint import optimizer_snapshot, resume_version
from tidal.trainer.compute import on_compute_thread
from tidal.trainer.iteration_plan import Admission, IterationPlan, StalenessError, WorkRelease, max_staleness, reissue_rejected
from tidal.trainer.learner import Learner, merge_updates
from tidal.trainer.metrics import Timer, group_record, iteration_metrics
from tidal.trainer.sources import GroupSource
from tidal.trainer.writer import BoundaryWriter
from tidal.weights import WeightStore

# the names the rest of Tidal and its tests take from here
__all__ = ["train", "IterationPlan", "IterationUpdates", "StalenessError", "TailThreads", "forget_unfinished", "prune_snapshots"]

log = logging.getLogger(__name__)


class IterationUpdates:
    """Feeds one iteration's groups to the learner; with `updates_per_iteration` = k it steps after
    every ceil(P/k) groups (PPO-style mini-batches against the old policy), else once at the end."""

    def __init__(self, learner: Learner, cfg: TidalConfig, version: int):
        self.learner = learner
        self.steps = cfg.trainer.updates_per_iteration
        self.per_update = math.ceil(cfg.trainer.prompts_per_iteration / self.steps)
        self.pending = 0
        self.updates: list[dict] = []
        learner.begin_iteration(version)

    def add(self, groups: list[Group]) -> None:
        if self.steps == 1:
            self.learner.train_on_groups(groups)
            return
        for g in groups:
            self.learner.train_on_groups([g])
            self.pending += 1
            if self.pending >= self.per_update and len(self.updates) < self.steps - 1:
                self.updates.append(self.learner.step())
                self.pending = 0

    def finish(self) -> dict:
        self.updates.append(self.learner.step())
        return merge_updates(self.updates)


class TailThreads:
    """trainer.tail_threads: more intra-op threads from the moment an iteration's last group is in
    until its weights are published (periodic workers are idle then), back to `base` after."""

    def __init__(self, base: int, tail: int | None):
        self.base, self.tail, self.wide = base, tail, False

    async def widen(self) -> None:
        if self.tail and not self.wide:
            await on_compute_thread(torch.set_num_threads, self.tail)
            self.wide = True

    async def narrow(self) -> None:
        if self.wide:
            await on_compute_thread(torch.set_num_threads, self.base)
            self.wide = False


async def train_arrivals(updates: IterationUpdates, groups: list[Group], version: int, timer: Timer, records: list[dict]) -> None:
    """One training call on `groups`: its seconds go to timer["train"], each group's record to `records`."""
    started = time.time()
    with timer("train"):
        await on_compute_thread(updates.add, groups)
    records.extend(group_record(g, version, started, time.time()) for g in groups)


async def train(
    cfg: TidalConfig,
    learner: Learner,
    source: GroupSource,
    dataset: Dataset,
    store: WeightStore,
    files: RunFiles,
    tracker,
    iterations: int | None = None,
) -> list[dict]:
    """Runs iterations from the last checkpoint to `trainer.iterations` (or `iterations` more: a
    pipeline round) and returns their metrics.

    Under several ranks every rank runs this loop on the same groups (the source broadcasts them)
    and trains its share; only rank 0 writes the weight store, the run's records and MLflow."""
    main = learner.ctx.is_main
    start = resume_version(files, learner, store)
    if main:
        forget_unfinished(files, store, start)
    end = cfg.trainer.iterations if iterations is None else min(cfg.trainer.iterations, start + iterations)
    if store.latest_version() is None or store.latest_version() < start:
        publish_weights(store, start, learner)
    # Everything built so far (the model, transformers, MLflow, NATS) lives for the whole run: out of the
    # cyclic collector's scans, whose full (generation 2) passes over it took 0.26-0.36 s each, mid-iteration
    gc.freeze()
    allowed = max_staleness(cfg)
    threads = TailThreads(torch.get_num_threads(), tail_threads(cfg, torch.get_num_threads()))
    release = WorkRelease(cfg, dataset, end)
    writer = BoundaryWriter(background=learner.ctx.world_size == 1)
    history: list[dict] = []
    rejected_total = 0

    async def open_iteration(u: int) -> tuple[Timer, bool, IterationPlan]:
        """Weights u made available and u's prompts asked for: the workers start on u from here.
        Returns u's timer (started now), whether the weights were pushed, and u's plan."""
        timer = Timer()
        sync_seconds, pushed = await source.begin_iteration(u)
        timer.add("sync", sync_seconds)
        plan, first = IterationPlan.for_iteration(cfg, dataset, u)
        plan = release.plans.pop(u, plan)  # released ahead: it may have asked for prompts again already
        if release.released < u:  # bounded mode may have released it during an earlier iteration
            await source.request(first)
            release.mark(u)
        await source.request(release.ahead(u))
        return timer, pushed, plan

    opened = None  # the next iteration, once opened at the end of the one before
    for v in range(start, end):
        timer, pushed, plan = opened or await open_iteration(v)
        opened = None
        queue_depth = float(await source.queue_depth())
        updates = IterationUpdates(learner, cfg, v)
        records: list[dict] = []  # groups.jsonl, written with the iteration's boundary
        rejected = 0
        waited_since = time.time()
        # One receive and one training call may be in flight at once (one rank, groups from a queue): the
        # groups that arrive while the learner trains are taken then, and go into its next call at once.
        overlap = learner.ctx.world_size == 1 and source.receives_while_training
        receiving: asyncio.Task | None = None
        training: asyncio.Task | None = None
        batch: list[Group] = []  # admitted, not yet handed to the learner
        trained = 0

        try:
            while not plan.complete or batch or training is not None:
                if training is None and batch:
                    if plan.complete:  # every group is in: periodic workers now wait for v+1, their cores are free
                        await threads.widen()
                    training = asyncio.ensure_future(train_arrivals(updates, batch, v, timer, records))
                    trained += len(batch)
                    batch = []
                    if not overlap:
                        await training
                if training is not None and training.done():
                    training.result()
                    training = None
                    if main:
                        log.info("iteration %d: %d/%d groups trained", v, trained, len(plan.expected))
                    continue
                if receiving is None and not plan.complete:
                    receiving = asyncio.ensure_future(source.receive(v, plan.missing, timeout=1.0))
                waiting = time.perf_counter()
                await asyncio.wait([t for t in (receiving, training) if t is not None], return_when=asyncio.FIRST_COMPLETED)
                if training is None:
                    timer.add("idle", time.perf_counter() - waiting)
                if receiving is None or not receiving.done():
                    continue
                arrivals, receiving = receiving.result(), None
                timer.add("idle", -arrivals.generating_seconds)
                rejected += arrivals.rejected
                # before the wait below: a fetch may bring only rejected messages (or, in bounded mode, groups of later iterations)
                keys = arrivals.rejected_keys + arrivals.abandoned_keys
                reissues = reissue_rejected({**release.plans, v: plan}, keys, cfg.transport.max_deliver)
                if reissues:
                    log.warning(
                        "iteration %d: asking again for %d prompt(s) whose group was rejected or whose worker went silent (iteration, prompt): %s",
                        *(v, len(reissues), [(w.iteration, w.prompt_id) for w, _ in reissues]),
                    )
                    await source.reissue(reissues)
                if not arrivals.groups:
                    if time.time() - waited_since > cfg.trainer.group_timeout_seconds:
                        generators = await source.describe_generators()
                        raise TimeoutError(
                            f"iteration {v}: no group arrived for {cfg.trainer.group_timeout_seconds:.0f}s "
                            f"({len(plan.received)}/{len(plan.expected)} in): are the rollout workers alive? see logs/"
                            + (f". {generators}" if generators else "")
                        )
                    continue
                waited_since = time.time()
                replacements = []
                for group in arrivals.groups:
                    admission, replacement = plan.admit(group, allowed)
                    if admission is Admission.TRAIN:
                        batch.append(group)
                    elif admission is Admission.REPLACE:
                        replacements.append(replacement)
                await source.request(replacements)
        finally:
            if receiving is not None and not receiving.done():  # the iteration failed: stop pulling for it
                receiving.cancel()
        groups = list(plan.received.values())
        with timer("train"):
            update = await on_compute_thread(updates.finish)
        with timer("sync"):
            await on_compute_thread(publish_weights, store, v + 1, learner)
        await threads.narrow()  # the workers generate v+1 now
        if v + 1 < end:  # before the rest of v's boundary (its snapshot, records, logging), which overlaps v+1's start
            opened = await open_iteration(v + 1)
        with timer("sync"):
            tensors = await on_compute_thread(optimizer_snapshot, learner)
        await writer.make_durable(boundary_write(cfg, files, store, learner.ctx, records, tensors, v + 1), lambda v=v: source.commit(v))
        if not pushed:  # pushed: the workers' load time is the push, already counted
            timer.add("sync", max((g.weight_load_seconds for g in groups), default=0.0))
        rejected_total += rejected
        extra = {
            "queue_depth": queue_depth,
            "groups_discarded": float(plan.discarded),
            "groups_filtered": float(plan.filtered),
            "messages_rejected": float(rejected),
            "messages_rejected_total": float(rejected_total),
        }
        metrics = iteration_metrics(v, groups, update, timer, allowed, extra)
        metrics["reward_errors"] += plan.filtered_reward_errors  # dropped groups' reward errors still count
        if main:
            files.append("metrics.jsonl", metrics)
            if files.on_iteration:
                files.on_iteration(metrics)
            writer.log_metrics(tracker, metrics, v)
        history.append(metrics)
    await writer.drain()
    await source.finish(end)
    return history

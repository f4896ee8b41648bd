"""One iteration of the loop as an object: open it, collect its groups, close it, report it.

`Iteration.open(run, v)` makes weights v available and asks for v's prompts (bounded mode: also
releases the work of v+1..v+k); `collect()` takes groups as they complete, checks their staleness,
replaces groups without signal (DAPO dynamic sampling) and trains each admitted group as it arrives;
`close()` takes the iteration's (last) optimizer step, publishes v+1, opens v+1 and makes v
durable; `metrics()` is v's metrics line. `LoopContext` is what every iteration of one `train` call shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.config import TidalConfig
from tidal.data import Dataset
from tidal.protocol import Group
from tidal.rundir import RunDir
from tidal.threads import tail_threads
from tidal.trainer.boundary import boundary_write, publish_weights
from tidal.trainer.checkpoint import optimizer_snapshot
from tidal.trainer.compute import on_compute_thread
from tidal.trainer.iteration_plan import Admission, IterationPlan, WorkRelease, max_staleness, reissue_rejected
from tidal.trainer.learner import Learner, merge_updates
from tidal.trainer.metrics import Timer, group_record, iteration_metrics
from tidal.trainer.sources import Arrivals, GroupSource
from tidal.trainer.writer import BoundaryWriter
from tidal.weights import WeightStore

log = logging.getLogger(__name__)

# A receive returns empty-handed after this long, so that an iteration short of groups still asks again
# for rejected or abandoned work and notices trainer.group_timeout_seconds passing.
RECEIVE_TIMEOUT_SECONDS = 1.0


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


@dataclass
class LoopContext:
    """What every iteration of one `train` call shares. Under several ranks every rank has one, on the
    same groups; only rank 0 writes the run's records and MLflow."""

    cfg: TidalConfig
    learner: Learner
    source: GroupSource
    dataset: Dataset
    store: WeightStore
    run_dir: RunDir
    tracker: object | None
    end: int  # the iteration the run stops before
    threads: TailThreads
    release: WorkRelease
    writer: BoundaryWriter
    # one receive may run while the learner trains: one rank (a broadcast is a collective) and a source that allows it
    receives_while_training: bool
    rejected_total: int = 0  # messages rejected as malformed, over the iterations so far
    on_iteration: Callable[[dict], None] | None = None  # each iteration's metrics, e.g. to the launcher's progress bar

    @classmethod
    def start(
        cls,
        cfg: TidalConfig,
        learner: Learner,
        source: GroupSource,
        dataset: Dataset,
        store: WeightStore,
        run_dir: RunDir,
        tracker,
        end: int,
        on_iteration: Callable[[dict], None] | None = None,
    ) -> LoopContext:
        threads = TailThreads(torch.get_num_threads(), tail_threads(cfg.trainer.tail_threads, cfg.mode, cfg.trainer.ranks, torch.get_num_threads()))
        one_rank = learner.ctx.world_size == 1
        release, writer = WorkRelease(cfg, dataset, end), BoundaryWriter(background=one_rank)
        receives_while_training = one_rank and source.receives_while_training
        return cls(
            cfg, learner, source, dataset, store, run_dir, tracker, end, threads, release, writer, receives_while_training, on_iteration=on_iteration
        )

    @property
    def allowed_staleness(self) -> int:
        return max_staleness(self.cfg)

    def record(self, metrics: dict) -> dict:
        """An iteration's metrics into metrics.jsonl, the on_iteration callback and MLflow (rank 0); returns them."""
        if self.learner.ctx.is_main:
            self.run_dir.metrics.append(metrics)
            if self.on_iteration:
                self.on_iteration(metrics)
            self.writer.log_metrics(self.tracker, metrics, metrics["iteration"])
        return metrics


class PendingReceive:
    """An iteration's one receive in flight. It may run beside a training call and is taken once done;
    one still pending when the iteration ends means the iteration failed, and `cancel` stops it."""

    def __init__(self, source: GroupSource, version: int):
        self.source, self.version = source, version
        self.task: asyncio.Future | None = None

    def start(self, wanted: int) -> None:
        """A receive of up to `wanted` groups, unless one is in flight already."""
        if self.task is None:
            self.task = asyncio.ensure_future(self.source.receive(self.version, wanted, timeout=RECEIVE_TIMEOUT_SECONDS))

    def take(self) -> Arrivals | None:
        """What the finished receive brought (raising its error), or None while none has finished."""
        if self.task is None or not self.task.done():
            return None
        task, self.task = self.task, None
        return task.result()

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class Iteration:
    """Iteration `version` of a run, from the moment its weights are available to its metrics line."""

    def __init__(self, run: LoopContext, version: int, timer: Timer, pushed: bool, plan: IterationPlan):
        self.run, self.version, self.plan = run, version, plan
        self.timer = timer  # started when the iteration was opened
        self.pushed = pushed  # weights went to the workers directly: their load time is part of the push
        self.receiving = PendingReceive(run.source, version)
        self.updates: IterationUpdates | None = None  # from the start of `collect`
        self.records: list[dict] = []  # groups.jsonl, written with the iteration's boundary
        self.queue_depth = 0.0
        self.waited_since = 0.0  # when the last group arrived, or collecting began
        self.trained = 0  # groups handed to the learner
        self.rejected = 0  # messages rejected as malformed
        self.rejected_total = 0  # the run's, up to and including this iteration (set by `close`)
        self.update: dict = {}  # the optimizer step's figures (set by `close`)

    @classmethod
    async def open(cls, run: LoopContext, version: int) -> Iteration:
        """Weights `version` made available and its prompts asked for: the workers start on it from
        here, and so does its timer."""
        timer = Timer()
        sync_seconds, pushed = await run.source.begin_iteration(version)
        timer.add("sync", sync_seconds)
        plan, first = IterationPlan.for_iteration(run.cfg, run.dataset, version)
        plan = run.release.plans.pop(version, plan)  # released ahead: it may have asked for prompts again already
        if run.release.released < version:  # bounded mode may have released it during an earlier iteration
            await run.source.request(first)
            run.release.mark(version)
        await run.source.request(run.release.ahead(version))
        return cls(run, version, timer, pushed, plan)

    @property
    def groups(self) -> list[Group]:
        """The groups trained, one per expected prompt."""
        return list(self.plan.received.values())

    async def collect(self) -> None:
        """Takes groups until every expected prompt is answered, training the admitted ones as they
        arrive. When the run receives while training, the groups that arrive during a training call
        are received then and go into the next call together, which starts as soon as it ends;
        otherwise receiving and training take turns."""
        self.queue_depth = float(await self.run.source.queue_depth())
        self.updates = IterationUpdates(self.run.learner, self.run.cfg, self.version)
        self.waited_since = time.time()
        batch: list[Group] = []  # admitted, not yet handed to the learner
        training: asyncio.Future | None = None  # the training call in flight
        try:
            while not self.plan.complete or batch or training is not None:
                if training is None and batch:
                    training, batch = await self._start_training(batch), []
                if training is not None and training.done():
                    self._trained(training)
                    training = None
                    continue
                if not self.plan.complete:
                    self.receiving.start(self.plan.missing)
                await self._wait(training)
                arrivals = self.receiving.take()
                if arrivals is not None:
                    batch += await self._admit(arrivals)
        finally:
            self.receiving.cancel()  # still in flight only when the iteration failed: stop pulling for it

    async def close(self) -> Iteration | None:
        """The step, weights v+1 published, iteration v+1 opened, then the rest of v's boundary: its
        optimizer snapshot, and its records, checkpoint and acks (in the background at one rank).
        v+1 opens before the rest of v's boundary so that the workers generate it meanwhile.
        Returns v+1, or None after the run's last iteration."""
        run, v = self.run, self.version
        with self.timer("train"):
            self.update = await on_compute_thread(self.updates.finish)
        with self.timer("sync"):
            await on_compute_thread(publish_weights, run.store, v + 1, run.learner)
        await run.threads.narrow()  # the workers generate v+1 now
        following = await Iteration.open(run, v + 1) if v + 1 < run.end else None
        with self.timer("sync"):
            tensors = await on_compute_thread(optimizer_snapshot, run.learner)
        write = boundary_write(run.cfg, run.run_dir, run.store, run.learner.ctx, self.records, tensors, v + 1)
        await run.writer.make_durable(write, lambda: run.source.commit(v))
        if not self.pushed:  # pushed: the workers' load time is the push, already counted
            self.timer.add("sync", max((g.weight_load_seconds for g in self.groups), default=0.0))
        run.rejected_total += self.rejected
        self.rejected_total = run.rejected_total
        return following

    def metrics(self) -> dict:
        """The iteration's metrics line, once it is closed."""
        extra = {
            "queue_depth": self.queue_depth,
            "groups_discarded": float(self.plan.discarded),
            "groups_filtered": float(self.plan.filtered),
            "messages_rejected": float(self.rejected),
            "messages_rejected_total": float(self.rejected_total),
        }
        metrics = iteration_metrics(self.version, self.groups, self.update, self.timer, self.run.allowed_staleness, extra)
        metrics["reward_errors"] += self.plan.filtered_reward_errors  # dropped groups' reward errors still count
        if self.plan.failures:  # name -> [calls, failed, first error]: text, so metrics.jsonl only (not MLflow)
            metrics["failures"] = self.plan.failures
        return metrics

    async def _start_training(self, groups: list[Group]) -> asyncio.Future:
        """A training call on `groups`: left running beside the receives when the run overlaps them,
        else run to its end here."""
        if self.plan.complete:  # every group is in: periodic workers now wait for v+1, their cores are free
            await self.run.threads.widen()
        training = asyncio.ensure_future(self._train(groups))
        self.trained += len(groups)
        if not self.run.receives_while_training:
            await training
        return training

    async def _train(self, groups: list[Group]) -> None:
        """One training call: its seconds go to the "train" phase, each group's record to groups.jsonl's."""
        started = time.time()
        with self.timer("train"):
            await on_compute_thread(self.updates.add, groups)
        self.records.extend(group_record(g, self.version, started, time.time()) for g in groups)

    def _trained(self, training: asyncio.Future) -> None:
        training.result()  # the call's error, if it failed
        if self.run.learner.ctx.is_main:
            log.info("iteration %d: %d/%d groups trained", self.version, self.trained, len(self.plan.expected))

    async def _wait(self, training: asyncio.Future | None) -> None:
        """Until the receive or the training call ends. Waiting while nothing trains is the trainer's
        idle time, unless the receive is this process generating the groups (sync mode): that is work."""
        pending = [task for task in (self.receiving.task, training) if task is not None]
        idle = training is None and not self.run.source.generates_on_receive
        with self.timer("idle") if idle else contextlib.nullcontext():
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def _admit(self, arrivals: Arrivals) -> list[Group]:
        """The groups of one receive to train. On the way: rejected messages counted, rejected or
        abandoned work asked for again, replacements asked for groups without signal; no group for
        trainer.group_timeout_seconds fails the iteration."""
        self.rejected += arrivals.rejected
        # first, and also when no group came: a receive may bring only rejected messages (or, in bounded mode, groups of later iterations)
        await self._reissue(arrivals.rejected_keys + arrivals.abandoned_keys)
        if not arrivals.groups:
            await self._fail_when_starved()
            return []
        self.waited_since = time.time()
        admitted, replacements = [], []
        for group in arrivals.groups:
            admission, replacement = self.plan.admit(group, self.run.allowed_staleness)
            if admission is Admission.TRAIN:
                admitted.append(group)
            elif admission is Admission.REPLACE:
                replacements.append(replacement)
        await self.run.source.request(replacements)
        return admitted

    async def _reissue(self, keys: list[tuple[int, int]]) -> None:
        """Asks again for the work of rejected groups and of items a silent worker held (this iteration's,
        or bounded mode's released ahead)."""
        run = self.run
        reissues = reissue_rejected({**run.release.plans, self.version: self.plan}, keys, run.cfg.transport.max_deliver)
        if reissues:
            log.warning(
                "iteration %d: asking again for %d prompt(s) whose group was rejected or whose worker went silent (iteration, prompt): %s",
                *(self.version, len(reissues), [(w.iteration, w.prompt_id) for w, _ in reissues]),
            )
            await run.source.reissue(reissues)

    async def _fail_when_starved(self) -> None:
        """Raises TimeoutError once no group has arrived for trainer.group_timeout_seconds."""
        timeout = self.run.cfg.trainer.group_timeout_seconds
        if time.time() - self.waited_since > timeout:
            generators = await self.run.source.describe_generators()
            raise TimeoutError(
                f"iteration {self.version}: no group arrived for {timeout:.0f}s "
                f"({len(self.plan.received)}/{len(self.plan.expected)} in): are the rollout workers alive? see logs/"
                + (f". {generators}" if generators else "")
            )

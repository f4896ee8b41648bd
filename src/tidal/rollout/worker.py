"""The pull-at-a-time rollout worker (the HF engine's, and vLLM's with rollout.partial): pull work items,
generate G samples each, score, publish the group, ack.

It never waits for a whole batch: each engine call's groups go out at once, while the engine runs the
next call, and a work item is acknowledged only after its group is published, so a worker that dies
loses nothing. This module holds only its scheduling: a pull is as many items as one engine call
holds, of one iteration. What it holds is its lease (rollout.lease), how weights arrive is
rollout.arrival, and groups are made by rollout.generator.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tidal.config import TidalConfig
from tidal.protocol import Group
from tidal.rewards import RewardScorer
from tidal.rollout.arrival import version_to_generate
from tidal.rollout.core import WorkerCore
from tidal.rollout.engine import RolloutEngine
from tidal.rollout.generator import ByPrompt, response_tokens
from tidal.rollout.lease import Lease, decode_work, log_taken, raise_if_stop_requested
from tidal.rollout.partial import PolicyRefresh
from tidal.transport import Transport

log = logging.getLogger(__name__)

FETCH_LINGER_SECONDS = 0.02  # the trainer publishes an iteration's work items one after another


def pull_size(cfg: TidalConfig, prompt_tokens: int) -> int:
    """Work items a worker fetches at once: what one engine call holds at prompts of ``prompt_tokens``."""
    r = cfg.rollout
    if r.deterministic:
        return 1
    fits = max(1, r.generation_token_budget // (r.group_size * (prompt_tokens + response_tokens(cfg))))
    return min(fits, r.groups_per_batch) if r.groups_per_batch else fits


class RolloutWorker:
    def __init__(
        self,
        cfg: TidalConfig,
        engine: RolloutEngine,
        tokenizer,
        transport: Transport,
        worker_id: str,
        weights_root: Path | None = None,
        scorer: RewardScorer | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ):
        self.stop_requested = stop_requested  # SIGTERM came (roles.cancel_on_sigterm): stop pulling
        self.cfg, self.transport, self.worker_id = cfg, transport, worker_id
        core = WorkerCore.build(cfg, engine, tokenizer, transport, worker_id, weights_root, scorer)
        self.health, self.lease, self.arrival, self.generator = core.health, core.lease, core.arrival, core.generator
        self.prompt_tokens = 16  # until the first prompts are seen: the longest encoded prompt sizes later pulls
        # served rewards: one engine call's groups are scored while the engine runs the next (one thread: the
        # scorer's counts stay exact). In-process functions score in microseconds: they stay inline, where
        # the groups go out soonest (tests/test_end_to_end.py's overlap check saw the thread hop delay them)
        self.scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring") if self.generator.scorer.served is not None else None

    @property
    def version(self) -> int | None:
        return self.health.version

    @property
    def groups_published(self) -> int:
        return self.health.groups_published

    async def run(self) -> None:
        publisher = GroupPublisher(self.transport, self.lease)
        try:
            async with self.lease.kept():
                try:
                    await self._serve(publisher)
                finally:
                    publisher.discard()
        finally:
            if self.scoring is not None:
                self.scoring.shutdown(wait=False, cancel_futures=True)
            self.generator.close()

    async def _serve(self, publisher: GroupPublisher) -> None:
        sub = await self.transport.work_subscription()
        idle_since = time.time()
        while True:
            raise_if_stop_requested(self.stop_requested)
            if await self.transport.stopping():
                await publisher.drain()
                log.info("worker %s: the run or round is over, exiting", self.worker_id)
                return
            pulled = await decode_work(
                self.transport,
                await self.transport.fetch(
                    sub,
                    pull_size(self.cfg, self.prompt_tokens),
                    timeout=1.0,
                    linger=FETCH_LINGER_SECONDS,
                    linger_after_wait_only=True,
                ),
                self.worker_id,
                self.lease,
            )
            publisher.raise_if_failed()
            if not pulled:
                continue
            log_taken(self.worker_id, pulled)
            iteration = pulled[0][1].iteration
            for m, it in pulled:
                if it.iteration != iteration:
                    await self.lease.nak(m)  # another iteration: handle it on a later pull
            pulled = [(m, it) for m, it in pulled if it.iteration == iteration]
            version = await version_to_generate(self.transport, self.cfg.mode, pulled[0][1])
            if version is None:
                log.info("worker %s: dropping %d obsolete work item(s) of iteration %d", self.worker_id, len(pulled), iteration)
                for m, _ in pulled:
                    await self.lease.ack(m)
                continue
            msgs, items = [m for m, _ in pulled], [it for _, it in pulled]
            new_version = self.version != version
            load_seconds = await self.arrival.load(version) if new_version else 0.0
            if load_seconds is None:
                await self.lease.back_off(msgs, self.arrival.backoff)
                continue
            idle = time.time() - idle_since - load_seconds
            # the first pull of an iteration starts with a small call: the trainer waits on its first groups
            first = self.cfg.rollout.first_call_groups if new_version else None
            answering = ByPrompt((item, msg) for msg, item in pulled)  # each group's work message
            # rollout.partial: newer weights published meanwhile are loaded between decode steps
            refresh = PolicyRefresh.started(self.transport, self.arrival, iteration, self.version) if self.cfg.rollout.partial else None
            try:
                # each call's groups are scored, then published (and their items acked), while the engine runs the next call
                async for pending in self.generator.calls(items, self.version, first_call_groups=first, scoring=self.scoring, refresh=refresh):
                    publisher.raise_if_failed()
                    publisher.submit(self._scored(pending, answering, load_seconds, idle))
                    raise_if_stop_requested(self.stop_requested)  # the rest of the items go back, not into another engine call
            finally:
                if refresh is not None:
                    await refresh.close()
            idle_since = time.time()

    async def _scored(self, pending, answering: ByPrompt, load_seconds: float, idle: float) -> list[tuple[Group, object]]:
        """Groups of the pull (or a Future of them, being scored), each paired with its work item's message.
        The pull's first group carries the weight load and the idle time before it."""
        groups = await asyncio.wrap_future(pending) if isinstance(pending, Future) else pending
        self.prompt_tokens = max([self.prompt_tokens, *(len(g.prompt_ids) for g in groups)])
        pairs = []
        for g in groups:
            first = answering.taken == 0
            pairs.append((g, answering.take(g)))
            g.weight_load_seconds = load_seconds if first else 0.0
            g.worker_idle_seconds = idle if first else 0.0
        return pairs


class GroupPublisher:
    """Publishes finished groups and then acks their work items, in order, on the event loop, so the
    engine's next call does not wait for them. An item is acked only after its group is published
    (a worker that dies in between loses nothing: the item is redelivered); a failed publish fails
    the worker at its next check (`raise_if_failed`) or `drain`."""

    def __init__(self, transport: Transport, lease: Lease):
        self.transport, self.lease = transport, lease
        self.task: asyncio.Task | None = None

    def submit(self, pairs) -> None:
        """`pairs`: (group, message) pairs, or an awaitable of them (groups still being scored)."""
        self.task = asyncio.create_task(self._publish(self.task, pairs))

    async def _publish(self, before: asyncio.Task | None, pairs) -> None:
        if before is not None:
            await before
        if inspect.isawaitable(pairs):
            pairs = await pairs
        # all in flight at once: one round trip for the call's groups; every outcome is collected, the first failure raised
        outcomes = await asyncio.gather(*(self.transport.publish_group(group, answering=msg) for group, msg in pairs), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
        for _, msg in pairs:
            await self.lease.ack(msg)
            self.lease.health.groups_published += 1

    def raise_if_failed(self) -> None:
        if self.task is not None and self.task.done():
            self.task.result()

    async def drain(self) -> None:
        if self.task is not None:
            await self.task

    def discard(self) -> None:
        """The worker is failing for another reason: what is still being published is abandoned (its
        items were not acked, so they are redelivered) and a failure it had is logged, not lost."""
        if self.task is None:
            return
        if not self.task.done():
            self.task.cancel()
        elif not self.task.cancelled() and self.task.exception() is not None:
            log.error("publishing a group failed: %s", self.task.exception())

"""Where the trainer's groups come from. One interface, two sources:

- `QueueSource` (periodic and bounded modes): work items go to the WORK stream, groups come back
  from the ROLLOUTS stream in completion order, decoded and validated; a group is acked only after
  the step and checkpoint of the iteration it was trained in.
- `InProcessSource` (sync mode): generates the requested items in this process, all cores to it;
  the generate function is injected by the launcher, so the trainer never imports the rollout package.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tidal.protocol import Group, GroupLimits, ProtocolError, WorkItem, decode_group, pack, unpack
from tidal.trainer.compute import on_compute_thread
from tidal.trainer.distributed import DistContext, broadcast_bytes
from tidal.transport import Transport, keep_in_progress

log = logging.getLogger(__name__)


@dataclass
class Arrivals:
    """What one `receive` brought: valid groups, plus how many messages were rejected as malformed
    and how many seconds were spent generating in this process (sync mode: not trainer idle time)."""

    groups: list[Group] = field(default_factory=list)
    rejected: int = 0
    generating_seconds: float = 0.0


class GroupSource(Protocol):
    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        """Makes weights `version` available to the generators; (seconds spent, pushed directly)."""

    async def request(self, items: list[WorkItem]) -> None:
        """Asks for one group per item."""

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        """Groups of iteration `version` as they complete (possibly none within `timeout`)."""

    async def commit(self, version: int) -> None:
        """The step and checkpoint of `version` are durable: its groups may be forgotten."""

    async def queue_depth(self) -> int: ...

    async def finish(self, next_version: int) -> None: ...


class InProcessSource:
    """Sync mode: `generate(items, version)` runs here; `load_weights(version)`, if given, loads
    version v into a separate engine (vLLM) before generating, else the engine shares the learner's weights."""

    def __init__(self, generate: Callable[[list[WorkItem], int], list[Group]], load_weights: Callable[[int], None] | None = None):
        self.generate = generate
        self.load_weights = load_weights
        self.pending: list[WorkItem] = []

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        if self.load_weights is None:
            return 0.0, False
        t0 = time.perf_counter()
        await on_compute_thread(self.load_weights, version)
        return time.perf_counter() - t0, True

    async def request(self, items: list[WorkItem]) -> None:
        self.pending.extend(items)

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        items, self.pending = self.pending, []
        t0 = time.perf_counter()
        groups = await on_compute_thread(self.generate, items, version) if items else []
        return Arrivals(groups=groups, generating_seconds=time.perf_counter() - t0)

    async def commit(self, version: int) -> None:
        pass

    async def queue_depth(self) -> int:
        return 0

    async def finish(self, next_version: int) -> None:
        pass


# A worker publishes an engine call's groups one after another; training them in one micro-batch costs far
# less than a call per group (measured: 12 small train calls took 1.0 s per iteration where 4 took 0.55 s).
ARRIVAL_LINGER_SECONDS = 0.01


class QueueSource:
    """Periodic and bounded modes over NATS JetStream.

    Messages that fail validation are terminated (never redelivered), counted and logged with the
    reason and subject. Groups of a later iteration (bounded mode releases work ahead) are kept,
    unacked and kept alive, until that iteration; every message is acked only at `commit` of the
    iteration that trained it, so a trainer that dies gets them all again."""

    def __init__(
        self,
        transport: Transport,
        limits: Callable[[int], GroupLimits],
        policy_uri: Callable[[int], str],
        weight_push: Callable[[int], Awaitable[bool]] | None = None,
    ):
        self.transport = transport
        self.limits = limits  # version -> what a group of that iteration may contain
        self.policy_uri = policy_uri
        self.weight_push = weight_push  # NCCL (GPU): sends version v to every engine; True when done
        self.sub = None
        self.messages: dict[int, list] = defaultdict(list)  # iteration -> its messages, acked at commit
        self.early: dict[int, list[Group]] = defaultdict(list)  # groups of a later iteration
        self.keep_alive: asyncio.Task | None = None

    async def _subscription(self):
        if self.sub is None:
            self.sub = await self.transport.rollouts_subscription()
            every = self.transport.cfg.ack_wait_seconds / 3
            self.keep_alive = asyncio.create_task(keep_in_progress(lambda: [m for ms in self.messages.values() for m in ms], every))
        return self.sub

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        await self._subscription()
        await self.transport.put_policy(version, self.policy_uri(version))
        if self.weight_push is None:
            return 0.0, False
        t0 = time.perf_counter()
        pushed = await self.weight_push(version)
        return time.perf_counter() - t0, pushed

    async def request(self, items: list[WorkItem]) -> None:
        for item in items:
            await self.transport.publish_work(item)

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        arrivals = Arrivals(groups=self.early.pop(version, []))
        if arrivals.groups:
            return arrivals
        msgs = await self.transport.fetch(await self._subscription(), wanted, timeout=timeout, linger=ARRIVAL_LINGER_SECONDS)
        limits = self.limits(version)
        for m in msgs:
            try:
                group = decode_group(m.data, limits)
            except ProtocolError as err:
                arrivals.rejected += 1
                log.error("rejected a message on %s: %s", m.subject, err)
                await m.term()
                continue
            if group.iteration > version:
                self.early[group.iteration].append(group)
                self.messages[group.iteration].append(m)
            else:
                self.messages[version].append(m)
                arrivals.groups.append(group)
        return arrivals

    async def commit(self, version: int) -> None:
        # Acked only now that the step and its checkpoint are on disk: a trainer that dies mid-iteration
        # gets every group of the iteration redelivered and resumes from the last boundary.
        for m in self.messages.pop(version, []):
            await m.ack()

    async def queue_depth(self) -> int:
        return await self.transport.work_queue_depth()

    async def finish(self, next_version: int) -> None:
        if self.keep_alive is not None:
            self.keep_alive.cancel()
        await self.transport.put_policy(next_version, self.policy_uri(next_version))


class BroadcastSource:
    """Several trainer ranks: rank 0 alone talks to the real source (consume, dedupe, ack, publish
    work); every batch it receives reaches the other ranks as raw msgpack bytes over the CPU process
    group, so every rank decodes the same groups in the same order."""

    def __init__(self, inner: GroupSource | None, ctx: DistContext):
        if ctx.is_main and inner is None:
            raise ValueError("rank 0 needs the real group source")
        self.inner, self.ctx = inner, ctx

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        return await self.inner.begin_iteration(version) if self.ctx.is_main else (0.0, False)

    async def request(self, items: list[WorkItem]) -> None:
        if self.ctx.is_main:
            await self.inner.request(items)

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        payload = None
        if self.ctx.is_main:
            arrivals = await self.inner.receive(version, wanted, timeout)
            payload = pack(
                {"groups": [pack(g) for g in arrivals.groups], "rejected": arrivals.rejected, "generating_seconds": arrivals.generating_seconds}
            )
        data = unpack(await asyncio.to_thread(broadcast_bytes, payload, self.ctx))
        if self.ctx.is_main:
            return arrivals
        return Arrivals([decode_group(g) for g in data["groups"]], data["rejected"], data["generating_seconds"])

    async def commit(self, version: int) -> None:
        if self.ctx.is_main:
            await self.inner.commit(version)

    async def queue_depth(self) -> int:
        return await self.inner.queue_depth() if self.ctx.is_main else 0

    async def finish(self, next_version: int) -> None:
        if self.ctx.is_main:
            await self.inner.finish(next_version)

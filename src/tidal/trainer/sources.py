"""Where the trainer's groups come from. One interface, three sources:

- `QueueSource` (periodic and bounded modes): work items go to the WORK stream, groups come back
  from the ROLLOUTS stream in completion order, decoded and validated; a group is acked only after
  the step and checkpoint of the iteration it was trained in.
- `InProcessSource` (sync mode): generates the requested items in this process, all cores to it;
  the generate function is injected by the launcher, so the trainer never imports the rollout package.
- `BroadcastSource` (several trainer ranks): rank 0 receives from the real source and broadcasts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tidal.protocol import Group, GroupLimits, ProtocolError, WorkItem, decode_group, group_key, pack, unpack
from tidal.trainer.compute import on_compute_thread
from tidal.trainer.distributed import DistContext, broadcast_bytes
from tidal.transport import Transport, keep_in_progress
from tidal.transport.health import describe_workers, watch_workers

log = logging.getLogger(__name__)


@dataclass
class Arrivals:
    """What one `receive` brought: valid groups, plus how many messages were rejected as malformed."""

    groups: list[Group] = field(default_factory=list)
    rejected: int = 0
    rejected_keys: list[tuple[int, int]] = field(default_factory=list)  # (iteration, prompt id) of rejected groups, where readable
    abandoned_keys: list[tuple[int, int]] = field(default_factory=list)  # (iteration, prompt id) of items a silent worker held


class GroupSource(Protocol):
    # whether `receive` may run while the learner trains (on the event loop, no collectives, no compute thread)
    receives_while_training: bool
    # whether `receive` generates the groups in this process (sync mode): waiting on it is work, not trainer idle time
    generates_on_receive: bool

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        """Makes weights `version` available to the generators; (seconds spent, pushed directly)."""

    async def request(self, items: list[WorkItem]) -> None:
        """Asks for one group per item."""

    async def reissue(self, items: list[tuple[WorkItem, int]]) -> None:
        """Asks again for items whose group was rejected; (item, attempt), attempt 1 and up."""

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        """Groups of iteration `version` as they complete (possibly none within `timeout`)."""

    async def commit(self, version: int) -> None:
        """The step and checkpoint of `version` are durable: its groups may be forgotten."""

    async def queue_depth(self) -> int: ...

    async def finish(self, next_version: int) -> None: ...

    async def describe_generators(self) -> str:
        """The generators' state, for an error that blames them ("" when there is nothing to say)."""


class InProcessSource:
    """Sync mode: `generate(items, version)` runs here; `load_weights(version)`, if given, loads
    version v into a separate engine (vLLM) before generating, else the engine shares the learner's weights."""

    receives_while_training = False  # it generates on the learner's compute thread
    generates_on_receive = True

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

    async def reissue(self, items: list[tuple[WorkItem, int]]) -> None:
        self.pending.extend(item for item, _ in items)

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        items, self.pending = self.pending, []
        return Arrivals(groups=await on_compute_thread(self.generate, items, version) if items else [])

    async def commit(self, version: int) -> None:
        pass

    async def queue_depth(self) -> int:
        return 0

    async def finish(self, next_version: int) -> None:
        pass

    async def describe_generators(self) -> str:
        return ""


# A worker publishes an engine call's groups together (all in flight at once); training them in one
# micro-batch costs far less than a call per group. A linger of a few milliseconds gathers a call's
# groups into one training call; a longer one gathers no more and only delays the first call.
ARRIVAL_LINGER_SECONDS = 0.003
WORKER_CHECK_SECONDS = 1.0  # how often the workers' heartbeats are read


class UndeliverableWorkError(RuntimeError):
    """A work item went out transport.max_deliver times and no group came back: JetStream dropped it."""


class QueueSource:
    """Periodic and bounded modes over NATS JetStream.

    Messages that fail validation are terminated (never redelivered), counted and logged with the
    reason and subject. Groups of a later iteration (bounded mode releases work ahead) are kept,
    unacked and kept alive, until that iteration; every message is acked only at `commit` of the
    iteration that trained it, so a trainer that dies gets them all again."""

    receives_while_training = True
    generates_on_receive = False

    def __init__(
        self,
        transport: Transport,
        limits: Callable[[int], GroupLimits],
        policy_uri: Callable[[int], str],
        weight_push: Callable[[int], Awaitable[bool]] | None = None,
        repair_snapshot: Callable[[int], Awaitable[bool]] | None = None,
    ):
        self.transport = transport
        # a worker refused snapshot v: True when it was corrupt and has been rewritten, False when it
        # verifies; raises when it cannot be rewritten. None: not possible here (several ranks)
        self.repair_snapshot = repair_snapshot
        self.checked_at = 0.0
        self.silent: set[str] = set()  # workers named as silent (until a heartbeat comes again)
        self.watched: dict = {}  # worker id -> WatchedWorker (watch_workers): heartbeats on this trainer's clock
        self.refusals_seen: dict[str, tuple[int, int]] = {}  # worker -> (version, refusals) last handled
        self.undeliverable: list[int] = []  # WORK stream sequences JetStream gave up on (max_deliver)
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
            await self.transport.on_undeliverable_work(self.undeliverable.append)
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
        # all in flight at once (in order on the one connection), then every PubAck: an iteration's
        # items reach the workers in one round trip, not one per item
        await asyncio.gather(*(self.transport.publish_work(item) for item in items))

    async def reissue(self, items: list[tuple[WorkItem, int]]) -> None:
        await asyncio.gather(*(self.transport.publish_work(item, attempt) for item, attempt in items))

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        arrivals = Arrivals(groups=self.early.pop(version, []))
        if arrivals.groups:
            return arrivals
        msgs = await self.transport.fetch(await self._subscription(), wanted, timeout=timeout, linger=ARRIVAL_LINGER_SECONDS)
        # also while groups come: the other workers' groups do not mean this one is alive
        arrivals.abandoned_keys = await self._watch_workers()
        limits = self.limits(version)
        for m in msgs:
            try:
                group = decode_group(m.data, limits)
            except ProtocolError as err:
                arrivals.rejected += 1
                log.error("rejected a message on %s: %s", m.subject, err)
                key = group_key(m.data, limits.max_bytes)
                if key is not None:
                    arrivals.rejected_keys.append(key)
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

    async def describe_generators(self) -> str:
        return describe_workers(await self.transport.worker_health(), time.time())

    async def _watch_workers(self) -> list[tuple[int, int]]:
        """At most every WORKER_CHECK_SECONDS: names a worker whose heartbeat stopped and returns the
        (iteration, prompt id) of the items a silent or replaced worker held, has a snapshot a worker
        refused checked (and rewritten when corrupt), and fails on a work item JetStream gave up on
        instead of waiting for trainer.group_timeout_seconds."""
        if self.undeliverable:
            raise UndeliverableWorkError(
                f"{await self.transport.describe_work(self.undeliverable[0])} was handed to workers transport.max_deliver "
                f"({self.transport.cfg.max_deliver}) times and no group came back, so JetStream dropped it; "
                f"see logs/worker-*.log. Workers: {await self.describe_generators()}"
            )
        now = time.time()
        if now - self.checked_at < WORKER_CHECK_SECONDS:
            return []
        self.checked_at = now
        records = await self.transport.worker_health()
        self.watched, silent_records, abandoned = watch_workers(self.watched, records, now)
        silent = {r["worker_id"]: r for r in silent_records}
        for wid in silent.keys() - self.silent:
            r = silent[wid]
            if r.get("left"):
                listed = f"; it could not hand back {r['holding']}, asked for again" if r.get("holding") else ""
                log.info("worker %s (pid %s on %s) left: it handed back its work items%s", wid, r["pid"], r["host"], listed)
                continue
            log.warning(
                "worker %s (pid %s on %s) has sent no heartbeat for %.0fs: the work items its last one listed are asked for again, "
                "any other goes to another worker within transport.ack_wait_seconds (%.0fs)",
                *(wid, r["pid"], r["host"], now - self.watched[wid].changed_at, self.transport.cfg.ack_wait_seconds),
            )
        for wid in self.silent - silent.keys():
            log.info("worker %s sends heartbeats again", wid)
        self.silent = set(silent)
        refused: dict[int, list[dict]] = defaultdict(list)
        for r in records:
            if r.get("refused_version") is not None and self.refusals_seen.get(r["worker_id"]) != (r["refused_version"], r["refusals"]):
                self.refusals_seen[r["worker_id"]] = (r["refused_version"], r["refusals"])
                refused[r["refused_version"]].append(r)
        for version, reports in sorted(refused.items()):
            names = ", ".join(r["worker_id"] for r in reports)
            if self.repair_snapshot is None:
                log.error("worker(s) %s refused weights v%d: %s", names, version, reports[0]["refused_error"])
            elif await self.repair_snapshot(version):
                log.warning("worker(s) %s refused weights v%d (%s): it was corrupt and is rewritten", names, version, reports[0]["refused_error"])
            else:
                log.error("worker(s) %s refused weights v%d, which verify here: %s", names, version, reports[0]["refused_error"])
        return abandoned


class BroadcastSource:
    """Several trainer ranks: rank 0 alone talks to the real source (consume, dedupe, ack, publish
    work); every batch it receives reaches the other ranks as raw msgpack bytes over the CPU process
    group, so every rank decodes the same groups in the same order."""

    receives_while_training = False  # its broadcast is a collective: never beside the learner's
    generates_on_receive = False  # the other ranks wait for rank 0's receive, from the queue

    def __init__(self, inner: GroupSource | None, ctx: DistContext):
        if ctx.is_main and inner is None:
            raise ValueError("rank 0 needs the real group source")
        self.inner, self.ctx = inner, ctx

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        return await self.inner.begin_iteration(version) if self.ctx.is_main else (0.0, False)

    async def request(self, items: list[WorkItem]) -> None:
        if self.ctx.is_main:
            await self.inner.request(items)

    async def reissue(self, items: list[tuple[WorkItem, int]]) -> None:
        if self.ctx.is_main:
            await self.inner.reissue(items)

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        payload = None
        if self.ctx.is_main:
            arrivals = await self.inner.receive(version, wanted, timeout)
            payload = pack(
                {
                    "groups": [pack(g) for g in arrivals.groups],
                    "rejected": arrivals.rejected,
                    "rejected_keys": [list(k) for k in arrivals.rejected_keys],
                    "abandoned_keys": [list(k) for k in arrivals.abandoned_keys],
                }
            )
        data = unpack(await asyncio.to_thread(broadcast_bytes, payload, self.ctx))
        if self.ctx.is_main:
            return arrivals
        keys = [tuple(k) for k in data["rejected_keys"]]
        abandoned = [tuple(k) for k in data["abandoned_keys"]]
        return Arrivals([decode_group(g) for g in data["groups"]], data["rejected"], keys, abandoned)

    async def commit(self, version: int) -> None:
        if self.ctx.is_main:
            await self.inner.commit(version)

    async def queue_depth(self) -> int:
        return await self.inner.queue_depth() if self.ctx.is_main else 0

    async def finish(self, next_version: int) -> None:
        if self.ctx.is_main:
            await self.inner.finish(next_version)

    async def describe_generators(self) -> str:
        return await self.inner.describe_generators() if self.ctx.is_main else ""

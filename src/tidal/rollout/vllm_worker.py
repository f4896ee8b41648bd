"""The rollout worker over vLLM's AsyncLLM: continuous batching across groups.

Up to `rollout.max_inflight_groups` groups (one `n=G` request each; with rollout.agent, G trajectories
of one request per turn each) are in flight; each group is scored, published and acked the moment
its last sample finishes, and a freed slot pulls the next work item at once. Weights change only at the iteration boundary: a work item of another version
waits until nothing of the current version is in flight, then the worker loads that version
(checksums verified inside the engine), drops the prefix cache, records the version and resumes.

The lease on its work items (rollout.lease), the weight arrival (rollout.arrival) and group generation
(rollout.generator) are the HF worker's; this module holds the scheduling loop and NCCL's weight offers.
With rollout.partial a bounded vLLM run uses the HF engine's worker (tidal.rollout.worker) instead: its
engine calls, one iteration's groups each, stop together when newer weights wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tidal.config import TidalConfig
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rewards.failures import RewardFailingError
from tidal.rollout.arrival import version_to_generate
from tidal.rollout.core import WorkerCore
from tidal.rollout.lease import decode_work, log_taken, raise_if_stop_requested
from tidal.rollout.scoring_queue import GroupScoringQueue
from tidal.rollout.vllm_adapter import VLLMEngine
from tidal.rollout.vllm_weights import nccl_join, nccl_receive
from tidal.transport import Transport, weight_handshake

log = logging.getLogger(__name__)


def scoring_batch_samples(cfg: TidalConfig) -> int:
    """Samples per scoring call: with a served reward model, up to its largest batch_size (requests of
    several groups); otherwise one group (in-process rewards gain nothing from batching)."""
    served = [f.batch_size for f in cfg.reward.functions if f.type == "reward_model"]
    return max([cfg.rollout.group_size, *served])


class NcclStuckError(RuntimeError):
    """The engine is blocked inside an NCCL collective that will not complete."""


class VLLMRolloutWorker:
    def __init__(
        self,
        cfg: TidalConfig,
        engine: VLLMEngine,
        tokenizer,
        transport: Transport,
        worker_id: str,
        weights_root: Path | None = None,
        scorer: RewardScorer | None = None,
        stop_requested: Callable[[], bool] = lambda: False,
    ):
        self.stop_requested = stop_requested  # SIGTERM came (roles.cancel_on_sigterm): stop pulling
        self.cfg, self.engine, self.transport, self.worker_id = cfg, engine, transport, worker_id
        core = WorkerCore.build(cfg, engine, tokenizer, transport, worker_id, weights_root, scorer)
        self.health, self.lease, self.arrival, self.generator = core.health, core.lease, core.arrival, core.generator
        self.score_pool = ThreadPoolExecutor(max_workers=1)  # one scorer, one thread: its error count stays exact
        self.scoring = GroupScoringQueue(self.score_pool, self.generator.score, scoring_batch_samples(cfg))
        self.inflight: dict[asyncio.Task, object] = {}  # task -> its NATS message
        self.backlog: deque = deque()  # (msg, item) pulled but not started: another version
        self.load_seconds = 0.0
        self.idle_seconds = 0.0
        self.idle_since: float | None = time.time()
        # NCCL needs CUDA: a CPU or NPU engine was built without a weight-transfer backend
        self.nccl = cfg.rollout.vllm.weight_sync == "nccl" and engine.device == "cuda"
        self.nccl_group: str | None = None  # the trainer's NCCL group this engine belongs to
        self.offer_taken: str | None = None  # the last offer id this worker answered

    @property
    def version(self) -> int | None:
        return self.health.version

    @property
    def groups_published(self) -> int:
        return self.health.groups_published

    # --- weights ---------------------------------------------------------------------------------

    async def _receive_nccl(self, version: int) -> bool:
        """The GPU fast path; False (load from the weight store) whenever it is off or fails.
        Raises NcclStuckError when the engine is stuck inside the collective: only a restart helps."""
        lane = weight_handshake.lane_of(self.worker_id)
        timeout = self.cfg.rollout.vllm.nccl_timeout_seconds
        go = await weight_handshake.accept(self.transport, lane, version, self.nccl_group, 2 * timeout)  # longer: the trainer decides
        if go is None:
            return False
        self.offer_taken = go["id"]
        rendezvous = go["rendezvous"]
        try:
            if self.nccl_group != rendezvous["group"]:
                await asyncio.wait_for(nccl_join(self.engine, rendezvous, 1 + lane * self.cfg.rollout.vllm.tensor_parallel_size), timeout)
                self.nccl_group = rendezvous["group"]
            await asyncio.wait_for(nccl_receive(self.engine, go["update_info"], version), timeout)
            return True
        except TimeoutError:
            raise NcclStuckError(
                f"worker {self.worker_id}: NCCL transfer of v{version} did not finish within {timeout:.0f}s "
                "(rollout.vllm.nccl_timeout_seconds); its engine is stuck in the collective, so the worker exits to be restarted"
            ) from None
        except Exception as err:  # noqa: BLE001 - any other failure means: load from the store
            log.warning("worker %s: NCCL weight transfer of v%d failed (%s); using the weight store", self.worker_id, version, err)
            return False

    async def sync_weights(self, version: int) -> bool:
        """Loads `version` with nothing in flight. False: refused (corrupt), the previous version stays."""
        assert not self.inflight, "weights change only with nothing in flight"
        seconds = await self.arrival.load(version, self._receive_nccl if self.nccl else None)
        if seconds is None:
            return False
        self.load_seconds += seconds
        return True

    # --- one group -------------------------------------------------------------------------------

    async def _run_group(self, msg, item: WorkItem) -> None:
        group = await self.generator.group(item, self.version, self.scoring, self.score_pool)
        group.weight_load_seconds, self.load_seconds = self.load_seconds, 0.0
        group.worker_idle_seconds, self.idle_seconds = self.idle_seconds, 0.0
        await self.transport.publish_group(group, answering=msg)
        await self.lease.ack(msg)
        self.health.groups_published += 1

    def _start(self, msg, item: WorkItem) -> None:
        if self.idle_since is not None:
            self.idle_seconds += time.time() - self.idle_since
            self.idle_since = None
        self.inflight[asyncio.create_task(self._run_group(msg, item))] = msg

    async def _finished(self, done: set) -> None:
        for task in done:
            msg = self.inflight.pop(task)
            if task.exception() is not None:
                if isinstance(task.exception(), RewardFailingError):  # a reward fails too often: the run stops
                    raise task.exception()
                if self.engine.dead:
                    raise RuntimeError(f"worker {self.worker_id}: the vLLM engine died") from task.exception()
                log.error("worker %s: a group failed: %r; its work item goes back to the queue", self.worker_id, task.exception())
                await self.lease.nak(msg, delay=1.0)
        if not self.inflight:
            self.idle_since = time.time()

    # --- the loop --------------------------------------------------------------------------------

    async def _pull(self, sub) -> None:
        free = self.cfg.rollout.max_inflight_groups - len(self.inflight)
        if self.backlog or free <= 0:
            return
        # in-flight groups progress while we wait; an idle NCCL member also watches for offers
        timeout = 0.05 if self.inflight else (0.25 if self.nccl else 1.0)
        pulled = await decode_work(self.transport, await self.transport.fetch(sub, free, timeout=timeout), self.worker_id, self.lease)
        self.backlog.extend(pulled)
        if pulled:
            log_taken(self.worker_id, pulled)

    async def _start_ready(self) -> None:
        """Starts backlog items of the loaded version; switches version only with nothing in flight."""
        while self.backlog and len(self.inflight) < self.cfg.rollout.max_inflight_groups:
            msg, item = self.backlog[0]
            version = await version_to_generate(self.transport, self.cfg.mode, item)
            if version is None:
                self.backlog.popleft()
                await self.lease.ack(msg)  # obsolete: the trainer has moved past its iteration
                continue
            if version != self.version:
                if self.inflight:
                    return  # drain the current version first: no sample mixes two versions
                if not await self.sync_weights(version):
                    await self.lease.back_off([m for m, _ in self.backlog], self.arrival.backoff)
                    self.backlog.clear()
                    return
            self.backlog.popleft()
            self._start(msg, item)

    async def _take_offer(self) -> None:
        """An NCCL broadcast needs every engine, including one that got no work item of that version,
        and one that already holds it (a restarted trainer forms a new group and offers it again)."""
        offer = await weight_handshake.pending_offer(self.transport)
        if not offer or offer["id"] == self.offer_taken:
            return
        newer = self.version is None or offer["version"] > self.version
        new_group = offer["rendezvous"]["group"] != self.nccl_group and not offer["rendezvous"].get("formed")
        if newer or (new_group and offer["version"] == self.version):
            self.offer_taken = offer["id"]
            await self.sync_weights(offer["version"])

    async def run(self) -> None:
        if self.cfg.rollout.vllm.weight_sync == "nccl" and not self.nccl:
            await weight_handshake.refuse(self.transport, f"worker {self.worker_id}'s vLLM engine runs on {self.engine.device} (NCCL needs CUDA)")
        sub = await self.transport.work_subscription()
        try:
            async with self.lease.kept():
                try:
                    await self._serve(sub)
                finally:
                    for task in self.inflight:
                        task.cancel()
                    self.backlog.clear()
        finally:
            self.score_pool.shutdown(wait=False)
            self.generator.close()

    async def _serve(self, sub) -> None:
        last_check = 0.0
        while True:
            raise_if_stop_requested(self.stop_requested)
            if not self.inflight and time.time() - last_check > 1.0:
                last_check = time.time()
                if await self.transport.stopping():
                    log.info("worker %s: run is over, exiting", self.worker_id)
                    return
            if self.nccl and not self.inflight:
                await self._take_offer()
            await self._pull(sub)
            await self._start_ready()
            if self.inflight and (len(self.inflight) >= self.cfg.rollout.max_inflight_groups or self.backlog):
                done, _ = await asyncio.wait(list(self.inflight), return_when=asyncio.FIRST_COMPLETED)
                await self._finished(done)
            else:
                await self._finished({t for t in self.inflight if t.done()})

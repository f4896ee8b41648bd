"""The rollout worker over vLLM's AsyncLLM: continuous batching across groups.

Up to `rollout.max_inflight_groups` groups (one `n=G` request each; with rollout.env, G trajectories
of one request per turn each) are in flight; each group is scored, published and acked the moment
its last sample finishes, and a freed slot pulls the next work item at once. Weights change only at the iteration boundary: a work item of another version
waits until nothing of the current version is in flight, then the worker loads that version
(checksums verified inside the engine), drops the prefix cache, records the version and resumes.
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
from tidal.data import prompt_encoder
from tidal.model.probe import trainer_compute_dtypes
from tidal.protocol import Group, WorkItem, decode_work_item
from tidal.rewards import RewardScorer
from tidal.rewards.failures import RewardFailingError
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import GroupRequest, group_seed
from tidal.rollout.scoring_queue import GroupScoringQueue
from tidal.rollout.vllm_adapter import VLLMEngine, nccl_join, nccl_receive
from tidal.rollout.worker import (
    ArrivalCheck,
    build_groups,
    decode_work,
    hand_back,
    log_taken,
    model_context,
    raise_if_stop_requested,
    snapshot_path,
    version_to_generate,
)
from tidal.transport import Transport, keep_in_progress, weight_handshake
from tidal.transport.health import WorkerHealth, beat, report_refusal
from tidal.weights import readable_manifest

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
        self.weights_root = weights_root
        self.stop_requested = stop_requested  # SIGTERM came (roles.cancel_on_sigterm): stop pulling
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.encode_prompt = prompt_encoder(tokenizer, cfg.data)
        self.transport = transport
        self.worker_id = worker_id
        self.scorer = scorer or RewardScorer.from_config(cfg.reward, seed=cfg.seed if cfg.rollout.deterministic else None)
        self.agent = AgentLoop.from_config(cfg, tokenizer, model_context(engine)) if cfg.rollout.env is not None else None
        self.score_pool = ThreadPoolExecutor(max_workers=1)  # one scorer, one thread: its error count stays exact
        self.scoring = GroupScoringQueue(self.score_pool, self._build_groups, scoring_batch_samples(cfg))
        self.health = WorkerHealth(worker_id)
        self._arrival: ArrivalCheck | None = None
        self.backoff = 0.0
        self.inflight: dict[asyncio.Task, object] = {}  # task -> its NATS message
        self.backlog: deque = deque()  # (msg, item) pulled but not started: another version
        self.health.held = lambda: [decode_work_item(m.data) for m in [*self.inflight.values(), *(m for m, _ in self.backlog)]]
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

    async def _policy_uri(self, version: int) -> str:
        return await snapshot_path(self.transport, version, self.weights_root)

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
        t0 = time.time()
        path = await self._policy_uri(version)
        await self._calibrate_on_base(path)
        if self.nccl and await self._receive_nccl(version):
            # the trainer published the version (with its probe record) before it sent it
            source, probe = "over NCCL", (readable_manifest(Path(path)) or {}).get("probe")
        else:
            source = "from the weight store"
            result = await self.engine.load_snapshot(path)
            if "error" in result:
                self.backoff = await report_refusal(self.transport, self.health, version, result["error"])
                if result.get("partial") and self.version is not None:
                    await self.engine.load_snapshot(await self._policy_uri(self.version))
                return False
            probe = result.get("probe")
        loaded = time.time() - t0
        difference = await self._check_arrival(version, probe)
        self.health.loaded(version)
        self.load_seconds += time.time() - t0
        arrived = "" if difference is None else f" (probe log-probs within {difference:.1e} of the trainer's, mean per token)"
        log.info("worker %s loaded weights v%d in %.3fs %s%s", self.worker_id, version, loaded, source, arrived)
        return True

    @property
    def arrival(self) -> ArrivalCheck:
        """The engine's arrival check (its dtype is known once it started)."""
        if self._arrival is None:
            dtypes = (self.engine.dtype, *trainer_compute_dtypes(self.cfg))
            self._arrival = ArrivalCheck(self.cfg.weights.arrival_tolerance, "vllm", dtypes, self.worker_id)
        return self._arrival

    async def _calibrate_on_base(self, path: str) -> None:
        """Before the engine's first version (it still serves the base model): the arrival check's calibration, on
        the base's record that version `path`'s manifest carries."""
        if self.version is not None:
            return
        probe = (readable_manifest(Path(path)) or {}).get("probe")
        if probe and self.arrival.wants_base(probe):
            self.arrival.calibrate(probe, await self.engine.probe_logprobs(probe["sequences"]))

    async def _check_arrival(self, version: int, probe: dict | None) -> float | None:
        """The arrival check on the version just loaded (from the store or over NCCL): WeightsDidNotArriveError
        when the engine's log-probs of the probe differ from the trainer's."""
        if not probe or not self.arrival.tolerance:  # a version published without one, or the check is off
            return None
        return self.arrival.check(probe, await self.engine.probe_logprobs(probe["sequences"]), version)

    # --- one group -------------------------------------------------------------------------------

    async def _generate_group(self, item: WorkItem, version: int) -> Group:
        """One response per sample; with rollout.env, one trajectory per sample (the agent loop)."""
        seed = group_seed(self.cfg.seed, item.iteration, item.prompt_id) if self.cfg.rollout.deterministic else None
        if self.agent is not None:
            request = GroupRequest([], self.cfg.rollout.group_size, seed=seed)  # the agent loop renders the prompt
            (group,) = await self.agent.generate_async(self.engine, [item], [request], self.scorer, version, self.worker_id, self.score_pool)
            return group
        prompt = self.encode_prompt(item.prompt)
        gen_start = time.time()
        completions = await self.engine.generate_group(
            GroupRequest(prompt, self.cfg.rollout.group_size), seed, tag=f"{item.iteration}-{item.prompt_id}"
        )
        return await self.scoring.score((item, prompt, completions, version, gen_start, time.time()), len(completions))

    def _build_groups(self, finished: list[tuple]) -> list[Group]:
        """The groups that finished while the scorer was busy, scored in one call (served rewards batch
        across them); each keeps its own generation times. All are of one version: a version changes
        only with nothing in flight."""
        items, prompts, outputs, versions, starts, ends = zip(*finished, strict=True)
        assert len(set(versions)) == 1, f"groups of versions {sorted(set(versions))} scored together"
        return build_groups(
            list(items), list(prompts), list(outputs), self.tokenizer, self.scorer, versions[0], self.worker_id, list(zip(starts, ends))
        )

    async def _run_group(self, msg, item: WorkItem) -> None:
        group = await self._generate_group(item, self.version)
        group.weight_load_seconds, self.load_seconds = self.load_seconds, 0.0
        group.worker_idle_seconds, self.idle_seconds = self.idle_seconds, 0.0
        await self.transport.publish_group(group, answering=msg)
        await msg.ack()
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
                await msg.nak(delay=1.0)
        if not self.inflight:
            self.idle_since = time.time()

    # --- the loop --------------------------------------------------------------------------------

    async def _pull(self, sub) -> None:
        free = self.cfg.rollout.max_inflight_groups - len(self.inflight)
        if self.backlog or free <= 0:
            return
        # in-flight groups progress while we wait; an idle NCCL member also watches for offers
        timeout = 0.05 if self.inflight else (0.25 if self.nccl else 1.0)
        pulled = await decode_work(self.transport, await self.transport.fetch(sub, free, timeout=timeout), self.worker_id)
        self.backlog.extend(pulled)
        if pulled:
            log_taken(self.worker_id, pulled)  # a heartbeat at once lists them (not on every poll while a backlog waits)
            self.health.changed.set()

    async def _start_ready(self) -> None:
        """Starts backlog items of the loaded version; switches version only with nothing in flight."""
        while self.backlog and len(self.inflight) < self.cfg.rollout.max_inflight_groups:
            msg, item = self.backlog[0]
            version = await version_to_generate(self.transport, self.cfg, item)
            if version is None:
                self.backlog.popleft()
                await msg.ack()  # obsolete: the trainer has moved past its iteration
                continue
            if version != self.version:
                if self.inflight:
                    return  # drain the current version first: no sample mixes two versions
                if not await self.sync_weights(version):
                    for m, _ in self.backlog:
                        await m.nak(delay=self.backoff)
                    self.backlog.clear()
                    await asyncio.sleep(self.backoff)
                    return
            self.backlog.popleft()
            self._start(msg, item)

    async def _keep_alive(self) -> None:
        """Extends the ack deadline of every message held (in flight or waiting in the backlog)."""
        await keep_in_progress(lambda: [*self.inflight.values(), *(m for m, _ in self.backlog)], self.cfg.transport.ack_wait_seconds / 3)

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

    async def _stopping(self) -> bool:
        return await self.transport.stopping()

    async def run(self) -> None:
        if self.cfg.rollout.vllm.weight_sync == "nccl" and not self.nccl:
            await weight_handshake.refuse(self.transport, f"worker {self.worker_id}'s vLLM engine runs on {self.engine.device} (NCCL needs CUDA)")
        sub = await self.transport.work_subscription()
        keep_alive = asyncio.create_task(self._keep_alive())
        heartbeat = asyncio.create_task(beat(self.transport, self.health))
        last_check = 0.0
        leaving = "failing"
        try:
            while True:
                raise_if_stop_requested(self.stop_requested)
                if not self.inflight and time.time() - last_check > 1.0:
                    last_check = time.time()
                    if await self._stopping():
                        log.info("worker %s: run is over, exiting", self.worker_id)
                        leaving = ""
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
        except asyncio.CancelledError:
            leaving = "stopping (SIGTERM)"
            raise
        finally:
            keep_alive.cancel()
            heartbeat.cancel()
            for task in self.inflight:
                task.cancel()
            held = [(m, decode_work_item(m.data)) for m in self.inflight.values()] + list(self.backlog)
            if held or leaving:
                await hand_back(self.transport, self.health, held, leaving or "exiting")
            self.backlog.clear()
            self.score_pool.shutdown(wait=False)

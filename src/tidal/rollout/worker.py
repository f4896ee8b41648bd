"""The rollout worker: pull work items, generate G samples each, score, publish the group, ack.

It never waits for a whole batch: each finished group goes out at once, and a work item is
acknowledged only after its group is published, so a worker that dies loses nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from tidal.config import TidalConfig
from tidal.data import prompt_encoder
from tidal.model.probe import (
    BASE_BOUND,
    CALIBRATION_FACTOR,
    DTYPE_TOLERANCE,
    arrival_tolerance,
    coarsest_dtype,
    largest_difference,
    probe_difference,
    trainer_compute_dtypes,
)
from tidal.protocol import Group, ProtocolError, Sample, WorkItem, decode_work_item
from tidal.rewards import RewardScorer, exact_match
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import Completion, GroupRequest, RolloutEngine, group_generator, group_seed
from tidal.transport import Transport, keep_in_progress
from tidal.transport.health import WorkerHealth, beat, report_refusal
from tidal.weights import CorruptSnapshotError, WeightsDidNotArriveError, load_verified_with_manifest, version_dir_name

log = logging.getLogger(__name__)


def build_groups(
    items: list[WorkItem],
    prompts: list[list[int]],
    outputs: list[list[Completion]],
    tokenizer,
    scorer: RewardScorer,
    policy_version: int,
    worker_id: str,
    gen_times: list[tuple[float, float]],
) -> list[Group]:
    """The groups of one engine call, every sample scored in one `score_many` (served rewards batch
    across the groups). `gen_times`: each group's generation (start, end). The call's scoring seconds,
    served-reward counts and each reward's calls and failures ride on its first group."""
    from tidal.rewards.served import Row

    texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions] for completions in outputs]
    prompt_texts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    rows = [Row(pt, text, it.answer) for it, pt, group_texts in zip(items, prompt_texts, texts) for text in group_texts]
    prompt_ids = [it.prompt_id for it, group_texts in zip(items, texts) for _ in group_texts]
    scored = iter(scorer.score_many(rows, prompt_ids))
    groups = []
    for item, prompt, completions, group_texts, (gen_start, gen_end) in zip(items, prompts, outputs, texts, gen_times, strict=True):
        samples, errors = [], 0
        for c, text in zip(completions, group_texts):
            reward, parts, failed = next(scored)
            errors += failed
            samples.append(
                Sample(
                    token_ids=np.asarray(c.token_ids, dtype=np.int32),
                    logprobs=np.asarray(c.logprobs, dtype=np.float32),
                    reward=reward,
                    finish_reason=c.finish_reason,
                    reward_parts=parts,
                    correct=exact_match(text, item.answer),
                )
            )
        groups.append(
            Group(
                iteration=item.iteration,
                prompt_id=item.prompt_id,
                policy_version=policy_version,
                worker_id=worker_id,
                prompt_ids=np.asarray(prompt, dtype=np.int32),
                samples=samples,
                gen_start=gen_start,
                gen_end=gen_end,
                reward_errors=errors,
            )
        )
    if groups:
        groups[0].reward_stats = scorer.take_stats()
        groups[0].failures = scorer.ledger.take()  # each reward's calls and failures, for the trainer's count
    return groups


def generation_chunks(
    prompt_lengths: list[int],
    group_size: int,
    max_new_tokens: int,
    token_budget: int,
    max_groups: int | None = None,
    first_groups: int | None = None,
) -> list[range]:
    """Consecutive groups per engine call: as many whole groups as fit ``token_budget`` tokens
    (G rows of prompt + max_new_tokens each), at most ``max_groups``, at least one. Evened out, so an
    iteration's last call is not a small remainder. ``first_groups``: the first call holds only that
    many, so the trainer gets its first groups sooner (the rest are chunked as before)."""
    if not prompt_lengths:
        return []
    if first_groups:  # never more than the budget and cap would give the first call anyway
        head = len(generation_chunks(prompt_lengths, group_size, max_new_tokens, token_budget, max_groups)[0])
        if head > first_groups:
            rest = generation_chunks(prompt_lengths[first_groups:], group_size, max_new_tokens, token_budget, max_groups)
            return [range(0, first_groups), *(range(r.start + first_groups, r.stop + first_groups) for r in rest)]
    per_group = [group_size * (p + max_new_tokens) for p in prompt_lengths]
    cap = max(1, max_groups or len(per_group))
    calls, used, count = 1, 0, 0
    for tokens in per_group:
        if count and (used + tokens > token_budget or count >= cap):
            calls, used, count = calls + 1, 0, 0
        used, count = used + tokens, count + 1
    size = -(-len(per_group) // calls)  # ceil: the same number of calls, sizes within one of each other
    return [range(start, min(start + size, len(per_group))) for start in range(0, len(per_group), size)]


def response_tokens(cfg: TidalConfig) -> int:
    """The most tokens one row may add after its prompt: one response, or with rollout.env every
    turn and what the environment inserts between turns."""
    r = cfg.rollout
    if r.env is None:
        return r.max_new_tokens
    return r.max_turns * r.max_new_tokens + (r.max_turns - 1) * r.max_env_tokens_per_turn


def pull_size(cfg: TidalConfig, prompt_tokens: int) -> int:
    """Work items a worker fetches at once: what one engine call holds at prompts of ``prompt_tokens``."""
    r = cfg.rollout
    if r.deterministic:
        return 1
    fits = max(1, r.generation_token_budget // (r.group_size * (prompt_tokens + response_tokens(cfg))))
    return min(fits, r.groups_per_batch) if r.groups_per_batch else fits


def generate_groups(
    engine: RolloutEngine,
    tokenizer,
    scorer: RewardScorer,
    items: list[WorkItem],
    cfg: TidalConfig,
    policy_version: int,
    worker_id: str,
    max_groups_per_call: int | None = None,
    agent: AgentLoop | None = None,
) -> list[Group]:
    """Generates and scores one group per work item, in engine calls of `generation_chunks`
    (rollout.generation_token_budget). Deterministic mode: one group per engine call, with the
    group's own RNG, so samples depend on (seed, iteration, prompt id) alone."""
    calls = generate_group_calls(engine, tokenizer, scorer, items, cfg, policy_version, worker_id, max_groups_per_call, agent=agent)
    return [group for call in calls for group in call]


def generate_group_calls(
    engine: RolloutEngine,
    tokenizer,
    scorer: RewardScorer,
    items: list[WorkItem],
    cfg: TidalConfig,
    policy_version: int,
    worker_id: str,
    max_groups_per_call: int | None = None,
    first_call_groups: int | None = None,
    agent: AgentLoop | None = None,
    scoring: Executor | None = None,
):
    """`generate_groups`, one engine call at a time: yields each call's groups as soon as they are
    scored. With rollout.env each row is a multi-turn trajectory (`agent`: the environment loop; when
    not given, one is built here and closed after). With `scoring` (an executor of one thread), a
    call's groups are scored there while the engine runs the next call, and each yield is a Future
    of them."""
    if cfg.rollout.env is not None and agent is None:
        agent = AgentLoop.from_config(cfg, tokenizer, model_context(engine))
        try:
            yield from generate_group_calls(
                engine, tokenizer, scorer, items, cfg, policy_version, worker_id, max_groups_per_call, first_call_groups, agent, scoring
            )
        finally:
            agent.close()  # its tools' process
        return
    r = cfg.rollout
    if r.env is not None:
        prompts = [agent.first_prompt(it) for it in items]
    else:
        encode = prompt_encoder(tokenizer, cfg.data)
        prompts = [encode(it.prompt) for it in items]
    cap = 1 if r.deterministic else max_groups_per_call
    chunks = generation_chunks([len(p) for p in prompts], r.group_size, response_tokens(cfg), r.generation_token_budget, cap, first_call_groups)
    for chunk in chunks:
        batch = [items[i] for i in chunk]
        requests = [
            GroupRequest(
                prompts[i],
                r.group_size,
                group_generator(cfg.seed, it.iteration, it.prompt_id),
                group_seed(cfg.seed, it.iteration, it.prompt_id) if r.deterministic else None,
            )
            for i, it in zip(chunk, batch)
        ]
        if agent is not None:  # the agent loop scores each trajectory as it ends
            groups = agent.generate(engine, batch, requests, scorer, policy_version, worker_id)
            yield groups if scoring is None else finished(groups)
            continue
        gen_start = time.time()
        outputs = engine.generate(requests)
        gen_end = time.time()
        score = partial(
            build_groups,
            batch,
            [prompts[i] for i in chunk],
            outputs,
            tokenizer,
            scorer,
            policy_version,
            worker_id,
            [(gen_start, gen_end)] * len(batch),
        )
        yield score() if scoring is None else scoring.submit(score)


def finished(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def model_context(engine) -> int | None:
    """The longest sequence the engine's model takes, when it says (vLLM's max_model_len, the HF
    engine's model config)."""
    if hasattr(engine, "context_length"):
        return engine.context_length
    model = getattr(engine, "model", None)
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


FETCH_LINGER_SECONDS = 0.02  # the trainer publishes an iteration's work items one after another
HAND_BACK_SECONDS = 5.0  # a leaving worker's NAKs and last heartbeat wait this long for NATS


def delivery_count(msg) -> int:
    """How many times JetStream has delivered `msg` (1: first delivery; more: handed back, or its ack deadline passed)."""
    try:
        return int(msg.metadata.num_delivered)
    except (AttributeError, TypeError, ValueError):
        return 1


async def hand_back(transport: Transport, health: WorkerHealth, held: list[tuple[object, WorkItem]], why: str) -> None:
    """A worker leaving before its work is done (SIGTERM: a preemption notice or `tidal scale`; an error):
    every work item it holds goes back to the queue at once (NAK: JetStream redelivers it now, not after
    transport.ack_wait_seconds), and its last heartbeat says it left and lists only the items that could
    not be handed back, so the trainer asks again for those alone. With NATS unreachable nothing is lost:
    the items come back through the heartbeat and the ack deadline, as a killed worker's do."""
    outcomes = await asyncio.gather(*(asyncio.wait_for(m.nak(), HAND_BACK_SECONDS) for m, _ in held), return_exceptions=True)
    back = [(it.iteration, it.prompt_id) for (_, it), o in zip(held, outcomes) if not isinstance(o, BaseException)]
    kept = [it for (_, it), o in zip(held, outcomes) if isinstance(o, BaseException)]
    health.held, health.left = (lambda: kept), True
    try:
        await asyncio.wait_for(transport.put_worker_health(health.record()), HAND_BACK_SECONDS)
    except Exception as err:  # noqa: BLE001 - the heartbeat's silence tells the trainer instead
        log.warning("worker %s: its last heartbeat was not sent (%s)", health.worker_id, err)
    log.info("worker %s %s: handed back %d work item(s) for redelivery %s", health.worker_id, why, len(back), back)
    if kept:
        log.warning(
            "worker %s could not hand back %s: they come back through its heartbeat", health.worker_id, [(k.iteration, k.prompt_id) for k in kept]
        )


def raise_if_stop_requested(stop_requested: Callable[[], bool]) -> None:
    """SIGTERM came but its cancellation was lost on the way (see roles.cancel_on_sigterm): cancel here."""
    if stop_requested():
        raise asyncio.CancelledError("SIGTERM")


def log_taken(worker_id: str, pulled: list) -> None:
    """One line per pull: the items taken, and which of them came back to the queue (delivery > 1)."""
    again = [(it.iteration, it.prompt_id, n) for m, it in pulled if (n := delivery_count(m)) > 1]
    log.info(
        "worker %s took %d work item(s) %s%s",
        *(
            worker_id,
            len(pulled),
            [(it.iteration, it.prompt_id) for _, it in pulled],
            f"; redelivered (iteration, prompt, delivery): {again}" if again else "",
        ),
    )


async def decode_work(transport: Transport, msgs: list, worker_id: str) -> list[tuple[object, WorkItem]]:
    """The valid work items of `msgs`; a malformed one is terminated (never redelivered) and logged."""
    out = []
    for m in msgs:
        try:
            out.append((m, decode_work_item(m.data, transport.max_message_bytes)))
        except ProtocolError as err:
            log.error("worker %s rejected a message on %s: %s", worker_id, m.subject, err)
            await m.term()
    return out


async def version_to_generate(transport: Transport, cfg: TidalConfig, item: WorkItem) -> int | None:
    """The policy version that must generate `item`. periodic: exactly the item's iteration, once
    published. bounded: the newest published version, which is at least iteration -
    rollout.max_staleness because the trainer releases work only that far ahead. None when the
    trainer has already moved past the item's iteration (a leftover, e.g. a redelivered or spare
    item: its group would be discarded, and weight retention may have deleted its snapshot)."""
    if cfg.mode != "bounded":
        policy = await transport.wait_for_policy(item.iteration)
        return None if policy.version > item.iteration else item.iteration
    policy = await transport.wait_for_policy(0)
    return None if policy.version > item.iteration else policy.version


async def snapshot_path(transport: Transport, version: int, weights_root: Path | None) -> str:
    """Where weights `version` are, once the trainer has published them. A worker that knows its run
    directory loads from the run's own weight store: the KV pointer only says which version is
    current, so a pointer rewritten to another directory cannot redirect it to other weights.
    Without one (a worker built by hand), beside the pointer's URI."""
    policy = await transport.wait_for_policy(version)
    if weights_root is not None:
        return str(Path(weights_root) / version_dir_name(version))
    return os.path.join(os.path.dirname(policy.uri), version_dir_name(version))


def check_arrival(engine, manifest: dict, version: int, tolerance: float, worker_id: str, why: str = "weights.arrival_tolerance") -> float | None:
    """The engine's log-probs of the probe published with `version` against the trainer's: returns the mean
    per-token difference; one above `tolerance` is WeightsDidNotArriveError naming the version (the run stops). None:
    nothing checked (the manifest has no probe, the check is off, or the engine cannot compute log-probs)."""
    probe = manifest.get("probe")
    if not probe or not tolerance or not hasattr(engine, "probe_logprobs"):
        return None
    return compare_probe(probe, engine.probe_logprobs(probe["sequences"]), version, tolerance, worker_id, why)


def compare_probe(
    probe: dict, engine_logprobs: list[list[float]], version: int, tolerance: float, worker_id: str, why: str = "weights.arrival_tolerance"
) -> float:
    """The mean per-token difference between the engine's log-probs of the probe and the trainer's (`probe` as
    the manifest records it); above `tolerance` (named by `why`) it is WeightsDidNotArriveError naming the version."""
    difference = probe_difference(probe["logprobs"], engine_logprobs)
    if not difference <= tolerance:
        largest = largest_difference(probe["logprobs"], engine_logprobs)
        raise WeightsDidNotArriveError(
            f"weights v{version} did not arrive on worker {worker_id}: its log-probs of the run's probe differ from the trainer's "
            f"by {difference:.3g} per token on average, up to {largest:.3g} ({why} {tolerance:g}, for the mean)"
        )
    return difference


class ArrivalCheck:
    """One engine's arrival check. Its tolerance is weights.arrival_tolerance when set; else the default for the dtypes
    both sides compute in (arrival_tolerance). Where one side computes in half precision, how far a right version
    lands depends on the model's depth and the hardware as much as on the dtype, so the engine also measures its
    difference on the base model, the one weights it serves before its first version: the tolerance of every version
    is then at least CALIBRATION_FACTOR times that, and a base further off than BASE_BOUND stops the worker."""

    def __init__(self, configured: float | None, engine: str, dtypes: tuple[str, ...], worker_id: str):
        self.tolerance = arrival_tolerance(configured, engine, *dtypes)
        self.why = "weights.arrival_tolerance"
        self.dtype = coarsest_dtype(*dtypes)
        self.uncalibrated = configured is None and self.tolerance > DTYPE_TOLERANCE["float32"]
        self.worker_id = worker_id

    def wants_base(self, probe: dict | None) -> bool:
        """True while the engine, still serving the base model, should be probed before its first version."""
        return bool(self.uncalibrated and probe and probe.get("base_logprobs"))

    def calibrate(self, probe: dict, base_logprobs: list[list[float]]) -> float:
        """From the engine's log-probs of the probe on the base model: the tolerance of every later version."""
        difference = probe_difference(probe["base_logprobs"], base_logprobs)
        bound = BASE_BOUND.get(self.dtype, max(BASE_BOUND.values()))
        if not difference <= bound:
            raise WeightsDidNotArriveError(
                f"the base model did not arrive on worker {self.worker_id}: its log-probs of the run's probe differ from the "
                f"trainer's by {difference:.3g} per token on average (at most {bound:g} in {self.dtype}): it is not the "
                "model the trainer trains"
            )
        self.uncalibrated = False
        if CALIBRATION_FACTOR * difference > self.tolerance:
            self.tolerance = CALIBRATION_FACTOR * difference
            self.why = f"the tolerance calibrated on the base model ({CALIBRATION_FACTOR}x its {difference:.2g}):"
        log.info(
            "worker %s: arrival check calibrated on the base model: %.2g per token in %s, tolerance %.2g",
            self.worker_id,
            difference,
            self.dtype,
            self.tolerance,
        )
        return difference

    def check(self, probe: dict | None, engine_logprobs: list[list[float]], version: int) -> float:
        return compare_probe(probe, engine_logprobs, version, self.tolerance, self.worker_id, self.why)


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
        self.weights_root = weights_root
        self.stop_requested = stop_requested  # SIGTERM came (roles.cancel_on_sigterm): stop pulling
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.transport = transport
        self.worker_id = worker_id
        self.scorer = scorer or RewardScorer.from_config(cfg.reward, seed=cfg.seed if cfg.rollout.deterministic else None)
        self.agent = AgentLoop.from_config(cfg, tokenizer, model_context(engine)) if cfg.rollout.env is not None else None
        self.health = WorkerHealth(worker_id)
        self.arrival = ArrivalCheck(cfg.weights.arrival_tolerance, "hf", trainer_compute_dtypes(cfg), worker_id)
        self.backoff = 0.0
        self.prompt_tokens = 16  # until the first prompts are seen: the longest encoded prompt sizes later pulls
        # served rewards: one engine call's groups are scored while the engine runs the next (one thread: the
        # scorer's counts stay exact). In-process functions score in microseconds: they stay inline, where
        # the groups go out soonest (tests/test_end_to_end.py's overlap check saw the thread hop delay them)
        self.scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring") if self.scorer.served is not None else None
        self.held: dict = {}  # id(message) -> (message, WorkItem): pulled, not yet acked (nats messages do not hash)
        self.health.held = lambda: [it for _, it in self.held.values()]  # the heartbeat lists them: a silent worker's items are asked for again

    @property
    def version(self) -> int | None:
        return self.health.version

    @property
    def groups_published(self) -> int:
        return self.health.groups_published

    async def _load_version(self, version: int) -> float | None:
        """Loads snapshot `version`; returns seconds taken, or None when the snapshot is refused
        (recorded in the heartbeat, which tells the trainer)."""
        path = await snapshot_path(self.transport, version, self.weights_root)
        t0 = time.time()
        try:
            state, manifest = await asyncio.to_thread(load_verified_with_manifest, path)
            probe = manifest.get("probe")
            if self.version is None and self.arrival.wants_base(probe) and hasattr(self.engine, "probe_logprobs"):  # still the base
                self.arrival.calibrate(probe, await asyncio.to_thread(self.engine.probe_logprobs, probe["sequences"]))
            await asyncio.to_thread(self.engine.load_state_dict, state)
        except (CorruptSnapshotError, ValueError) as err:
            self.backoff = await report_refusal(self.transport, self.health, version, str(err))
            return None
        check = self.arrival
        difference = await asyncio.to_thread(check_arrival, self.engine, manifest, version, check.tolerance, self.worker_id, check.why)
        self.health.loaded(version)
        arrived = "" if difference is None else f" (probe log-probs within {difference:.1e} of the trainer's, mean per token)"
        log.info("worker %s loaded weights v%d in %.3fs%s", self.worker_id, version, time.time() - t0, arrived)
        return time.time() - t0

    async def _back_off(self, msgs: list) -> None:
        """After a refusal: the items go back to the queue, and this worker waits before trying again."""
        for m in msgs:
            await m.nak(delay=self.backoff)
        await asyncio.sleep(self.backoff)

    async def run(self) -> None:
        heartbeat = asyncio.create_task(beat(self.transport, self.health))
        # every work item this worker holds (pulled, not yet acked) has its ack deadline extended
        keep_alive = asyncio.create_task(keep_in_progress(lambda: [m for m, _ in self.held.values()], self.cfg.transport.ack_wait_seconds / 3))
        publisher = GroupPublisher(self.transport, self.health, self.held)
        leaving = "failing"
        try:
            await self._serve(publisher)
            leaving = ""
        except asyncio.CancelledError:
            leaving = "stopping (SIGTERM)"
            raise
        finally:
            keep_alive.cancel()
            heartbeat.cancel()
            publisher.discard()
            if leaving:
                await hand_back(self.transport, self.health, list(self.held.values()), leaving)
                self.held.clear()
            if self.scoring is not None:
                self.scoring.shutdown(wait=False, cancel_futures=True)
            if self.agent is not None:
                self.agent.close()  # its tools' process

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
                    sub, pull_size(self.cfg, self.prompt_tokens), timeout=1.0, linger=FETCH_LINGER_SECONDS, linger_after_wait_only=True
                ),
                self.worker_id,
            )
            publisher.raise_if_failed()
            if not pulled:
                continue
            log_taken(self.worker_id, pulled)
            iteration = pulled[0][1].iteration
            for m, it in pulled:
                if it.iteration != iteration:
                    await m.nak()  # another iteration: handle it on a later pull
            pulled = [(m, it) for m, it in pulled if it.iteration == iteration]
            version = await version_to_generate(self.transport, self.cfg, pulled[0][1])
            if version is None:
                log.info("worker %s: dropping %d obsolete work item(s) of iteration %d", self.worker_id, len(pulled), iteration)
                for m, _ in pulled:
                    await m.ack()
                continue
            msgs, items = [m for m, _ in pulled], [it for _, it in pulled]
            self.held.update((id(m), (m, it)) for m, it in pulled)  # held from here on: a long weight load must not let them go to another worker
            self.health.changed.set()  # a heartbeat at once lists them (a worker killed now has its items asked for again)
            new_version = self.version != version
            load_seconds = await self._load_version(version) if new_version else 0.0
            if load_seconds is None:
                for m in msgs:  # else the in-progress acks would hold the nak'd items past the back-off
                    del self.held[id(m)]
                await self._back_off(msgs)
                continue
            idle = time.time() - idle_since - load_seconds
            # the first pull of an iteration starts with a small call: the trainer waits on its first groups
            first = self.cfg.rollout.first_call_groups if new_version else None
            calls = generate_group_calls(
                self.engine, self.tokenizer, self.scorer, items, self.cfg, self.version, self.worker_id, None, first, self.agent, self.scoring
            )
            taken = [0]  # groups of this pull handed to the publisher so far
            # each call's groups are scored, then published (and their items acked), while the engine runs the next call
            while (pending := await asyncio.to_thread(next, calls, None)) is not None:
                publisher.raise_if_failed()
                publisher.submit(self._scored(pending, msgs, taken, load_seconds, idle))
                raise_if_stop_requested(self.stop_requested)  # the rest of the items go back, not into another engine call
            idle_since = time.time()

    async def _scored(self, pending, msgs: list, taken: list[int], load_seconds: float, idle: float) -> list[tuple[Group, object]]:
        """One engine call's groups (or a Future of them, being scored), paired with their work items'
        messages. The publisher runs these in order, so `taken` counts the pull's groups before this call's."""
        groups = await asyncio.wrap_future(pending) if isinstance(pending, Future) else pending
        start = taken[0]
        taken[0] += len(groups)
        self.prompt_tokens = max([self.prompt_tokens, *(len(g.prompt_ids) for g in groups)])
        for j, g in enumerate(groups):
            g.weight_load_seconds = load_seconds if start + j == 0 else 0.0
            g.worker_idle_seconds = idle if start + j == 0 else 0.0
        return list(zip(groups, msgs[start : start + len(groups)]))


class GroupPublisher:
    """Publishes finished groups and then acks their work items, in order, on the event loop, so the
    engine's next call does not wait for them. An item is acked only after its group is published
    (a worker that dies in between loses nothing: the item is redelivered); a failed publish fails
    the worker at its next check (`raise_if_failed`) or `drain`."""

    def __init__(self, transport: Transport, health: WorkerHealth, held: dict):
        self.transport, self.health, self.held = transport, health, held
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
            await msg.ack()
            del self.held[id(msg)]
            self.health.groups_published += 1

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

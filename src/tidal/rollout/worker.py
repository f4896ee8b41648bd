"""The rollout worker: pull work items, generate G samples each, score, publish the group, ack.

It never waits for a whole batch: each finished group goes out at once, and a work item is
acknowledged only after its group is published, so a worker that dies loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import numpy as np

from tidal.config import TidalConfig
from tidal.data import prompt_encoder
from tidal.rewards import RewardScorer, exact_match
from tidal.rollout.engine import GroupRequest, RolloutEngine, group_generator, group_seed
from tidal.transport import Transport, keep_in_progress
from tidal.transport.codec import decode
from tidal.weights import CorruptSnapshotError, load_verified, version_dir_name

log = logging.getLogger(__name__)


def work_item(iteration: int, problem) -> dict:
    return {"iteration": iteration, "prompt_id": problem.id, "prompt": problem.prompt, "answer": problem.answer}


def build_group(
    item: dict, prompt: list[int], samples: list, tokenizer, scorer: RewardScorer, policy_version: int, worker_id: str, gen_start: float, gen_end: float
) -> dict:
    """The group message of one work item: its G samples scored, with the version that generated them."""
    errors_before = scorer.errors
    responses = []
    for s in samples:
        text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
        reward, parts = scorer.score(text, item["answer"])
        responses.append(
            {
                "token_ids": np.asarray(s.token_ids, dtype=np.int32),
                "logprobs": np.asarray(s.logprobs, dtype=np.float32),
                "finish_reason": s.finish_reason,
                "reward": reward,
                "reward_parts": parts,
                "correct": exact_match(text, item["answer"]),
            }
        )
    return {
        "iteration": item["iteration"],
        "prompt_id": item["prompt_id"],
        "policy_version": policy_version,
        "worker_id": worker_id,
        "prompt_ids": np.asarray(prompt, dtype=np.int32),
        "responses": responses,
        "gen_start": gen_start,
        "gen_end": gen_end,
        "reward_errors": scorer.errors - errors_before,
    }


def generate_groups(
    engine: RolloutEngine, tokenizer, scorer: RewardScorer, items: list[dict], cfg: TidalConfig, policy_version: int, worker_id: str
) -> list[dict]:
    """Generates and scores one group per work item. Deterministic mode: one group per engine call,
    with the group's own RNG, so samples depend on (seed, iteration, prompt id) alone."""
    chunk = 1 if cfg.rollout.deterministic else cfg.rollout.groups_per_batch
    encode = prompt_encoder(tokenizer, cfg.data)
    groups = []
    for start in range(0, len(items), chunk):
        batch = items[start : start + chunk]
        prompts = [encode(it["prompt"]) for it in batch]
        requests = [
            GroupRequest(
                p,
                cfg.rollout.group_size,
                group_generator(cfg.seed, it["iteration"], it["prompt_id"]),
                group_seed(cfg.seed, it["iteration"], it["prompt_id"]) if cfg.rollout.deterministic else None,
            )
            for p, it in zip(prompts, batch)
        ]
        gen_start = time.time()
        outputs = engine.generate(requests)
        gen_end = time.time()
        for item, prompt, samples in zip(batch, prompts, outputs):
            groups.append(build_group(item, prompt, samples, tokenizer, scorer, policy_version, worker_id, gen_start, gen_end))
    return groups


class RolloutWorker:
    def __init__(self, cfg: TidalConfig, engine: RolloutEngine, tokenizer, transport: Transport, worker_id: str):
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.transport = transport
        self.worker_id = worker_id
        self.scorer = RewardScorer.from_config(cfg.reward)
        self.version: int | None = None
        self.groups_published = 0

    async def _load_version(self, version: int) -> float | None:
        """Loads snapshot `version`; returns seconds taken, or None when the snapshot is refused."""
        policy = await self.transport.wait_for_policy(version)
        t0 = time.time()
        path = os.path.join(os.path.dirname(policy["uri"]), version_dir_name(version))
        try:
            state = await asyncio.to_thread(load_verified, path)
            await asyncio.to_thread(self.engine.load_state_dict, state)
        except (CorruptSnapshotError, ValueError) as err:
            log.error("worker %s refused weights v%d: %s (keeping v%s)", self.worker_id, version, err, self.version)
            await self.transport.put(f"errors.{self.worker_id}", {"version": version, "error": str(err), "time": time.time()})
            return None
        self.version = version
        log.info("worker %s loaded weights v%d in %.3fs", self.worker_id, version, time.time() - t0)
        return time.time() - t0

    async def run(self) -> None:
        sub = await self.transport.work_subscription()
        batch_size = 1 if self.cfg.rollout.deterministic else self.cfg.rollout.groups_per_batch
        idle_since = time.time()
        while True:
            if await self.transport.stopping():
                log.info("worker %s: the run or round is over, exiting", self.worker_id)
                return
            msgs = await self.transport.fetch(sub, batch_size, timeout=1.0)
            if not msgs:
                continue
            items = [decode(m.data) for m in msgs]
            iteration = items[0]["iteration"]
            same = [(m, it) for m, it in zip(msgs, items) if it["iteration"] == iteration]
            for m, it in zip(msgs, items):
                if it["iteration"] != iteration:
                    await m.nak()  # another version: handle it on a later pull
            msgs, items = [m for m, _ in same], [it for _, it in same]
            load_seconds = 0.0
            if self.version != iteration:
                taken = await self._load_version(iteration)
                if taken is None:
                    for m in msgs:
                        await m.nak(delay=1.0)
                    continue
                load_seconds = taken
            idle = time.time() - idle_since - load_seconds
            keep_alive = asyncio.create_task(keep_in_progress(msgs, self.cfg.transport.ack_wait_seconds / 3))
            try:
                groups = await asyncio.to_thread(generate_groups, self.engine, self.tokenizer, self.scorer, items, self.cfg, self.version, self.worker_id)
            finally:
                keep_alive.cancel()
            for i, (m, g) in enumerate(zip(msgs, groups)):
                g["weight_load_seconds"] = load_seconds if i == 0 else 0.0
                g["worker_idle_seconds"] = idle if i == 0 else 0.0
                await self.transport.publish_group(g)
                await m.ack()
                self.groups_published += 1
            idle_since = time.time()

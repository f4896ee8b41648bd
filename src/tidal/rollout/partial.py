"""Partial rollouts (`rollout.partial`, bounded mode): new weights mid-response.

While a worker generates the items of iteration i with version v, the trainer may publish v+1 (<= i).
The engine is asked between decode steps (`Refresh.interrupt`); when a newer version waits, the rows
still sampling stop at that token boundary, the worker loads the new version through the arrival path
(its probe check included, `Refresh.swap`), and each stopped row continues from its prompt and the
tokens it has so far, with the new weights: a fresh prefill, so every later token's log-prob is the new
weights' own. Each token keeps the version and the behaviour log-prob it was sampled with
(`Completion.versions`); the group's `policy_version` stays the version it started with, the oldest
among its tokens, which the trainer's staleness bound applies to.

The HF engine stops between decode steps rather than at a turn boundary: a single-turn response has
one turn, so a turn boundary would never come before the response ends. The vLLM engine streams each
group's request and aborts it (tidal.rollout.vllm_partial); its stopped rows resume as requests of
their own. This module runs single-turn calls; multi-turn ones (rollout.agent) stop, load and go on
inside their turn loops (HF: trajectory.play_rows, hf_rows.HFRows.reload; vLLM: each turn's request,
vllm_partial.TurnSwaps), since their rows are between turns as often as in one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from tidal.rollout.arrival import WeightArrival
from tidal.rollout.engine import INTERRUPTED, Completion, GroupRequest, RolloutEngine, turn_seed
from tidal.rollout.refresh import Refresh
from tidal.transport import Transport

log = logging.getLogger(__name__)


def continuation(request: GroupRequest, sampled: list[int], row: int, stop: int) -> GroupRequest:
    """Row `row`'s request after its `stop`-th stop: its prompt and the tokens it has so far, one row, the
    group's RNG (HF) or in deterministic mode the seed `turn_seed(group seed, row, stop)` (vLLM), the
    prompt's images (the continuation's prefill encodes them again, under the new weights)."""
    seed = None if request.seed is None else turn_seed(request.seed, row, stop)
    return GroupRequest([*request.prompt_ids, *sampled], 1, request.generator, seed, images=request.images, image_files=request.image_files)


def joined(before: Completion, after: Completion, start_version: int, after_version: int) -> Completion:
    """A row's tokens so far (all of `start_version` when they carry no versions yet) followed by what the
    continuation sampled with `after_version`, each token with its version."""
    versions = before.versions if before.versions is not None else [start_version] * len(before.token_ids)
    return Completion(
        [*before.token_ids, *after.token_ids],
        [*before.logprobs, *after.logprobs],
        after.finish_reason,
        [*versions, *([after_version] * len(after.token_ids))],
    )


async def complete_partial(engine: RolloutEngine, requests: list[GroupRequest], max_new_tokens: int, refresh: Refresh) -> list[list[Completion]]:
    """engine.complete(requests), where rows stopped for newer weights continue with them until every
    row has ended (EOS or max_new_tokens). A row that changed version carries its per-token versions."""
    start = refresh.version
    outputs = [list(group) for group in await engine.complete(requests, interrupt=refresh.interrupt)]
    stops: dict[tuple[int, int], int] = {}
    while stopped := [(g, i) for g, group in enumerate(outputs) for i, c in enumerate(group) if c.finish_reason == INTERRUPTED]:
        after = await refresh.swap()
        for row in stopped:
            stops[row] = stops.get(row, 0) + 1
        for left in sorted({max_new_tokens - len(outputs[g][i].token_ids) for g, i in stopped}):
            rows = [(g, i) for g, i in stopped if max_new_tokens - len(outputs[g][i].token_ids) == left]
            more = await engine.complete(
                [continuation(requests[g], outputs[g][i].token_ids, i, stops[g, i]) for g, i in rows],
                max_new_tokens=left,
                interrupt=refresh.interrupt,
            )
            for (g, i), (c,) in zip(rows, more, strict=True):
                outputs[g][i] = joined(outputs[g][i], c, start, after)
    return outputs


class PolicyRefresh:
    """A worker's Refresh while it generates iteration `iteration`: a task watches the KV policy pointer,
    and a version above the engine's (at most `iteration`: later ones make the item obsolete) waits."""

    def __init__(self, transport: Transport, arrival: WeightArrival, iteration: int, version: int):
        self.transport, self.arrival, self.iteration, self.version = transport, arrival, iteration, version
        self.waiting = threading.Event()
        self.target: int | None = None
        self.refused = version  # a refused snapshot is not asked for again
        self.watcher: asyncio.Task | None = None

    @classmethod
    def started(cls, transport: Transport, arrival: WeightArrival, iteration: int, version: int) -> PolicyRefresh:
        refresh = cls(transport, arrival, iteration, version)
        refresh._watch()
        return refresh

    def _watch(self) -> None:
        if self.version < self.iteration:
            self.watcher = asyncio.create_task(self._wait_for_newer(max(self.version, self.refused) + 1))

    async def _wait_for_newer(self, version: int) -> None:
        policy = await self.transport.wait_for_policy(version)
        if policy.version <= self.iteration:
            self.target = policy.version
            self.waiting.set()

    def interrupt(self) -> bool:
        return self.waiting.is_set()

    async def swap(self) -> int:
        target, self.target = self.target, None
        self.waiting.clear()
        if target is not None and target > self.version:
            if await self.arrival.load(target) is None:
                log.warning(
                    "worker %s: weights v%d refused mid-rollout; its responses go on with v%d", self.arrival.health.worker_id, target, self.version
                )
                self.refused = target
            else:
                self.version = target
        self._watch()
        return self.version

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watcher

"""Scoring groups that finish one by one (the vLLM engine's groups), batched across groups.

A group whose generation ended waits here while the scorer is busy with earlier ones; the scorer
then takes everything that waited, up to `max_samples` samples (always at least one group), in one
call. No group waits for a batch to fill: a lone group is scored at once, and a batch is what piled
up while a request was out, so a served reward model gets requests of many groups when it is the
bottleneck and single groups when it is not. One scoring call runs at a time, on the given
executor's thread (reward code may be slow and blocking)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Waiting:
    entry: Any
    samples: int
    future: asyncio.Future = field(repr=False)


def take_batch(waiting: list[Waiting], max_samples: int) -> list[Waiting]:
    """The longest prefix of `waiting` within `max_samples` samples, and at least its first entry."""
    batch, total = [], 0
    for w in waiting:
        if batch and total + w.samples > max_samples:
            break
        batch.append(w)
        total += w.samples
    return batch


class GroupScoringQueue:
    """`await score(entry, samples)` -> what `build(entries)` returned for that entry."""

    def __init__(self, executor: Executor, build: Callable[[list[Any]], list[Any]], max_samples: int):
        self.executor = executor
        self.build = build
        self.max_samples = max_samples
        self.waiting: list[Waiting] = []
        self.draining: asyncio.Task | None = None

    async def score(self, entry: Any, samples: int) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(Waiting(entry, samples, future))
        if self.draining is None or self.draining.done():
            self.draining = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.waiting:
            batch = take_batch(self.waiting, self.max_samples)
            del self.waiting[: len(batch)]
            live = [w for w in batch if not w.future.done()]  # a caller cancelled meanwhile (a preempted worker)
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self.executor, self.build, [w.entry for w in live])
            except Exception as err:  # noqa: BLE001 - each caller gets the error, as if it had scored alone
                for w in live:
                    if not w.future.done():
                        w.future.set_exception(err)
                continue
            for w, result in zip(live, results, strict=True):
                if not w.future.done():
                    w.future.set_result(result)

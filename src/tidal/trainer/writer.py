"""Makes each iteration boundary durable off the trainer's critical path.

After the optimizer step the trainer publishes weights v+1 (the workers wait for them), then hands
the rest of the boundary to one writer thread: groups.jsonl, the optimizer checkpoint (fsynced),
snapshot retention, and only then the acks of v's groups. So the next iteration generates and
trains while v is being written, and nothing is acknowledged before its checkpoint is on disk: a
trainer killed before the write is done gets v's groups again and redoes v.
MLflow logging has a thread of its own, so a slow tracking server delays neither.
Jobs run in submission order; a failed one is raised at the next boundary, or at the end.

Only at one trainer rank: the checkpoint of several ranks has barriers, and collectives from two
threads of one process group could interleave with the next iteration's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from tidal.trainer.compute import on_compute_thread

log = logging.getLogger(__name__)


class BoundaryWriter:
    def __init__(self, background: bool):
        self.background = background
        self.files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-writer") if background else None
        self.tracking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-tracking") if background else None
        self.pending: list[asyncio.Future] = []

    async def make_durable(self, write: Callable[[], None], then: Callable[[], Awaitable[None]]) -> None:
        """Runs `write` (files) and, once it returned, `then` (the acks): now, or in the background."""
        self.raise_failures()
        if not self.background:
            await on_compute_thread(write)
            await then()
            return
        written = asyncio.get_running_loop().run_in_executor(self.files, write)

        async def acknowledge() -> None:
            await written
            await then()

        self.pending.append(asyncio.ensure_future(acknowledge()))

    def log_metrics(self, tracker, metrics: dict, step: int) -> None:
        if tracker is None:
            return
        if not self.background:
            tracker.log(metrics, step=step)
            return
        self.pending.append(asyncio.get_running_loop().run_in_executor(self.tracking, tracker.log, metrics, step))

    def raise_failures(self) -> None:
        """The first failure of a finished background job, raised here (the others stay pending)."""
        for job in [j for j in self.pending if j.done()]:
            self.pending.remove(job)
            job.result()

    async def drain(self) -> None:
        """Waits for every job; the first failure is raised after all have ended."""
        jobs, self.pending = self.pending, []
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

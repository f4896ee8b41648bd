"""One thread for the trainer's tensor work, so the event loop stays free for NATS (keep-alive,
acks) while a micro-batch trains.

Always the same thread: each thread that runs torch ops gets its own OpenMP team, whose threads
spin for a while after every parallel region. Work spread over asyncio's default pool (several
threads) left idle teams spinning on the cores the next phase needed, which slowed that phase
(sync mode's generation) down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_COMPUTE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-compute")


async def on_compute_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_COMPUTE, fn, *args)

"""Running a coroutine to completion from code where no event loop runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def run_blocking(awaitable: Awaitable[T]) -> T:
    """`asyncio.run(awaitable)`'s value, handed back outside the task. On the main thread `asyncio.run`
    ends by asking `signal.getsignal` whether its SIGINT handler is still installed, and on Python 3.11
    that builds (and drops) an error message holding the handler's repr: the main task, with its result.
    A result of groups or trajectories is then printed in full, numpy arrays and all, on every call
    (about a tenth of a multi-turn engine call's time); this task's result is None."""
    box: list[T] = []

    async def keep() -> None:
        box.append(await awaitable)

    asyncio.run(keep())
    return box[0]

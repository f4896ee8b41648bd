"""tidal.blocking.run_blocking: asyncio.run's value, with nothing of it left in the task asyncio.run reprs."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tidal.blocking import run_blocking


class Loud:
    reprs = 0

    def __repr__(self) -> str:
        Loud.reprs += 1
        return "Loud()"


async def loud() -> Loud:
    await asyncio.sleep(0)
    return Loud()


def test_the_value_comes_back_and_is_never_printed_by_asyncio_run():
    Loud.reprs = 0
    assert isinstance(run_blocking(loud()), Loud)
    assert Loud.reprs == 0
    # what it avoids: on the main thread, asyncio.run's own result is printed when it checks its SIGINT handler
    # (Python 3.11's signal.getsignal builds an error message holding the handler's repr, the task's result in it)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        asyncio.run(loud())
        assert Loud.reprs >= 1


def test_an_exception_comes_through():
    async def fails():
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        run_blocking(fails())

"""`session` and `run_in_session`: one job on a connection, against a real nats-server; the connection is
closed however the job ends."""

import asyncio
import time

import pytest

from tidal.config import TransportConfig
from tidal.protocol import RunState
from tidal.transport import Transport, run_in_session, session

RUN = "session"


class Boom(RuntimeError):
    pass


def test_a_session_closes_its_connection_when_the_body_raises(nats_server):
    opened: list[Transport] = []

    async def scenario():
        async with session(nats_server.url, RUN, TransportConfig(), create=True) as t:
            opened.append(t)
            await t.put_run_state(RunState.RUNNING)
            assert t.nc.is_connected
            raise Boom("the job failed")

    with pytest.raises(Boom, match="the job failed"):
        asyncio.run(scenario())
    assert len(opened) == 1 and opened[0].nc.is_closed


def test_run_in_session_returns_the_jobs_result_and_each_call_has_its_own_loop_and_connection(nats_server):
    cfg = TransportConfig()
    opened: list[Transport] = []

    async def put(t: Transport) -> str:
        opened.append(t)
        await t.put_run_state(RunState.ROUND_DONE, 2)
        return "put"

    async def read(t: Transport):
        opened.append(t)
        return await t.run_status()

    assert run_in_session(nats_server.url, RUN, cfg, put, create=True) == "put"
    status = run_in_session(nats_server.url, RUN, cfg, read)  # create=False: the bucket the first call made
    assert (status.state, status.round) == (RunState.ROUND_DONE, 2)
    assert len(opened) == 2 and opened[0] is not opened[1] and all(t.nc.is_closed for t in opened)


def test_run_in_session_raises_the_jobs_error_after_closing(nats_server):
    opened: list[Transport] = []

    async def fail(t: Transport):
        opened.append(t)
        raise Boom("no")

    with pytest.raises(Boom):
        run_in_session(nats_server.url, RUN, TransportConfig(), fail, create=True)
    assert opened[0].nc.is_closed


def test_run_in_session_gives_up_at_its_timeout_and_closes_the_connection(nats_server):
    opened: list[Transport] = []

    async def stuck(t: Transport):
        opened.append(t)
        await asyncio.sleep(60)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        run_in_session(nats_server.url, RUN, TransportConfig(), stuck, create=True, timeout=1.0)
    assert time.monotonic() - started < 10
    assert len(opened) == 1 and opened[0].nc.is_closed

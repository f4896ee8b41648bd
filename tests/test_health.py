"""Worker heartbeats and snapshot-refusal back-off (#15 item 5): the pure parts, and the KV round trip
on a real nats-server."""

import asyncio

from tidal.config import TransportConfig
from tidal.protocol import WorkItem
from tidal.transport import Transport
from tidal.transport.health import WorkerHealth, abandoned_work, describe_workers, refusal_backoff, silent_workers


def test_the_refusal_backoff_doubles_to_a_cap():
    assert [refusal_backoff(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_refusals_count_per_version_and_a_load_clears_them():
    health = WorkerHealth("w0")
    assert health.refused(3, "bad") == 1.0 and health.refused(3, "bad") == 2.0
    assert health.refused(4, "bad") == 1.0 and health.refusals == 1  # another version starts again
    health.loaded(4)
    assert health.record()["refused_version"] is None and health.version == 4


def test_a_silent_worker_is_named_with_how_long_and_what_it_held():
    now = 1000.0
    alive, dead = WorkerHealth("w0", pid=1, host="h"), WorkerHealth("w1", pid=2, host="h")
    alive.loaded(3)
    dead.refused(2, "snapshot x: model.safetensors sha256 … does not match")
    records = [alive.record(now - 0.5), dead.record(now - 40)]
    assert [r["worker_id"] for r in silent_workers(records, now)] == ["w1"]
    text = describe_workers(records, now)
    assert "worker w0 (pid 1 on h): alive (0.5s ago), holds v3" in text
    assert "worker w1 (pid 2 on h): silent for 40s, holds vNone, 0 groups published, refused v2 1x: snapshot x" in text
    assert describe_workers([], now) == "no rollout worker has sent a heartbeat"


def beat(worker_id: str, pid: int, at: float, holding: list[tuple[int, int]]) -> dict:
    health = WorkerHealth(worker_id, pid=pid, host="h")
    health.held = lambda: [WorkItem(i, p, "prompt", "answer") for i, p in holding]
    return health.record(at)


def test_the_items_a_silent_or_replaced_worker_held_are_handed_out_once():
    """#15 item 5: what the last heartbeat listed goes out again when the worker falls silent, or when
    another process (the launcher's restart) took its id before it was seen silent; a previous
    launch's stale records hand out nothing."""
    stale = beat("w9", 9, 0.0, [(0, 4)])
    alive, keys = abandoned_work({}, [beat("w0", 1, 99.0, [(1, 7), (1, 8)]), beat("w1", 2, 99.0, [(1, 9)]), stale], now=100.0)
    assert keys == [] and set(alive) == {"w0", "w1"}
    # w0 is silent (its items go out), w1 was restarted by the launcher: a new pid under its id
    alive, keys = abandoned_work(alive, [beat("w0", 1, 99.0, [(1, 7), (1, 8)]), beat("w1", 3, 104.0, []), stale], now=105.0)
    assert keys == [(1, 7), (1, 8), (1, 9)] and set(alive) == {"w1"}
    alive, keys = abandoned_work(alive, [beat("w0", 1, 99.0, [(1, 7), (1, 8)]), beat("w1", 3, 105.0, []), stale], now=106.0)
    assert keys == []  # once


def test_heartbeats_round_trip_through_the_run_kv_bucket(nats_server):
    async def scenario():
        transport = await Transport.connect(nats_server.url, "health", TransportConfig())
        try:
            assert await transport.worker_health() == []
            health = WorkerHealth("worker-0")
            health.refused(5, "corrupt")
            await transport.put_worker_health(health.record())
            await transport.put_worker_health(WorkerHealth("worker-1").record())
            await transport.put("workers.junk", {"not": "a heartbeat"})  # skipped, not fatal
            records = sorted(await transport.worker_health(), key=lambda r: r["worker_id"])
            assert [r["worker_id"] for r in records] == ["worker-0", "worker-1"]
            assert records[0]["refused_version"] == 5 and records[0]["refusals"] == 1
        finally:
            await transport.close()

    asyncio.run(scenario())


def test_tail_threads_resolve_only_where_tidal_run_said_whose_cores_are_free(monkeypatch, tiny_config_dict):
    import copy

    from tidal.config import config_from_dict
    from tidal.runtime import TAIL_THREADS_ENV, tail_threads

    def cfg(**trainer):
        data = copy.deepcopy(tiny_config_dict)
        data["trainer"].update(trainer)
        return config_from_dict(data)

    monkeypatch.delenv(TAIL_THREADS_ENV, raising=False)
    assert tail_threads(cfg(), 1) is None  # auto in a pod: unknown
    monkeypatch.setenv(TAIL_THREADS_ENV, "2")
    assert tail_threads(cfg(), 1) == 2
    assert tail_threads(cfg(), 2) is None  # no more than it has
    assert tail_threads(cfg(tail_threads=None), 1) is None
    assert tail_threads(cfg(tail_threads=4), 1) == 4
    bounded = copy.deepcopy(tiny_config_dict) | {"mode": "bounded"}
    assert tail_threads(config_from_dict(bounded), 1) is None  # bounded workers generate ahead: not idle


def test_tail_threads_widen_and_narrow_the_trainers_thread_pool():
    import torch

    from tidal.trainer.compute import on_compute_thread
    from tidal.trainer.loop import TailThreads

    async def scenario():
        threads = TailThreads(1, 2)
        await on_compute_thread(torch.set_num_threads, 1)
        await threads.widen()
        wide = await on_compute_thread(torch.get_num_threads)
        await threads.narrow()
        return wide, await on_compute_thread(torch.get_num_threads)

    before = torch.get_num_threads()
    try:
        assert asyncio.run(scenario()) == (2, 1)
    finally:
        torch.set_num_threads(before)

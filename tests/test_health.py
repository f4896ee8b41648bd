"""Worker heartbeats and snapshot-refusal back-off: the pure parts, and the KV round trip
on a real nats-server."""

import asyncio

from tidal.config import TransportConfig
from tidal.protocol import WorkItem
from tidal.transport import Transport
from tidal.transport.health import WorkerHealth, describe_workers, refusal_backoff, watch_workers


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
    text = describe_workers(records, now)
    assert "worker w0 (pid 1 on h): alive (0.5s ago), holds v3" in text
    assert "worker w1 (pid 2 on h): silent for 40s, holds vNone, 0 groups published, refused v2 1x: snapshot x" in text
    assert describe_workers([], now) == "no rollout worker has sent a heartbeat"
    gone = WorkerHealth("w2", pid=3, host="h")
    gone.left = True
    assert "worker w2 (pid 3 on h): left 12s ago, its work handed back" in describe_workers([gone.record(now - 12)], now)


def worker(worker_id: str, holding: list[tuple[int, int]]) -> WorkerHealth:
    health = WorkerHealth(worker_id, host="h")
    health.held = lambda: [WorkItem(i, p, "prompt", "answer") for i, p in holding]
    return health


def test_the_items_a_silent_or_replaced_worker_held_are_handed_out_once():
    """what the last heartbeat listed goes out again when the worker falls silent, or when
    another process (the launcher's restart) took its id before it was seen silent, also one the
    trainer saw only once (killed right after its pull); each listing once."""
    w0, w1, w2 = worker("w0", [(1, 7), (1, 8)]), worker("w1", [(1, 9)]), worker("w2", [(1, 3)])
    watched, silent, keys = watch_workers({}, [w0.record(), w1.record(), w2.record()], now=100.0)
    assert keys == [] and silent == []
    w0_last = w0.record()
    watched, silent, keys = watch_workers(watched, [w0_last, w1.record(), w2.record()], now=101.0)
    assert keys == [] and silent == []  # all beat
    # w0 stops beating; w1 is restarted by the launcher: a new process under its id, before it was seen silent
    w1_again = worker("w1", [])
    watched, silent, keys = watch_workers(watched, [w0_last, w1_again.record(), w2.record()], now=103.0)
    assert keys == [(1, 9)] and silent == []
    watched, silent, keys = watch_workers(watched, [w0_last, w1_again.record(), w2.record()], now=104.5)
    assert keys == [(1, 7), (1, 8)] and [r["worker_id"] for r in silent] == ["w0"]
    watched, silent, keys = watch_workers(watched, [w0_last, w1_again.record(), w2.record()], now=110.0)
    assert keys == [] and [r["worker_id"] for r in silent] == ["w0"]  # once
    # a worker seen once, then replaced: its items go out at once too
    w3 = worker("w3", [(2, 5)])
    watched, silent, keys = watch_workers(watched, [w3.record()], now=111.0)
    watched, silent, keys = watch_workers(watched, [worker("w3", []).record()], now=112.0)
    assert keys == [(2, 5)]


def test_silence_is_measured_on_the_trainers_clock_not_the_workers():
    """A worker host whose clock is 30 s behind the trainer's is alive while its beats keep changing;
    after a NATS restart the trainer may read beats written before it: they are stale only once they
    stop changing for SILENT_AFTER_SECONDS of the trainer's own time."""
    skewed = worker("w0", [(2, 1)])
    watched, silent, keys = watch_workers({}, [skewed.record(970.0)], now=1000.0)
    for now in (1001.0, 1002.0, 1003.0, 1004.0):
        watched, silent, keys = watch_workers(watched, [skewed.record(now - 30.0)], now=now)
        assert silent == [] and keys == []
    last = skewed.record(975.0)  # an old beat, read again after a reconnect
    watched, silent, keys = watch_workers(watched, [last], now=1005.0)
    watched, silent, keys = watch_workers(watched, [last], now=1007.0)
    assert silent == [] and keys == []  # 2 s unchanged: not yet
    watched, silent, keys = watch_workers(watched, [last], now=1008.5)
    assert [r["worker_id"] for r in silent] == ["w0"] and keys == [(2, 1)]


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


def test_tail_threads_resolve_only_where_tidal_run_said_whose_cores_are_free(tiny_config_dict):
    import copy

    from tidal.config import config_from_dict
    from tidal.threads import resolve_threads, split_cores
    from tidal.threads import tail_threads as tail_of

    def tail_threads(c, threads):
        return tail_of(c.trainer.tail_threads, c.mode, c.trainer.ranks, threads)

    def trainer_threads(c, ranks_here=1):
        return split_cores(c)[0] // ranks_here

    def cfg(**trainer):
        data = copy.deepcopy(tiny_config_dict)
        data["trainer"].update(trainer)
        data["rollout"]["workers"] = 1
        return config_from_dict(data)

    assert tail_threads(cfg(), 1) is None  # auto in a pod: unknown
    resolved = resolve_threads(cfg(), cores=4)  # what `tidal run` writes into the run's config.yaml
    assert (resolved.trainer.threads, resolved.rollout.threads, resolved.trainer.tail_threads) == (2, 2, 4)
    assert tail_threads(resolved, trainer_threads(resolved)) == 4  # the trainer's and its worker's cores
    assert tail_threads(resolved, 4) is None  # no more than it has
    two_ranks = resolve_threads(cfg(ranks=2, threads=2), cores=4)
    assert trainer_threads(two_ranks, 2) == 1 and tail_threads(two_ranks, 1) == 2  # per rank
    assert resolve_threads(cfg(tail_threads=None), cores=4).trainer.tail_threads is None
    assert tail_threads(cfg(tail_threads=None), 1) is None
    assert tail_threads(cfg(tail_threads=4), 1) == 4
    assert resolve_threads(cfg(tail_threads=16), cores=4).trainer.tail_threads == 4  # at most the cores
    bounded = copy.deepcopy(tiny_config_dict) | {"mode": "bounded"}
    assert tail_threads(config_from_dict(bounded), 1) is None  # bounded workers generate ahead: not idle
    assert resolve_threads(config_from_dict(bounded), cores=4).trainer.tail_threads is None


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

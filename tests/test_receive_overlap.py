"""The trainer takes groups from the queue while its learner trains (one rank): groups that arrive during
a training call go into the next call as soon as it ends. Real nats-server, real learner and loop; a
coroutine plays the worker so that the second half of the groups arrives during the first call."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np

from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.protocol import Group, Sample, decode_work_item
from tidal.roles import build_learner, group_limits
from tidal.rundir import RunDir
from tidal.trainer.loop import train
from tidal.trainer.sources import QueueSource
from tidal.transport import Transport
from tidal.weights import WeightStore

TRAIN_CALL_SECONDS = 0.5  # each training call is held this long, so the second half surely arrives during the first


def test_groups_that_arrive_while_the_learner_trains_are_received_then_and_trained_next(tmp_path, tiny_config, nats_server):
    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    learner, _ = build_learner(tiny_config, str(prepare_base_model(tiny_config, dataset)))
    base = prepare_base_model(tiny_config, dataset)
    store = WeightStore(tmp_path / "w", base)
    prompts = tiny_config.trainer.prompts_per_iteration
    calls: list[list[int]] = []  # the prompt ids of each training call
    training = asyncio.Event()  # set (thread-safely) while a training call runs
    received_while_training: list[int] = []
    real_train = learner.train_on_groups

    def slow_train(groups):
        loop.call_soon_threadsafe(training.set)
        calls.append([g.prompt_id for g in groups])
        time.sleep(TRAIN_CALL_SECONDS)
        out = real_train(groups)
        loop.call_soon_threadsafe(training.clear)
        return out

    learner.train_on_groups = slow_train

    def group_for(item) -> Group:
        sample = lambda r: Sample(np.array([7, 8], dtype=np.int32), np.array([-0.5, -0.5], dtype=np.float32), r)  # noqa: E731
        return Group(item.iteration, item.prompt_id, 0, "w", np.array([5, 6], dtype=np.int32), [sample(0.0), sample(1.0), sample(0.0), sample(1.0)])

    async def play_the_worker(transport: Transport) -> None:
        sub = await transport.work_subscription()
        pulled = []
        while len(pulled) < prompts:
            pulled += await transport.fetch(sub, prompts, timeout=1.0)
        half = prompts // 2
        for m in pulled[:half]:
            await transport.publish_group(group_for(decode_work_item(m.data)), answering=m)
            await m.ack()
        await training.wait()  # the first half is being trained: the second half arrives now
        for m in pulled[half:]:
            await transport.publish_group(group_for(decode_work_item(m.data)), answering=m)
            await m.ack()

    async def scenario():
        nonlocal loop
        loop = asyncio.get_running_loop()
        transport = await Transport.connect(nats_server.url, "overlap", tiny_config.transport)
        worker = asyncio.create_task(play_the_worker(transport))
        source = QueueSource(transport, group_limits(tiny_config, learner, transport.max_message_bytes), lambda v: str(store.path(v)))
        receive = source.receive

        async def watched_receive(version, wanted, timeout):
            arrivals = await receive(version, wanted, timeout)
            if training.is_set():
                received_while_training.extend(g.prompt_id for g in arrivals.groups)
            return arrivals

        source.receive = watched_receive
        try:
            return await asyncio.wait_for(train(tiny_config, learner, source, dataset, store, RunDir(tmp_path), None, iterations=1), 120)
        finally:
            worker.cancel()
            await transport.close()

    loop = None
    gc.unfreeze()
    (metrics,) = asyncio.run(scenario())
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    assert frozen > 0  # the trainer moved its start-up objects out of the cyclic collector's scans
    half = prompts // 2
    # the first call trains what is in when it starts (the whole first half on a quiet machine, less when the
    # machine is loaded and the trainer wakes between two publishes); everything after it comes in one call
    assert len(calls) == 2 and 1 <= len(calls[0]) <= half and len(calls[0]) + len(calls[1]) == prompts
    assert sorted(received_while_training) == sorted(calls[1])  # ... and it was taken from the queue during the first
    assert metrics["samples"] == prompts * 4 and metrics["train_seconds"] >= 2 * TRAIN_CALL_SECONDS

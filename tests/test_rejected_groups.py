"""Rejected groups in bounded mode: a rejected group of a later iteration than the one being trained (its
work was released ahead) gets its work item out again, and the answer to that item is not dropped by
JetStream as a duplicate of the rejected group. The test plays the worker, publishing as the rollout
workers do (message ids from the work message it answers); NATS, the trainer loop and the learner
are real. Without the fix, iteration 1 waits for a group that never comes and the trainer fails
after trainer.group_timeout_seconds."""

import asyncio
import copy

import numpy as np

from tidal.config import config_from_dict
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.protocol import Group, Sample, decode_work_item
from tidal.roles import build_learner, group_limits
from tidal.rundir import RunDir
from tidal.trainer.loop import train
from tidal.trainer.sources import QueueSource
from tidal.transport import Transport
from tidal.weights import WeightStore


def test_a_rejected_group_of_an_iteration_released_ahead_is_asked_for_again(tmp_path, tiny_config_dict, nats_server):
    cfg = config_from_dict(
        copy.deepcopy(tiny_config_dict)
        | {"mode": "bounded", "rollout": {**tiny_config_dict["rollout"], "max_staleness": 1}, "eval": {"enabled": False}}
    )
    cfg.trainer.iterations = 2
    cfg.trainer.group_timeout_seconds = 30.0  # a hang fails the test through the trainer's own check
    per_iteration = cfg.trainer.prompts_per_iteration
    dataset = load_dataset(cfg.data, cfg.seed)
    base = prepare_base_model(cfg, dataset)
    learner, _ = build_learner(cfg, str(base))
    store = WeightStore(tmp_path / "w", base)
    vocab = learner.model.config.vocab_size
    answered: list[tuple[int, int]] = []

    def group(iteration: int, prompt_id: int, token: int) -> Group:
        samples = [Sample(np.array([token], dtype=np.int32), np.array([-0.5], dtype=np.float32), float(i % 2)) for i in range(4)]
        return Group(iteration, prompt_id, 0, "w", np.array([5, 6], dtype=np.int32), samples)

    async def play_the_worker(transport: Transport) -> None:
        """Holds every work item until both iterations' are out (bounded mode releases iteration 1
        with iteration 0), answers iteration 1 first so the trainer sees its groups while on iteration 0,
        and answers the first item of iteration 1 with a token outside the vocabulary, once."""
        sub = await transport.work_subscription()
        held = []
        while True:
            held += [(m, decode_work_item(m.data)) for m in await transport.fetch(sub, 16, timeout=0.5)]
            if len(answered) < 2 * per_iteration and len(held) < 2 * per_iteration:
                continue
            held.sort(key=lambda pair: -pair[1].iteration)
            for m, item in held:
                bad = item.iteration == 1 and not any(key[0] == 1 for key in answered)
                answered.append((item.iteration, item.prompt_id))
                await transport.publish_group(group(item.iteration, item.prompt_id, vocab + 5 if bad else 7), answering=m)
                await m.ack()
            held = []

    async def scenario():
        transport = await Transport.connect(nats_server.url, "bounded-reissue", cfg.transport)
        worker = asyncio.create_task(play_the_worker(transport))
        try:
            source = QueueSource(transport, group_limits(cfg, learner, transport.max_message_bytes), lambda v: str(store.path(v)))
            return await train(cfg, learner, source, dataset, store, RunDir(tmp_path), None)
        finally:
            worker.cancel()
            await transport.close()

    metrics = asyncio.run(scenario())
    rejected = next(key for key in answered if key[0] == 1)
    assert answered.count(rejected) == 2 and len(answered) == 2 * per_iteration + 1  # only the rejected one again
    assert sum(m["messages_rejected"] for m in metrics) == 1
    assert [m["samples"] for m in metrics] == [per_iteration * 4] * 2

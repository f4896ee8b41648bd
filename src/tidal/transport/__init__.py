"""NATS JetStream: the WORK and ROLLOUTS streams and the run's KV bucket (DESIGN §2)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass

import nats
import nats.errors
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NoKeysError, NotFoundError, ServiceUnavailableError

from tidal.config import TransportConfig
from tidal.protocol import (
    Group,
    KVKey,
    PolicyPointer,
    ProtocolError,
    RunState,
    RunStatus,
    WorkItem,
    pack,
    policy_pointer_from,
    run_status_from,
    unpack,
)
from tidal.transport.server import TOKEN_ENV

log = logging.getLogger(__name__)

WORKERS_CONSUMER = "workers"
TRAINER_CONSUMER = "trainer"
# How long an idempotent request (a KV put or get, a de-duplicated publish) is retried through a NATS
# outage, e.g. the launcher restarting a killed nats-server; the client reconnects by itself meanwhile.
OUTAGE_SECONDS = 60.0
TRANSIENT_ERRORS = (NatsTimeout, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError, ServiceUnavailableError)


class MessageTooLargeError(ValueError):
    """A message exceeds the server's max_payload."""


def stream_names(run_id: str) -> dict[str, str]:
    token = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)
    return {
        "work_stream": f"TIDAL_{token}_WORK",
        "work_subject": f"tidal.{token}.work",
        "rollouts_stream": f"TIDAL_{token}_ROLLOUTS",
        "rollouts_subject": f"tidal.{token}.rollouts",
        "kv_bucket": f"TIDAL_{token}",
    }


def group_msg_id(group: Group, answering=None) -> str:
    """A group's message id: g-{iteration}-{prompt}, plus the `-rN` of a work item the trainer asked
    for again after a rejected group, so the answer is not dropped as a duplicate of the rejected one.
    A redelivered item has its first message id, so its group is still stored once."""
    work_id = (getattr(answering, "headers", None) or {}).get("Nats-Msg-Id", "")
    again = re.search(r"-r\d+$", work_id)
    return group.msg_id + (again.group(0) if again else "")


async def _fetch_once(sub, batch: int, timeout: float) -> list:
    try:
        return await sub.fetch(batch, timeout=timeout)
    except (TimeoutError, NatsTimeout):
        return []


async def keep_in_progress(msgs, every: float) -> None:
    """Extends the ack deadline of held messages (`msgs` is read afresh each round) until cancelled."""
    while True:
        await asyncio.sleep(every)
        for m in list(msgs() if callable(msgs) else msgs):
            try:
                await m.in_progress()
            except Exception as err:  # noqa: BLE001 - one lost extension (NATS restarting) must not end the keep-alive for good
                log.warning("could not extend a held message's ack deadline (%s); retrying in %.0fs", err, every)


class NatsUnavailableError(ConnectionError):
    """NATS cannot be reached, refused this client, or the connection to it was lost for good."""


class NatsPermissionError(PermissionError):
    """The server refused this client's user a publish or subscribe (a "Permissions Violation"): on a
    cluster each role logs in as its own user, with only the subjects that role needs."""


_DENIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per client: the permission violations the server reported, in order (it reports them asynchronously)."""


def permission_violations(nc: nats.NATS) -> list[str]:
    return _DENIED.setdefault(nc, [])


def credentials_from_env() -> dict:
    """NATS credentials come from the environment, never from config: the embedded server's per-run
    token (TIDAL_NATS_TOKEN, set by `tidal run`), else a Kubernetes Secret's (NATS_TOKEN, ...)."""
    env = os.environ
    if env.get(TOKEN_ENV):
        return {"token": env[TOKEN_ENV]}
    if env.get("NATS_TOKEN"):
        return {"token": env["NATS_TOKEN"]}
    if env.get("NATS_USER"):
        return {"user": env["NATS_USER"], "password": env.get("NATS_PASSWORD", "")}
    if env.get("NATS_CREDS"):
        return {"user_credentials": env["NATS_CREDS"]}
    return {}


async def connect_nats(url: str, name: str, credentials: dict) -> nats.NATS:
    """A client that reconnects through a short outage (a restarted nats-server) and logs each
    connection event in one line, not nats-py's tracebacks."""

    client: list[nats.NATS] = []
    denied: list[str] = []
    refused = asyncio.Event()  # the server refused the credentials: retrying them will not help

    async def on_error(err: Exception) -> None:
        message = str(err) or type(err).__name__
        if "permissions violation" in message.lower():
            denied.append(message.removeprefix("nats: "))
        if isinstance(err, nats.errors.AuthorizationError) or "authorization violation" in message.lower():
            refused.set()
        log.warning("NATS %s: %s", url, message)

    async def on_disconnected() -> None:
        if client and not client[0].is_closed:  # closed: by us, or the reconnects gave up (the next call raises)
            log.warning("lost the connection to NATS at %s; reconnecting", url)

    async def on_reconnected() -> None:
        log.info("reconnected to NATS at %s", url)

    connecting = asyncio.ensure_future(
        nats.connect(
            url,
            connect_timeout=5,
            reconnect_time_wait=1,
            max_reconnect_attempts=20,
            name=name,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **credentials,
        )
    )
    waiting = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():  # refused: nats-py would try the same credentials max_reconnect_attempts times
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            raise NatsUnavailableError(f"NATS at {url} refused the connection: {_who(credentials)} (Authorization Violation)")
        nc = connecting.result()
    except nats.errors.NoServersError:
        if refused.is_set():
            raise NatsUnavailableError(f"NATS at {url} refused the connection: {_who(credentials)} (Authorization Violation)") from None
        raise NatsUnavailableError(f"cannot reach NATS at {url} (transport.nats_url, or the run's embedded nats-server): is it running?") from None
    except nats.errors.Error as err:
        raise NatsUnavailableError(f"NATS at {url} refused the connection: {err}") from None
    finally:
        waiting.cancel()
    client.append(nc)
    _DENIED[nc] = denied
    return nc


def _who(credentials: dict) -> str:
    if credentials.get("user"):
        return f"wrong password for user {credentials['user']} (NATS_USER / NATS_PASSWORD)"
    if credentials.get("token"):
        return "wrong token (TIDAL_NATS_TOKEN / NATS_TOKEN)"
    if credentials.get("user_credentials"):
        return f"credentials file {credentials['user_credentials']} not accepted (NATS_CREDS)"
    return "it requires credentials and the environment has none (NATS_USER / NATS_PASSWORD, NATS_TOKEN or NATS_CREDS)"


def raise_if_denied(nc: nats.NATS, since: int, what: str) -> None:
    """A NatsPermissionError if the server reported a permission violation to ``nc`` after the first ``since``."""
    new = permission_violations(nc)[since:]
    if new:
        user = getattr(nc, "options", {}).get("user") or "(token or anonymous)"
        raise NatsPermissionError(
            f"NATS refused {what} to user {user}: {new[-1]}. Each role logs in as its own user with only the subjects "
            "that role needs (auth.conf in manifests/base/nats.yaml): check the pod's NATS_USER / NATS_PASSWORD"
        )


STREAM_CONFIG_DIFFERS = 10058
"""JetStream's error code for "stream name already in use with a different configuration"."""


def stream_config(kind: str, names: dict[str, str], cfg: TransportConfig) -> StreamConfig:
    """The WORK (work queue: an item leaves when acked) or ROLLOUTS (limits) stream of a run.

    At ``stream_max_mb`` ROLLOUTS drops its oldest groups, which the trainer acked long ago (it acks an
    iteration's groups at its boundary), while WORK refuses new items, so the trainer fails loudly
    instead of work vanishing. ``stream_max_age_hours`` ages out whatever a dead run left behind."""
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
        # Nats-Msg-Id de-duplication (redelivered work publishes once); JetStream wants it within max_age
        duplicate_window=min(3600, max_age) if max_age else 3600,
    )


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


@dataclass
class Transport:
    nc: nats.NATS
    js: object
    kv: object
    names: dict[str, str]
    cfg: TransportConfig

    @classmethod
    async def connect(cls, url: str, run_id: str, cfg: TransportConfig, create: bool = True, credentials: dict | None = None) -> Transport:
        """`credentials` default to the environment's (credentials_from_env). A server that cannot be
        reached or refuses them is a NatsUnavailableError naming the URL."""
        nc = await connect_nats(url, f"tidal-{run_id}", credentials_from_env() if credentials is None else credentials)
        js = nc.jetstream()
        names = stream_names(run_id)
        try:
            if create:
                await cls._ensure_streams(js, names, cfg)
                kv = await cls._create_bucket(js, names["kv_bucket"])
            else:
                kv = await cls._wait_for_bucket(js, names["kv_bucket"])
        except (*TRANSIENT_ERRORS, TimeoutError) as err:
            raise_if_denied(nc, 0, "setting up the run's streams and KV bucket" if create else "looking up the run's KV bucket")
            await nc.close()
            raise err
        return cls(nc, js, kv, names, cfg)

    @staticmethod
    async def _create_bucket(js, bucket: str):
        """The run's KV bucket, with direct gets: reading a key then needs only ``$JS.API.DIRECT.GET``, which
        the streams (no direct gets) do not answer, so a user that may read the KV cannot read WORK or ROLLOUTS
        messages by sequence. A bucket created before (without them) is used as it is."""
        try:
            return await js.create_key_value(bucket=bucket, history=1, direct=True)
        except BadRequestError as err:
            if err.err_code != STREAM_CONFIG_DIFFERS:
                raise
            return await js.key_value(bucket)

    async def _retrying(self, what: str, request):
        """`await request()` again through a NATS outage (only for idempotent requests): a timeout or
        a missing responder while the server restarts is retried until OUTAGE_SECONDS have passed."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + OUTAGE_SECONDS, 0.25
        mark = len(permission_violations(self.nc))
        while True:
            try:
                return await request()
            except TRANSIENT_ERRORS as err:
                raise_if_denied(self.nc, mark, what)  # the server dropped it: no reply will come, however long we wait
                if self.nc.is_closed or loop.time() > deadline:
                    raise
                log.warning("NATS %s: %s; retrying", what, type(err).__name__)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 4.0)

    @staticmethod
    async def _wait_for_bucket(js, bucket: str, timeout: float = 60.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return await js.key_value(bucket)
            except (BucketNotFoundError, NotFoundError):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"KV bucket {bucket} did not appear within {timeout}s: is the trainer running?") from None
                await asyncio.sleep(0.2)

    @staticmethod
    async def _ensure_streams(js, names: dict[str, str], cfg: TransportConfig) -> None:
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

    def _check_size(self, payload: bytes, what: str) -> None:
        limit = self.max_message_bytes
        if len(payload) > limit:
            raise MessageTooLargeError(
                f"{what} is {len(payload)} bytes, over the {limit}-byte message limit: raise transport.max_payload_mb or shorten rollout.max_new_tokens"
            )

    @property
    def max_message_bytes(self) -> int:
        return min(self.nc.max_payload, self.cfg.max_payload_mb * 1024 * 1024)

    async def publish_work(self, item: WorkItem, attempt: int = 0) -> None:
        """`attempt` > 0: the item again, after its group was rejected (a message id of its own, or
        JetStream's de-duplication would drop it)."""
        payload = pack(item)
        self._check_size(payload, f"work item {item.iteration}/{item.prompt_id}")
        msg_id = item.msg_id if attempt == 0 else f"{item.msg_id}-r{attempt}"
        # de-duplicated by message id: a retry after a lost reply stores it once
        await self._retrying("publish work", lambda: self.js.publish(self.names["work_subject"], payload, headers={"Nats-Msg-Id": msg_id}))

    async def publish_group(self, group: Group, answering=None) -> None:
        """`answering`: the work message the group answers; its message id decides the group's (group_msg_id)."""
        payload = pack(group)
        self._check_size(payload, f"group {group.iteration}/{group.prompt_id}")
        msg_id = group_msg_id(group, answering)
        await self._retrying("publish group", lambda: self.js.publish(self.names["rollouts_subject"], payload, headers={"Nats-Msg-Id": msg_id}))

    async def work_subscription(self):
        return await self.js.pull_subscribe_bind(WORKERS_CONSUMER, stream=self.names["work_stream"])

    async def rollouts_subscription(self):
        return await self.js.pull_subscribe_bind(TRAINER_CONSUMER, stream=self.names["rollouts_stream"])

    async def fetch(self, sub, batch: int, timeout: float, linger: float = 0.0, linger_after_wait_only: bool = False) -> list:
        """Up to `batch` messages, waiting at most `timeout` for the first. With `linger`, also those that
        arrive within `linger` of each other behind it: a pull returns as soon as one message is there,
        and publishers send a batch (an iteration's work items, an engine call's groups) one by one.
        `linger_after_wait_only`: linger only when the first message was not already queued (it took
        longer than `linger` to come), i.e. when a publisher is likely sending a batch right now; a
        queue's last few messages are then taken without waiting for more that are not coming.
        A pull the server refused (this user may not use that consumer) is a NatsPermissionError, not an empty queue."""
        mark = len(permission_violations(self.nc))
        started = time.monotonic()
        msgs = await _fetch_once(sub, batch, timeout)
        if not msgs:
            raise_if_denied(self.nc, mark, "pulling messages")
        if linger_after_wait_only and time.monotonic() - started < linger:
            return msgs
        while linger and msgs and len(msgs) < batch:
            more = await _fetch_once(sub, batch - len(msgs), linger)
            if not more:
                break
            msgs += more
        return msgs

    async def work_queue_depth(self) -> int:
        info = await self._retrying("stream info", lambda: self.js.stream_info(self.names["work_stream"]))
        return info.state.messages

    async def put(self, key: str, value) -> None:
        """A message dataclass or plain msgpack data under `key` (see protocol.KVKey)."""
        payload = pack(value)
        await self._retrying(f"put {key}", lambda: self.kv.put(key, payload))

    async def get(self, key: str):
        """Plain data under `key`; None when absent."""
        try:
            entry = await self._retrying(f"get {key}", lambda: self.kv.get(key))
        except KeyNotFoundError:
            return None
        return unpack(entry.value) if entry and entry.value else None

    async def put_policy(self, version: int, uri: str) -> None:
        await self.put(KVKey.POLICY, PolicyPointer(version, uri))

    async def policy(self) -> PolicyPointer | None:
        raw = await self.get(KVKey.POLICY)
        return None if raw is None else policy_pointer_from(raw)

    async def wait_for_policy(self, version: int) -> PolicyPointer:
        """The KV policy pointer once it has reached `version`."""
        policy = await self.policy()
        while policy is None or policy.version < version:
            await asyncio.sleep(0.05)
            policy = await self.policy()
        return policy

    async def put_run_state(self, state: RunState, round_index: int | None = None) -> None:
        await self.put(KVKey.RUN, RunStatus(state, round_index))

    async def run_status(self) -> RunStatus | None:
        raw = await self.get(KVKey.RUN)
        if raw is None:
            return None
        try:
            return run_status_from(raw)
        except ProtocolError as err:
            log.error("ignoring a malformed run state in the KV bucket: %s", err)
            return None

    async def stopping(self) -> bool:
        status = await self.run_status()
        return bool(status and status.state.stops_workers)

    async def on_undeliverable_work(self, callback) -> None:
        """Calls `callback(stream_seq)` for each work item JetStream stops redelivering (max_deliver reached)."""
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.names['work_stream']}.{WORKERS_CONSUMER}"

        async def handle(msg) -> None:
            try:
                callback(int(json.loads(msg.data)["stream_seq"]))
            except (ValueError, KeyError, TypeError) as err:
                log.error("ignoring a malformed max-deliveries advisory: %s", err)

        await self.nc.subscribe(subject, cb=handle)

    async def describe_work(self, stream_seq: int) -> str:
        """'work item <iteration>/<prompt id>' for a WORK stream sequence, as far as it can be read."""
        try:
            msg = await self.js.get_msg(self.names["work_stream"], stream_seq)
            item = unpack(msg.data)
            return f"work item {item['iteration']}/{item['prompt_id']} (WORK stream sequence {stream_seq})"
        except Exception:  # noqa: BLE001 - only for an error message: the sequence alone still says which
            return f"the work item at WORK stream sequence {stream_seq}"

    async def put_worker_health(self, record: dict) -> None:
        await self.put(KVKey.worker(record["worker_id"]), record)

    async def worker_health(self) -> list[dict]:
        """Every worker's last heartbeat (rollout/health.py); malformed entries are skipped."""
        try:
            keys = await self.kv.keys(filters=[KVKey.WORKERS_PREFIX])  # nats-py filters by substring
        except NoKeysError:
            return []
        records = [await self.get(k) for k in keys if k.startswith(KVKey.WORKERS_PREFIX)]
        return [r for r in records if isinstance(r, dict) and {"worker_id", "time", "pid", "host", "version"} <= r.keys()]

    async def close(self) -> None:
        await self.nc.close()

"""The `Transport` client of a run's streams and KV bucket, and `session` / `run_in_session` for a
caller that connects for one job and closes again."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import nats
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, NoKeysError

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
from tidal.transport.connect import (
    TRANSIENT_ERRORS,
    connect_nats,
    credentials_from_env,
    permission_violations,
    raise_if_denied,
    unless_denied,
)
from tidal.transport.streams import TRAINER_CONSUMER, WORKERS_CONSUMER, create_bucket, ensure_streams, stream_names, wait_for_bucket

# the package's log lines carry one name, whichever of its modules writes them
log = logging.getLogger("tidal.transport")

# How long an idempotent request (a KV put or get, a de-duplicated publish) is retried through a NATS
# outage, e.g. the launcher restarting a killed nats-server; the client reconnects by itself meanwhile.
OUTAGE_SECONDS = 60.0

T = TypeVar("T")


class MessageTooLargeError(ValueError):
    """A message exceeds the server's max_payload."""


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
                await ensure_streams(js, names, cfg)
                kv = await create_bucket(js, names["kv_bucket"])
            else:
                kv = await wait_for_bucket(js, names["kv_bucket"])
        except (*TRANSIENT_ERRORS, TimeoutError) as err:
            raise_if_denied(nc, 0, "setting up the run's streams and KV bucket" if create else "looking up the run's KV bucket")
            await nc.close()
            raise err
        return cls(nc, js, kv, names, cfg)

    async def _retrying(self, what: str, request):
        """`await request()` again through a NATS outage (only for idempotent requests): a timeout or
        a missing responder while the server restarts is retried until OUTAGE_SECONDS have passed."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + OUTAGE_SECONDS, 0.25
        mark = len(permission_violations(self.nc))
        while True:
            try:
                return await unless_denied(self.nc, mark, what, request())
            except TRANSIENT_ERRORS as err:
                raise_if_denied(self.nc, mark, what)  # the server dropped it: no reply will come, however long we wait
                if self.nc.is_closed or loop.time() > deadline:
                    raise
                # a full stream answers 503 with its reason ("maximum bytes exceeded"): name it, since it
                # clears only as workers drain the stream, not as a server comes back
                reason = getattr(err, "description", None)
                log.warning("NATS %s: %s%s; retrying", what, type(err).__name__, f" ({reason})" if reason else "")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 4.0)

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
        msgs = await unless_denied(self.nc, mark, "pulling messages", _fetch_once(sub, batch, timeout))
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


@asynccontextmanager
async def session(url: str, run_id: str, cfg: TransportConfig, *, create: bool = False, credentials: dict | None = None) -> AsyncIterator[Transport]:
    """``async with session(...) as t``: a connected Transport (Transport.connect's arguments), closed
    when the block ends, however it ends. ``create``: set up the run's streams and KV bucket, rather
    than wait for the trainer to."""
    t = await Transport.connect(url, run_id, cfg, create=create, credentials=credentials)
    try:
        yield t
    finally:
        await t.close()


def run_in_session(
    url: str,
    run_id: str,
    cfg: TransportConfig,
    fn: Callable[[Transport], Awaitable[T]],
    *,
    create: bool = False,
    credentials: dict | None = None,
    timeout: float | None = None,
) -> T:
    """``await fn(t)`` in a session (see `session`) on a fresh event loop, for synchronous callers such
    as the launchers; not from inside a running loop. Past ``timeout`` seconds (connecting and closing
    included) it is cancelled, the connection closed, and TimeoutError raised."""

    async def run() -> T:
        async with session(url, run_id, cfg, create=create, credentials=credentials) as t:
            return await fn(t)

    return asyncio.run(asyncio.wait_for(run(), timeout))


class RunNats:
    """One-off operations on a run's NATS streams and KV bucket, for launchers (synchronous: each
    is one session, connected and closed). `run`: its tidal.rundir.RunDir (the run id, the directory)."""

    def __init__(self, run, url: str, cfg: TransportConfig, credentials: dict | None = None):
        self.run, self.url, self.cfg, self.credentials = run, url, cfg, credentials

    def _call(self, fn, create: bool = False, timeout: float | None = None):
        return run_in_session(self.url, self.run.run_id, self.cfg, fn, create=create, credentials=self.credentials, timeout=timeout)

    def open_run_state(self) -> None:
        """Marks the run running before any worker starts: a run directory re-used after a finished or
        failed run still holds "done" / "failed", and workers reading it would exit at once."""

        async def reset(t) -> None:
            status = await t.run_status()
            if status is not None and status.state is not RunState.RUNNING:
                log.info("run state was %s (an earlier run in %s): now running", status.state.value, self.run.root)
            await t.put_run_state(RunState.RUNNING)

        self._call(reset, create=True)

    def record_run_state(self, state: str) -> None:
        """Best effort (NATS may be what failed): the run state in the KV bucket, for roles and a re-run to read."""

        async def put(t) -> None:
            await t.put_run_state(RunState(state))

        try:
            self._call(put, timeout=10)
        except Exception as err:  # noqa: BLE001 - the state is a record; stopping goes on without it
            log.warning("could not record the run state %r in NATS: %s", state, err)

    def count_rollouts(self) -> int:
        """Groups published to the ROLLOUTS stream (generated), as the server counts them: its last
        sequence number, since at `transport.stream_max_mb` the stream drops its oldest messages."""

        async def count(t) -> int:
            return (await t.js.stream_info(t.names["rollouts_stream"])).state.last_seq

        return self._call(count)

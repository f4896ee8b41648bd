"""A rollout worker's heartbeat in the run's KV bucket (`workers.<id>`), and its back-off after
refusing a snapshot.

Two different clocks notice a failed worker:
- its heartbeat, which lists the work items it holds: the trainer reads it to say which worker went
  silent and asks at once for the items a silent worker held again, under new message ids (a late
  group of the silent worker is then a duplicate the trainer drops); also, to learn that a worker
  refused weights, so it can check the snapshot and rewrite it (trainer/repair in roles);
- its work items' in-progress acks, sent every ack_wait / 3: a worker that dies or is stopped loses
  them after `transport.ack_wait_seconds` and JetStream hands them to another worker (the fallback
  for items the last heartbeat did not list; nothing is lost).

A worker that refused a snapshot waits before trying it again (1 s, doubling to 10 s) instead of
re-reading and re-hashing it in a tight loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 3.0  # no heartbeat for this long: the worker is silent, its items are asked for again
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 10.0


def refusal_backoff(refusals: int, first: float = FIRST_BACKOFF_SECONDS, cap: float = MAX_BACKOFF_SECONDS) -> float:
    """Seconds to wait after the `refusals`-th consecutive refusal of one snapshot."""
    return min(cap, first * 2 ** max(0, refusals - 1))


@dataclass
class WorkerHealth:
    worker_id: str
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    # this process, whatever its pid (a restarted container is pid 1 again): a new one under the same
    # worker id means the old one is gone
    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))
    beats: int = 0  # heartbeats written: the trainer sees a live worker's count change on its own clock
    version: int | None = None
    groups_published: int = 0
    refused_version: int | None = None
    refused_error: str = ""
    refusals: int = 0  # consecutive refusals of refused_version
    left: bool = False  # its last heartbeat: it stopped and handed back its work items (those it still lists were not)
    held: Callable[[], list] = list  # the WorkItems it holds now (pulled, not yet answered)
    # set when it takes new items: the next heartbeat goes out at once, so a worker killed right after
    # a pull has them listed (else they wait for ack_wait)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def refused(self, version: int, error: str) -> float:
        """Records a refusal; returns how long to back off."""
        self.refusals = self.refusals + 1 if version == self.refused_version else 1
        self.refused_version, self.refused_error = version, error
        return refusal_backoff(self.refusals)

    def loaded(self, version: int) -> None:
        self.version = version
        self.refused_version, self.refused_error, self.refusals = None, "", 0

    def record(self, now: float | None = None) -> dict:
        self.beats += 1
        return {
            "worker_id": self.worker_id,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "beat": self.beats,
            "host": self.host,
            "time": time.time() if now is None else now,
            "version": self.version,
            "groups_published": self.groups_published,
            "refused_version": self.refused_version,
            "refused_error": self.refused_error,
            "refusals": self.refusals,
            "left": self.left,
            "holding": [[item.iteration, item.prompt_id] for item in self.held()],
        }


async def report_refusal(transport, health: WorkerHealth, version: int, error: str) -> float:
    """A refused snapshot: logged (an error the first time), in the heartbeat at once (the trainer
    checks and rewrites it); returns how long the worker backs off."""
    backoff = health.refused(version, error)
    report = log.error if health.refusals == 1 else log.warning
    report(
        "worker %s refused weights v%d (%d time(s)): %s (keeping v%s; retrying in %.0fs)",
        *(health.worker_id, version, health.refusals, error, health.version, backoff),
    )
    await transport.put_worker_health(health.record())
    return backoff


async def beat(transport, health: WorkerHealth, every: float = HEARTBEAT_SECONDS) -> None:
    """Puts the heartbeat every `every` seconds, and at once when the worker takes new work items,
    until cancelled; a failed put (NATS restarting) is retried at the next beat: a heartbeat is never
    worth failing the worker for."""
    while True:
        try:
            await transport.put_worker_health(health.record())
        except Exception as err:  # noqa: BLE001
            log.debug("worker %s: heartbeat not sent (%s)", health.worker_id, err)
        try:
            await asyncio.wait_for(health.changed.wait(), every)
        except TimeoutError:
            pass
        health.changed.clear()


@dataclass
class WatchedWorker:
    """What the trainer knows of one worker's heartbeats, on the trainer's own clock."""

    record: dict
    changed_at: float  # trainer time when its heartbeat last changed (or was first seen)
    handed_out: bool = False  # its listed items were asked for again


def heartbeat_key(record: dict) -> tuple:
    return record.get("incarnation", record.get("pid")), record.get("beat", record.get("time"))


def watch_workers(
    watched: dict[str, WatchedWorker], records: list[dict], now: float, after: float = SILENT_AFTER_SECONDS
) -> tuple[dict[str, WatchedWorker], list[dict], list[tuple]]:
    """(the watch updated, the silent workers' last heartbeats, the (iteration, prompt id) of work items
    to ask for again). A worker is silent when its heartbeat has not changed for `after` seconds of
    the trainer's clock (`now`), so hosts' clocks need not agree and a trainer that reconnects after a
    NATS restart sees a live worker's next beat before it calls it silent. What a worker listed goes
    out again once: when it falls silent, or when another process took its id (the launcher's restart)
    before it was seen silent, also when the trainer saw it only once (a worker killed right after its
    pull). An earlier launch's record goes silent too: asking again is harmless, since the trainer
    re-asks only prompts its iterations still expect (IterationPlan.reissue) and drops duplicates."""
    out, silent, keys = {}, [], []
    for r in records:
        prev = watched.get(r["worker_id"])
        if prev is None:
            entry = WatchedWorker(r, now)
        elif heartbeat_key(r) == heartbeat_key(prev.record):
            entry = prev
        else:
            replaced = heartbeat_key(r)[0] != heartbeat_key(prev.record)[0]
            if replaced and not prev.handed_out:
                keys += [tuple(k) for k in prev.record.get("holding", [])]
            entry = WatchedWorker(r, now)
        if now - entry.changed_at > after:
            silent.append(entry.record)
            if not entry.handed_out:
                keys += [tuple(k) for k in entry.record.get("holding", [])]
                entry.handed_out = True
        out[r["worker_id"]] = entry
    return out, silent, keys


def describe_workers(records: list[dict], now: float, after: float = SILENT_AFTER_SECONDS) -> str:
    """One line per worker for an error message: silent for how long, or what it is doing."""
    if not records:
        return "no rollout worker has sent a heartbeat"
    lines = []
    for r in sorted(records, key=lambda r: r["worker_id"]):
        age = now - r["time"]
        state = f"silent for {age:.0f}s" if age > after else f"alive ({age:.1f}s ago)"
        if r.get("left"):
            state = f"left {age:.0f}s ago, its work handed back"
        line = f"worker {r['worker_id']} (pid {r['pid']} on {r['host']}): {state}, holds v{r['version']}, {r['groups_published']} groups published"
        if r.get("refused_version") is not None:
            line += f", refused v{r['refused_version']} {r['refusals']}x: {r['refused_error']}"
        lines.append(line)
    return "; ".join(lines)

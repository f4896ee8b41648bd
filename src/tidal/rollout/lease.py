"""A rollout worker's lease on its work items: what it holds, and what happens to it.

A work item is held from the moment it is pulled until it is acked (its group published, or it is
obsolete) or handed back (NAK). While held, its ack deadline is extended (keep-alive) and every
heartbeat lists it, so the trainer asks again for the items of a worker that goes silent.

The hand-back rule, one for every worker: a worker that leaves while holding work items, or leaves
for any reason but the end of the run (SIGTERM, an error), hands back every item it holds (NAK:
JetStream redelivers it at once, not after transport.ack_wait_seconds) and says in its last
heartbeat that it left. An item must never wait out its ack deadline because its worker exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tidal.protocol import ProtocolError, WorkItem, decode_work_item
from tidal.transport import Transport, keep_in_progress
from tidal.transport.health import WorkerHealth, beat

log = logging.getLogger(__name__)

HAND_BACK_SECONDS = 5.0  # a leaving worker's NAKs and last heartbeat wait this long for NATS


def delivery_count(msg) -> int:
    """How many times JetStream has delivered `msg` (1: first delivery; more: handed back, or its ack deadline passed)."""
    try:
        return int(msg.metadata.num_delivered)
    except (AttributeError, TypeError, ValueError):
        return 1


async def decode_work(transport: Transport, msgs: list, worker_id: str, lease: Lease) -> list[tuple[object, WorkItem]]:
    """The valid work items of `msgs`, held by `lease` before anything is awaited (a SIGTERM from then on
    hands them back; one that came between their fetch and a later hold would lose them until their ack
    deadline); a malformed one is terminated (never redelivered) and logged."""
    out, bad = [], []
    for m in msgs:
        try:
            out.append((m, decode_work_item(m.data, transport.max_message_bytes)))
        except ProtocolError as err:
            bad.append((m, err))
    if out:
        lease.hold(out)
    for m, err in bad:
        log.error("worker %s rejected a message on %s: %s", worker_id, m.subject, err)
        await m.term()
    return out


def log_taken(worker_id: str, pulled: list) -> None:
    """One line per pull: the items taken, and which of them came back to the queue (delivery > 1)."""
    again = [(it.iteration, it.prompt_id, n) for m, it in pulled if (n := delivery_count(m)) > 1]
    log.info(
        "worker %s took %d work item(s) %s%s",
        *(
            worker_id,
            len(pulled),
            [(it.iteration, it.prompt_id) for _, it in pulled],
            f"; redelivered (iteration, prompt, delivery): {again}" if again else "",
        ),
    )


def raise_if_stop_requested(stop_requested: Callable[[], bool]) -> None:
    """SIGTERM came but its cancellation was lost on the way (see roles.cancel_on_sigterm): cancel here."""
    if stop_requested():
        raise asyncio.CancelledError("SIGTERM")


async def hand_back(transport: Transport, health: WorkerHealth, held: list[tuple[object, WorkItem]], why: str) -> None:
    """Every work item in `held` goes back to the queue at once (NAK), and the worker's last heartbeat
    says it left and lists only the items that could not be handed back, so the trainer asks again for
    those alone. With NATS unreachable nothing is lost: the items come back through the heartbeat and
    the ack deadline, as a killed worker's do."""
    outcomes = await asyncio.gather(*(asyncio.wait_for(m.nak(), HAND_BACK_SECONDS) for m, _ in held), return_exceptions=True)
    back = [(it.iteration, it.prompt_id) for (_, it), o in zip(held, outcomes) if not isinstance(o, BaseException)]
    kept = [it for (_, it), o in zip(held, outcomes) if isinstance(o, BaseException)]
    health.held, health.left = (lambda: kept), True
    try:
        await asyncio.wait_for(transport.put_worker_health(health.record()), HAND_BACK_SECONDS)
    except Exception as err:  # noqa: BLE001 - the heartbeat's silence tells the trainer instead
        log.warning("worker %s: its last heartbeat was not sent (%s)", health.worker_id, err)
    log.info("worker %s %s: handed back %d work item(s) for redelivery %s", health.worker_id, why, len(back), back)
    if kept:
        log.warning(
            "worker %s could not hand back %s: they come back through its heartbeat", health.worker_id, [(k.iteration, k.prompt_id) for k in kept]
        )


class Lease:
    """The work items one worker holds: pulled, not yet acked or handed back."""

    def __init__(self, transport: Transport, health: WorkerHealth, ack_wait_seconds: float):
        self.transport, self.health, self.ack_wait_seconds = transport, health, ack_wait_seconds
        self.held: dict[int, tuple[object, WorkItem]] = {}  # id(message) -> (message, item) (nats messages do not hash)
        health.held = lambda: [it for _, it in self.held.values()]  # the heartbeat lists them

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, pulled: list[tuple[object, WorkItem]]) -> None:
        """Held from here on; a heartbeat at once lists them (a worker killed now has its items asked for again)."""
        self.held.update((id(m), (m, it)) for m, it in pulled)
        self.health.changed.set()

    def release(self, msg) -> None:
        self.held.pop(id(msg), None)

    async def ack(self, msg) -> None:
        """The item is done with: its group is published, or it is obsolete."""
        await msg.ack()
        self.release(msg)

    async def nak(self, msg, delay: float | None = None) -> None:
        """The item goes back to the queue (after `delay` seconds) for any worker to take."""
        self.release(msg)
        await msg.nak(delay=delay)

    async def back_off(self, msgs: list, seconds: float) -> None:
        """After a refused snapshot: the items go back to the queue, and this worker waits before trying again."""
        for m in msgs:  # released first, or the keep-alive would hold them past the back-off
            self.release(m)
        for m in msgs:
            await m.nak(delay=seconds)
        await asyncio.sleep(seconds)

    @contextlib.asynccontextmanager
    async def kept(self):
        """While inside: heartbeats, and every held item's ack deadline extended. On the way out, the
        hand-back rule: leaving holding items, or leaving for any reason but the end of the run (an
        exception, SIGTERM's cancellation), hands back what is held and sends the last heartbeat."""
        heartbeat = asyncio.create_task(beat(self.transport, self.health))
        keep_alive = asyncio.create_task(keep_in_progress(lambda: [m for m, _ in self.held.values()], self.ack_wait_seconds / 3))
        leaving = "failing"
        try:
            yield
            leaving = ""
        except asyncio.CancelledError:
            leaving = "stopping (SIGTERM)"
            raise
        finally:
            keep_alive.cancel()
            heartbeat.cancel()
            if self.held or leaving:
                await hand_back(self.transport, self.health, list(self.held.values()), leaving or "exiting")
            self.held.clear()

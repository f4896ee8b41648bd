"""The handshake around a collective weight transfer (NCCL) from trainer rank 0 to every rollout engine.

A collective hangs when one member is missing, and NCCL has no timeout; so nobody enters the
broadcast until every member has said it will. Per version v, in the run's KV bucket:

    trainer: offer(v, id) ──▶ waits until every lane is ready for id ──▶ go(v, id) ──▶ broadcast ──▶ sent(v)
    worker:  sees offer(v, id) ──▶ ready(id) ──▶ waits for go(v, id) ──▶ receive (with a deadline)

Each offer has its own id, so a ready left over from an earlier offer (a restarted trainer offering
the same version again) never counts, and a worker only answers an offer, never a stale go.

When a step times out or fails, the trainer turns the transfer off for the rest of the run
(`state: off`, with the reason) and everyone loads from the weight store, which holds every version
anyway. A worker that cannot take part (a restarted one that was not a member when the group
formed: an NCCL group cannot be rejoined) refuses it, under a key of its own, and the trainer turns
it off: only the trainer writes the offer's key, so a worker cannot forge an offer (a group to join,
weights to take). A worker whose join or receive outlives its deadline exits (its engine is stuck
inside the collective) and is restarted, loading from the store.

Only the handshake lives here (no vLLM, no NCCL): the transfer itself is in the vLLM adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from tidal.protocol import KVKey

log = logging.getLogger(__name__)

KEY = KVKey.NCCL
READY_PREFIX = KVKey.NCCL_READY_PREFIX
REFUSED = KVKey.NCCL_REFUSED


def lane_of(worker_id: str) -> int:
    """A worker's lane, its place in the group: `worker-3` (local) and `r000-3` (pipeline) are lane 3."""
    try:
        return int(worker_id.rsplit("-", 1)[-1])
    except ValueError:
        raise ValueError(f"worker id {worker_id!r} does not end in its lane number (e.g. worker-0)") from None


async def turn_off(transport, reason: str) -> None:
    """Trainer: the transfer is off for the rest of the run."""
    log.warning("NCCL weight transfer off for the rest of the run: %s; workers load from the weight store", reason)
    await transport.put(KEY, {"state": "off", "reason": reason})


async def refuse(transport, reason: str) -> None:
    """Worker: this engine cannot take part; the trainer turns the transfer off (off_reason)."""
    log.warning("refusing the NCCL weight transfer: %s; the trainer turns it off", reason)
    await transport.put(REFUSED, {"reason": reason, "time": time.time()})


async def off_reason(transport) -> str | None:
    """Trainer: why the transfer is off, None while it is on. A worker's refusal turns it off here."""
    current = await transport.get(KEY)
    if current and current.get("state") == "off":
        return current.get("reason", "")
    refused = await transport.get(REFUSED)
    if not refused:
        return None
    await turn_off(transport, refused["reason"])
    return refused["reason"]


async def offer(transport, version: int, lanes: int, rendezvous: dict, update_info: dict, timeout: float, poll: float = 0.1) -> bool:
    """Trainer: offers `version` and says go once every lane is ready for *this* offer (its id);
    False (and off) on timeout, or when a worker turned the transfer off meanwhile."""
    offer_id = uuid.uuid4().hex[:12]
    message = {"state": "offer", "id": offer_id, "version": version, "lanes": lanes, "rendezvous": rendezvous, "update_info": update_info}
    await transport.put(KEY, message)
    deadline = time.monotonic() + timeout
    while True:
        ready = [await transport.get(f"{READY_PREFIX}{lane}") for lane in range(lanes)]
        missing = [lane for lane, r in enumerate(ready) if not r or r.get("offer") != offer_id]
        if not missing:
            break
        if await off_reason(transport) is not None:
            return False
        if time.monotonic() > deadline:
            await turn_off(transport, f"rollout lanes {missing} were not ready for weights v{version} within {timeout:.0f}s")
            return False
        await asyncio.sleep(poll)
    await transport.put(KEY, {**message, "state": "go"})
    return True


async def sent(transport, version: int) -> None:
    """Trainer: the broadcast of `version` is over; a late reader must not take its go for a new one."""
    await transport.put(KEY, {"state": "sent", "version": version})


async def pending_offer(transport) -> dict | None:
    """The offer the trainer has out, if any (workers poll this while idle)."""
    current = await transport.get(KEY)
    return current if current and current.get("state") == "offer" else None


async def _wait_for_offer(transport, version: int, timeout: float, poll: float) -> dict | None:
    """The offer of `version`. The trainer offers every version until it turns the transfer off, and a
    work item of `version` may arrive a moment before its offer; a go or sent of `version` means the
    offer was missed (the broadcast went ahead without this engine, or is over)."""
    deadline = time.monotonic() + timeout
    while True:
        current = await transport.get(KEY)
        if not current or current.get("state") == "off" or current.get("version", -1) > version:
            return None
        if current["version"] == version:
            return current if current["state"] == "offer" else None
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(poll)


async def accept(transport, lane: int, version: int, joined_group: str | None, timeout: float, poll: float = 0.1) -> dict | None:
    """Worker: the go message to receive `version` with; None means load it from the weight store.

    `joined_group`: the group this engine belongs to, if any. An engine outside the offered group
    may join it only while it is still forming (`rendezvous.formed` false); otherwise it refuses the
    transfer at once, so the trainer does not wait out its timeout."""
    current = await _wait_for_offer(transport, version, timeout, poll)
    if current is None:
        return None
    if lane >= current["lanes"]:
        await refuse(transport, f"rollout lane {lane} is outside the trainer's {current['lanes']} lanes (rollout.workers)")
        return None
    if joined_group != current["rendezvous"]["group"] and current["rendezvous"].get("formed"):
        await refuse(transport, f"lane {lane}'s engine is not in the NCCL group that formed (restarted?), and an NCCL group cannot be rejoined")
        return None
    offer_id = current["id"]
    await transport.put(f"{READY_PREFIX}{lane}", {"version": version, "offer": offer_id, "time": time.time()})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await transport.get(KEY)
        if not current or current.get("id") != offer_id or current.get("state") == "off":
            return None  # turned off, or replaced by another offer
        if current["state"] == "go":
            return current
        await asyncio.sleep(poll)
    return None

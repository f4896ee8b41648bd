"""The handshake around a collective weight transfer (NCCL) from trainer rank 0 to every rollout engine.

A collective hangs when one member is missing, and NCCL has no timeout; so nobody enters the
broadcast until every member has said it will. Per version v, in the run's KV bucket:

    trainer: offer(v) ──▶ waits until every worker lane is ready(v) ──▶ go(v) ──▶ broadcast
    worker:  sees offer(v) ──▶ ready(v) ──▶ waits for go(v) ──▶ receive

When a step times out or fails, the trainer turns the transfer off for the rest of the run
(`state: off`, with the reason) and everyone loads from the weight store, which holds every version
anyway. A worker that was not a member when the group formed (a restarted one) never says ready:
an NCCL group cannot be rejoined, so the trainer times out and turns the transfer off.

Only the handshake lives here (no vLLM, no NCCL): the transfer itself is in the vLLM adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

KEY = "weight_sync.nccl"
READY_PREFIX = "weight_sync.ready."


def lane_of(worker_id: str) -> int:
    """A worker's lane, its place in the group: `worker-3` (local) and `r000-3` (pipeline) are lane 3."""
    try:
        return int(worker_id.rsplit("-", 1)[-1])
    except ValueError:
        raise ValueError(f"worker id {worker_id!r} does not end in its lane number (e.g. worker-0)") from None


async def turn_off(transport, reason: str) -> None:
    log.warning("NCCL weight transfer off for the rest of the run: %s; workers load from the weight store", reason)
    await transport.put(KEY, {"state": "off", "reason": reason})


async def offer(transport, version: int, lanes: int, rendezvous: dict, update_info: dict, timeout: float, poll: float = 0.1) -> bool:
    """Trainer: offers `version` and says go once every lane is ready; False (and off) on timeout."""
    message = {"state": "offer", "version": version, "lanes": lanes, "rendezvous": rendezvous, "update_info": update_info}
    await transport.put(KEY, message)
    deadline = time.monotonic() + timeout
    while True:
        ready = [await transport.get(f"{READY_PREFIX}{lane}") for lane in range(lanes)]
        missing = [lane for lane, r in enumerate(ready) if not r or r.get("version") != version]
        if not missing:
            break
        if time.monotonic() > deadline:
            await turn_off(transport, f"rollout lanes {missing} were not ready for weights v{version} within {timeout:.0f}s")
            return False
        await asyncio.sleep(poll)
    await transport.put(KEY, {**message, "state": "go"})
    return True


async def pending_offer(transport) -> dict | None:
    """The offer or go the trainer has out, if any (workers poll this while idle)."""
    current = await transport.get(KEY)
    return current if current and current.get("state") in ("offer", "go") else None


async def _wait_for_offer(transport, version: int, timeout: float, poll: float) -> dict | None:
    """The trainer offers every version until it turns the transfer off; a work item of `version` may
    arrive a moment before the offer does."""
    deadline = time.monotonic() + timeout
    while True:
        current = await transport.get(KEY)
        if not current or current.get("state") == "off" or current.get("version", -1) > version:
            return None
        if current["version"] == version:
            return current
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(poll)


async def accept(transport, lane: int, version: int, joined_group: str | None, timeout: float, poll: float = 0.1) -> dict | None:
    """Worker: the go message to receive `version` with; None means load it from the weight store.

    `joined_group`: the group this engine belongs to, if any. An engine outside the offered group
    may join it only while it is still forming (`rendezvous.formed` false)."""
    current = await _wait_for_offer(transport, version, timeout, poll)
    if current is None:
        return None
    if joined_group != current["rendezvous"]["group"] and current["rendezvous"].get("formed"):
        log.warning("lane %d: the NCCL group formed without this engine (restarted?); it cannot rejoin", lane)
        return None
    await transport.put(f"{READY_PREFIX}{lane}", {"version": version, "time": time.time()})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = await transport.get(KEY)
        if not current or current.get("version") != version or current.get("state") == "off":
            return None
        if current["state"] == "go":
            return current
        await asyncio.sleep(poll)
    return None

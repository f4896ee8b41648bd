"""Trainer rank 0's side of the NCCL weight fast path (`rollout.vllm.weight_sync: nccl`).

The weight store stays the source of truth: every version is published there first, and any
failure here only turns the fast path off (workers then load from the store). The handshake is in
tidal.transport.weight_handshake; the vLLM calls are in tidal.rollout.vllm_weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

import torch

from tidal.transport import weight_handshake

log = logging.getLogger(__name__)


def rendezvous_endpoint() -> tuple[str, int]:
    """Where engines reach this trainer: $TIDAL_NCCL_ADDRESS, else $POD_IP, else this host's address;
    $TIDAL_NCCL_PORT, else a free port."""
    address = os.environ.get("TIDAL_NCCL_ADDRESS") or os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    port = os.environ.get("TIDAL_NCCL_PORT")
    if port:
        return address, int(port)
    with socket.socket() as s:
        s.bind(("", 0))
        return address, s.getsockname()[1]


def broadcast_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict, tied aliases included: vLLM's layer-by-layer reload keeps the
    previous version's lm_head unless it is sent too (see the adapter's `_retie`)."""
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


async def call_with_deadline(fn: Callable[[], None], timeout: float) -> str | None:
    """Runs a blocking collective on a daemon thread; the error, or None. A collective that never
    completes (a member missing) cannot be cancelled: its thread is abandoned, and never joined at exit."""
    error: list[str] = []

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            error.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=target, name="tidal-weight-broadcast", daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join, timeout)
    if thread.is_alive():
        return f"not finished after {timeout:.0f}s (an engine is missing or hung)"
    return error[0] if error else None


class NcclWeightPush:
    """Offers each version to every engine lane and broadcasts it once all are ready."""

    def __init__(
        self,
        transport,
        lanes: int,
        tensor_parallel_size: int,
        timeout: float,
        open_sender: Callable,
        update_info: Callable,
        endpoint: tuple[str, int],
    ):
        self.transport = transport
        self.lanes = lanes
        self.tp = tensor_parallel_size
        self.timeout = timeout
        self.open_sender = open_sender  # rendezvous dict -> an object with send(state)
        self.update_info = update_info  # state -> what the engines need to receive it
        self.address, self.port = endpoint
        self.group = uuid.uuid4().hex[:12]  # a restarted trainer forms a new group
        self.active = True
        self.sender = None  # opened with the first broadcast: from then on the group has formed

    @property
    def formed(self) -> bool:
        return self.sender is not None

    def rendezvous(self) -> dict:
        return {
            "group": self.group,
            "formed": self.formed,
            "master_address": self.address,
            "master_port": self.port,
            "world_size": 1 + self.lanes * self.tp,
        }

    def _send(self, tensors: dict) -> None:
        if self.sender is None:
            self.sender = self.open_sender(self.rendezvous())  # blocks until every engine has joined
        self.sender.send(tensors)

    async def push(self, version: int, state: dict[str, torch.Tensor]) -> bool:
        """True once every engine holds `version`; False: the fast path is (now) off."""
        if not self.active:
            return False
        if await weight_handshake.off_reason(self.transport) is not None:  # a worker refused it (it cannot take part)
            self.active = False
            return False
        tensors = broadcast_tensors(state)
        ok = await weight_handshake.offer(self.transport, version, self.lanes, self.rendezvous(), self.update_info(tensors), self.timeout)
        if ok:
            error = await call_with_deadline(lambda: self._send(tensors), self.timeout)
            if error:
                await weight_handshake.turn_off(self.transport, f"the broadcast of weights v{version} failed: {error}")
                ok = False
        if not ok:
            self.active = False
            return False
        await weight_handshake.sent(self.transport, version)
        log.info("weights v%d sent over NCCL to %d engine lanes", version, self.lanes)
        return True

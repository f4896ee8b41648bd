"""The trainer's ranks under torchrun: the process group, and the few collectives the loop needs.

One code path for every device: gloo on CPU, `cpu:gloo,cuda:nccl` on GPUs, `cpu:gloo,npu:hccl` on
Ascend (the CPU half carries the small control messages: group bytes, counts). At world size 1
nothing is initialised and every collective is the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this machine (they share its cores)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = DistContext()


def context_from_env(environ: dict[str, str] | None = None) -> DistContext:
    """Rank, world size and local rank as torchrun (or the PyTorchJob's torchrun) sets them."""
    env = os.environ if environ is None else environ
    return DistContext(
        int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    )


def init_process_group(ctx: DistContext, device_type: str, timeout_seconds: float = 900.0) -> None:
    """Joins torchrun's rendezvous (MASTER_ADDR/PORT from the environment); no-op at world size 1."""
    if not ctx.distributed or dist.is_initialized():
        return
    if device_type not in BACKENDS:
        raise ValueError(f"no process-group backend for device type {device_type!r} (one of {sorted(BACKENDS)})")
    dist.init_process_group(BACKENDS[device_type], rank=ctx.rank, world_size=ctx.world_size, timeout=datetime.timedelta(seconds=timeout_seconds))


def ensure_process_group(ctx: DistContext, device_type: str) -> None:
    """A sharding strategy needs a process group even at one rank (fsdp2 at world size 1, e.g. to
    compare it with `single`): a private one on a free loopback port when torchrun gave none."""
    if dist.is_initialized():
        return
    if ctx.distributed:
        init_process_group(ctx, device_type)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(BACKENDS[device_type], init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_bytes(payload: bytes | None, ctx: DistContext) -> bytes:
    """Rank 0's bytes on every rank, as a uint8 tensor over the CPU group (never pickled objects)."""
    if not ctx.distributed:
        assert payload is not None
        return payload
    size = torch.tensor([len(payload) if ctx.is_main else 0], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if ctx.is_main else torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(buffer, src=0)
    return bytes(buffer.numpy()) if not ctx.is_main else payload


def all_reduce(values: list[float], ctx: DistContext, op: str = "sum") -> list[float]:
    """Element-wise sum or max over ranks (float64 on the CPU group); the identity at one rank."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    return all_reduce(values, ctx, "sum")


def all_reduce_max(values: list[float], ctx: DistContext) -> list[float]:
    return all_reduce(values, ctx, "max")


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()

"""Which torch device the trainer uses: `trainer.device: auto` takes the accelerator the process can see."""

from __future__ import annotations

import torch


def npu_available() -> bool:
    """An Ascend NPU through torch_npu (which torch auto-loads when it is installed)."""
    npu = getattr(torch, "npu", None)
    return npu is not None and npu.is_available()


def resolve_device(requested: str, key: str = "trainer.device") -> str:
    """'auto': CUDA, else an Ascend NPU, else CPU. An explicit accelerator the process cannot see is an
    error naming `key`, not a failure deep inside the first forward pass."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "npu" if npu_available() else "cpu"
    kind = requested.split(":")[0]  # "npu" is a device type only once torch_npu is loaded
    visible = {"cuda": torch.cuda.is_available, "npu": npu_available}.get(kind)
    if visible is not None and not visible():
        raise ValueError(f"{key} is {requested!r} but this process sees no {kind} device; use 'auto' or 'cpu'")
    try:
        torch.device(requested)
    except RuntimeError as err:
        raise ValueError(f"{key} is {requested!r}, not a torch device: {err}") from None
    return requested

"""Which torch device the trainer uses: `trainer.device: auto` takes the accelerator the process can see."""

from __future__ import annotations

import torch


def npu_count() -> int:
    """Ascend NPUs through torch_npu (which torch auto-loads when it is installed)."""
    npu = getattr(torch, "npu", None)
    return npu.device_count() if npu is not None and npu.is_available() else 0


def visible_accelerators() -> dict[str, int]:
    return {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0, "npu": npu_count()}


def device_problem(requested: str, visible: dict[str, int]) -> str | None:
    """Why `requested` names an accelerator this process cannot use (given `visible` counts), or None."""
    kind, _, index = requested.partition(":")
    seen = visible.get(kind)
    if seen is None:
        return None
    if seen == 0:
        return f"this process sees no {kind} device; use 'auto' or 'cpu'"
    if index.isdigit() and int(index) >= seen:
        return f"this process sees {seen} {kind} device(s), {kind}:0 to {kind}:{seen - 1}"
    return None


def resolve_device(requested: str, key: str = "trainer.device") -> str:
    """'auto': CUDA, else an Ascend NPU, else CPU. An accelerator the process cannot see is an error
    naming `key`, not a failure deep inside the first forward pass."""
    visible = visible_accelerators()
    if requested == "auto":
        return "cuda" if visible["cuda"] else "npu" if visible["npu"] else "cpu"
    problem = device_problem(requested, visible)
    if problem:
        raise ValueError(f"{key} is {requested!r} but {problem}")
    if requested.partition(":")[0] != "npu":  # "npu" is a torch device type only once torch_npu is loaded
        try:
            torch.device(requested)
        except RuntimeError as err:
            raise ValueError(f"{key} is {requested!r}, not a torch device: {err}") from None
    return requested


VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def visible_device_ids(kind: str, environ: dict[str, str], count: int) -> list[str]:
    """The ids a child process may be given: the parent's visible list if set, else 0..count-1."""
    listed = environ.get(VISIBLE_DEVICES_ENV[kind], "").strip()
    return [d.strip() for d in listed.split(",") if d.strip()] if listed else [str(i) for i in range(count)]


def accelerator_placement(devices: list[str], workers: int, per_worker: int, trainer_ranks: int = 1) -> dict[str, list[str]] | None:
    """Local runs: the trainer on the first `trainer_ranks` devices (one per rank) and each rollout
    worker on its own `per_worker` devices (its tensor-parallel size) when there are enough for the
    trainer and one worker; workers beyond the devices share them round-robin. None when there are
    too few: every role sees them all."""
    first = trainer_ranks
    blocks = [devices[i : i + per_worker] for i in range(first, len(devices) - per_worker + 1, per_worker)]
    if not blocks:
        return None
    return {"trainer": devices[:first], **{f"worker-{i}": blocks[i % len(blocks)] for i in range(workers)}}

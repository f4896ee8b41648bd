"""vLLM's side of weight changes: what runs inside vLLM's worker processes (`TidalWorkerExtension`:
a weight-store snapshot loaded after its checksums are verified, so no tensor crosses a process
boundary), and the NCCL weight transfer (GPU only; never run on CPU): `nccl_join`/`nccl_receive` on the
engine side, `NcclWeightSender` on trainer rank 0. The handshake that makes the transfer safe is
tidal.transport.weight_handshake. Under model.lora only the adapter's tensors travel: the engine's
workers keep them (not loaded into the base), its first worker writes them as peft's files into a
directory of the engine's, and the adapter is added from there as one read from the store is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.rollout.vllm_args import INSTALL_HINT, vllm_available

if TYPE_CHECKING:
    from tidal.rollout.vllm_adapter import VLLMEngine


EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")  # a language model's, a VLM's


def _retie(state: dict, hf_config) -> dict:
    """Snapshots drop tied aliases; vLLM's layer-by-layer reload needs the lm_head too, or it keeps
    the previous version's lm_head while the embedding moves on."""
    text_config = getattr(hf_config, "text_config", None)
    tied = getattr(hf_config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    embedding = next((name for name in EMBEDDING_NAMES if name in state), None)
    if tied and "lm_head.weight" not in state and embedding is not None:
        state = {**state, "lm_head.weight": state[embedding]}
    return state


def _cast_like(state: dict, model) -> dict:
    """Snapshots may be float32 while the engine serves bf16: cast once here, not per tensor in vLLM."""
    dtype = next(model.parameters()).dtype
    return {k: (t.to(dtype) if t.is_floating_point() else t) for k, t in state.items()}


class TidalWorkerExtension:
    """Mixed into vLLM's worker class: `self.model_runner` is the worker's. Method names are
    prefixed so they never shadow the worker's own (vLLM has its own `update_weights`)."""

    def tidal_load_weights(self, path: str, public_key: str | None = None) -> dict:
        """`public_key`: the run's, which the worker read from its key file (these processes have no role of their own)."""
        from tidal.weights import CorruptSnapshotError, load_verified_with_manifest

        try:
            state, manifest = load_verified_with_manifest(path, public_key)
        except CorruptSnapshotError as err:
            return {"error": str(err), "partial": False}
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        try:
            # Kernels may hold weights repacked after the first load (CPU does): reload layer by layer.
            initialize_layerwise_reload(model)
            tensors = _retie(_cast_like(state, model), self.model_runner.vllm_config.model_config.hf_config)
            loaded = model.load_weights(tensors.items())
            finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        except Exception as err:  # shape or name mismatch mid-load: the model now mixes two versions
            return {"error": f"snapshot {path} does not fit the model: {type(err).__name__}: {err}", "partial": True}
        missing = expected - set(loaded or expected)
        if missing:
            return {"error": f"snapshot {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}", "partial": True}
        return {"loaded": len(state), "probe": manifest.get("probe")}

    def tidal_receive_adapter(self, update_info: dict, directory: str) -> dict:
        """This worker's part of an adapter-only NCCL broadcast (see nccl_update_info): the tensors are kept,
        not loaded into the model, and the engine's first worker writes them as peft's adapter files."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        from tidal.weights import write_adapter_files

        transfer = getattr(self, "weight_transfer_engine", None)
        group = getattr(transfer, "model_update_group", None)
        if group is None:
            return {"error": "this engine has not joined the trainer's NCCL group"}
        received: dict = {}

        def keep(items) -> None:  # the received tensors are views of a reused buffer: copied out
            received.update((name, tensor.to("cpu", copy=True)) for name, tensor in items)

        meta = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        packed_nccl_broadcast_consumer(
            iterator=((name, (shape, getattr(torch, dtype))) for name, dtype, shape in meta),
            group=group,
            src=0,
            post_unpack_func=keep,
            buffer_size_bytes=transfer.packed_buffer_size_bytes,
            num_buffers=transfer.packed_num_buffers,
            device=transfer.device,
        )
        if self.rank == 0:
            write_adapter_files(Path(directory), received, update_info["adapter_config"])
        return {"received": len(received)}

    def tidal_weights_digest(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


# --- NCCL weight transfer (GPU only) ---------------------------------------------------------------
# The handshake that makes it safe (everyone present before anyone enters the collective) is in
# tidal.transport.weight_handshake; these are the vLLM calls on either side of it.


def nccl_unavailable_reason() -> str | None:
    """Why this process cannot send weights over NCCL, or None when it can."""
    if not vllm_available():
        return f"vllm is not installed in the trainer's environment ({INSTALL_HINT})"
    try:
        nccl_api = importlib.util.find_spec("vllm.distributed.weight_transfer.nccl_common")
    except ModuleNotFoundError:  # find_spec raises when a parent package is missing
        nccl_api = None
    if nccl_api is None:
        # vLLM 0.23 (vllm-ascend's) has the weight-transfer API in another shape (trainer_init on the
        # engine class, `packed` on the update info, no weight_version); Tidal drives 0.32's and 0.33's.
        return "the trainer's vLLM predates the 0.32 NCCL weight-transfer API Tidal drives (vllm>=0.32)"
    import torch

    if not torch.cuda.is_available():
        return "the trainer has no CUDA device (NCCL needs one)"
    return None


def nccl_update_info(state: dict, adapter_config: dict | None = None) -> dict:
    """What the engines need to size their receive buffers: names, dtypes and shapes, in send order;
    under model.lora also the adapter's config (then `state` is the adapter's tensors alone)."""
    info = {
        "names": list(state),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
    }
    return info if adapter_config is None else {**info, "adapter_config": adapter_config}


async def nccl_join(engine: VLLMEngine, rendezvous: dict, rank_offset: int) -> None:
    """Engine side, once per group: joins the trainer's NCCL group (blocks until every rank has joined)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    init = {
        "master_address": rendezvous["master_address"],
        "master_port": rendezvous["master_port"],
        "rank_offset": rank_offset,
        "world_size": rendezvous["world_size"],
        "packed": True,
    }
    await engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))


async def nccl_receive(engine: VLLMEngine, update_info: dict, version: int) -> None:
    """Engine side, per version: receives the broadcast into the model, then drops the prefix cache;
    or an adapter's tensors (update_info names its config), added as that version's adapter."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    if "adapter_config" in update_info:
        await engine.receive_adapter(update_info, version)
        return
    async with engine.swapping_weights():
        await engine.llm.start_weight_update()
        await engine.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await engine.llm.finish_weight_update(weight_version=str(version))


class NcclWeightSender:
    """Trainer rank 0: opens NCCL rank 0 of the group in `rendezvous` and broadcasts state dicts, packed."""

    def __init__(self, rendezvous: dict):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({k: rendezvous[k] for k in ("master_address", "master_port", "world_size")})

    def send(self, state: dict) -> None:
        """Every engine must be inside `nccl_receive` with `nccl_update_info(state)` at the same time."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        device = torch.device("cuda", torch.cuda.current_device())
        items = ((name, t.to(device, non_blocking=True)) for name, t in state.items())
        packed_nccl_broadcast_producer(iterator=items, group=self.group, src=0, post_iter_func=lambda item: item[1])
        torch.cuda.current_stream().synchronize()

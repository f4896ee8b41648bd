"""How the trainer's models are laid out over ranks: `single` (one process), `fsdp2` (each
decoder layer and the root sharded with `fully_shard`) or `deepspeed` (ZeRO 2/3, in
deepspeed_strategy.py, loaded only when asked for). The strategy wraps the models and owns
what differs between layouts (gradient reduction, clipping, gathering full weights, optimizer
shards); the loss math in `algo/` and the learner's accumulation do not change.

The summed per-token loss is divided by the *global* token count once, at the step (so the update
equals one process's); FSDP averages gradients over ranks by default, so every FSDP module is told
to sum instead (`set_gradient_divide_factor(1.0)`, which gloo accepts only with
`set_force_sum_reduction_for_comms`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tidal.config import TrainerConfig
from tidal.devices import resolve_device
from tidal.model.loading import load_state_dict_tied
from tidal.trainer.distributed import DistContext, ensure_process_group
from tidal.trainer.packing import enable_activation_checkpointing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Strategy(Protocol):
    """What a layout owns. `wrap` returns the module the learner runs forward passes on."""

    name: str
    ctx: DistContext

    def wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module: ...

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def zero_grad(self, model: torch.nn.Module) -> None: ...

    def scale_gradients(self, model: torch.nn.Module, factor: float) -> None:
        """Multiplies the accumulated (summed over ranks) gradients by `factor` (1 / global units)."""

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clips by the global norm over every rank's shard; returns the norm before clipping."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]: ...

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None: ...

    def reshard(self, model: torch.nn.Module) -> None:
        """After a forward with no backward (every rank runs both): leaves the model's parameters laid out as
        training leaves them, so that optimizer state, checkpoints and the next step find them."""

    def trainable_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A collective: the full values of the parameters that train (under LoRA the adapter), by the
        model's own names, on the CPU on rank 0 ({} on the others)."""

    def load_partial_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full values of some parameters (the adapter); each keeps its part."""

    def copy_parameter(self, target: torch.nn.Parameter, source: torch.nn.Parameter) -> None:
        """target = source for two parameters laid out alike (this rank's part only, no communication)."""

    def optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This rank's optimizer state as `param_name::field` -> tensor (safetensors, no pickle)."""

    def load_optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None: ...


def resolve_strategy_name(requested: str, world_size: int) -> str:
    if requested == "auto":
        return "single" if world_size == 1 else "fsdp2"
    if requested == "single" and world_size > 1:
        raise ValueError(f"trainer.strategy 'single' cannot run on {world_size} ranks: use 'fsdp2' (or 'auto')")
    return requested


class TorchOptimizerLayout:
    """What single and fsdp2 share: a torch AdamW over the module's (possibly sharded) parameters,
    autograd's backward, gradients on `param.grad`."""

    cfg: TrainerConfig
    ctx: DistContext

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        # only what trains holds optimizer state (under LoRA: the adapter)
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self, model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)

    def scale_gradients(self, model: torch.nn.Module, factor: float) -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        full = getattr(norm, "full_tensor", None)  # fsdp2: a DTensor
        return float(full() if full else norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reshard(self, model: torch.nn.Module) -> None:
        """Nothing to do: one process's parameters are whole."""

    def trainable_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # fsdp2: a collective per parameter
                if self.ctx.is_main:
                    out[name] = full.detach().cpu().clone()  # a copy: the next step must not change what is being written
        return out

    def load_partial_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        unexpected = sorted(set(state) - set(params))
        if unexpected:
            raise ValueError(f"weights do not fit the model: unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(self.shard_of(value, params[name]))

    def copy_parameter(self, target: torch.nn.Parameter, source: torch.nn.Parameter) -> None:
        with torch.no_grad():
            target.copy_(source)  # fsdp2: two DTensors sharded alike, a local copy

    def shard_of(self, full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """`full` (the whole value) laid out like `param`: under fsdp2 this rank's shard, cut locally."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(param, DTensor):
            return full.to(param.device, param.dtype)
        return distribute_tensor(full.to(param.to_local().device, param.dtype), param.device_mesh, param.placements, src_data_rank=None)

    def like_param(self, local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        return local.to(param.device, copy=True)

    def optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        names = {p: n for n, p in model.named_parameters()}
        out = {}
        for p, state in optimizer.state.items():
            for key, value in state.items():
                local = self.local_shard(value) if torch.is_tensor(value) else torch.as_tensor(value)
                out[f"{names[p]}::{key}"] = local.detach().cpu().clone()
        return out

    def load_optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        for key, value in tensors.items():
            name, field = key.rsplit("::", 1)
            # Moments live beside (and sharded like) their parameter; AdamW keeps its `step` counter on the CPU.
            optimizer.state[params[name]][field] = value.clone() if field == "step" else self.like_param(value, params[name])


class SingleStrategy(TorchOptimizerLayout):
    name = "single"

    def __init__(self, cfg: TrainerConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx

    def wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        load_state_dict_tied(model, state)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: HF models name their layer class in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"fsdp2: found no decoder layers to shard in {type(model).__name__} (no _no_split_modules)")
    return layers


class FSDP2Strategy(TorchOptimizerLayout):
    name = "fsdp2"

    def __init__(self, cfg: TrainerConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        ensure_process_group(ctx, resolve_device(cfg.device).partition(":")[0])

    def _policies(self) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        mixed = MixedPrecisionPolicy(
            param_dtype=DTYPES[self.cfg.param_dtype] if self.cfg.param_dtype else None,
            reduce_dtype=DTYPES[self.cfg.reduce_dtype] if self.cfg.reduce_dtype else None,
        )
        return {"mp_policy": mixed, "offload_policy": CPUOffloadPolicy() if self.cfg.cpu_offload else OffloadPolicy()}

    def wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if trainable and self.cfg.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            enable_activation_checkpointing(model)
        policies = self._policies()
        for layer in decoder_layers(model):
            fully_shard(layer, **policies)
        fully_shard(model, **policies)
        if trainable:  # sum, not average, over ranks: the step divides by the global token count
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A collective: every rank calls it; rank 0 gets the full weights on the CPU, the others {}."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False):  # gathered as a copy, not an alias
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        return state

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full weights (read from the shared weight store); each keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied:
            state = {k: v for k, v in state.items() if "lm_head" not in k}
        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        really_missing = [k for k in result.missing_keys if not (tied and "lm_head" in k)]
        if result.unexpected_keys or really_missing:
            raise ValueError(f"weights do not fit the model: missing {really_missing[:5]}, unexpected {result.unexpected_keys[:5]}")

    def reshard(self, model: torch.nn.Module) -> None:
        """FSDP2 keeps the root module's parameters gathered after its forward, for the backward that usually
        follows; with none following, its plain tensors would stay registered in place of the sharded
        DTensors the optimizer holds. Resharding registers the shards again (every module: the others
        resharded after their own forward already, and for them this is a no-op)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        to_local = getattr(tensor, "to_local", None)
        return to_local() if to_local else tensor

    def like_param(self, local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor):
            return local.to(param.device, copy=True)
        local = local.to(param.to_local().device, copy=True)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def deepspeed_strategy(cfg: TrainerConfig, ctx: DistContext) -> Strategy:
    """DeepSpeed ZeRO 2/3 (tidal.trainer.deepspeed_strategy), imported only when asked for: DeepSpeed
    is the optional `deepspeed` extra."""
    from importlib.util import find_spec

    if find_spec("deepspeed") is None:
        raise ImportError("trainer.strategy 'deepspeed' needs DeepSpeed, which is not installed: pip install 'tidal[deepspeed]'")
    from tidal.trainer.deepspeed_strategy import DeepSpeedStrategy

    return DeepSpeedStrategy(cfg, ctx)


STRATEGIES = {"single": SingleStrategy, "fsdp2": FSDP2Strategy, "deepspeed": deepspeed_strategy}


def build_strategy(cfg: TrainerConfig, ctx: DistContext) -> Strategy:
    name = resolve_strategy_name(cfg.strategy, ctx.world_size)
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy {name!r} is not available (one of {sorted(STRATEGIES)})")
    return STRATEGIES[name](cfg, ctx)

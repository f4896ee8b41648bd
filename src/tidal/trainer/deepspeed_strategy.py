"""DeepSpeed ZeRO (stage 2 or 3) as a trainer strategy: `trainer.strategy: deepspeed`, `trainer.zero_stage`.

The update must equal one process's: the summed per-token loss numerators of every rank,
divided once by the global unit count N at the step. DeepSpeed's engine wants to own three things
that get in the way, and each is pinned here:

- *accumulation*: Tidal streams a number of micro-batches not known in advance, so the engine runs
  with `managed_gradient_accumulation: false` (DeepSpeed >= 0.19.8): `backward` only accumulates
  (ZeRO-2/3 still reduce-scatter every backward, which is why the learner's padding micro-batches
  give every rank the same count), and each `step` is the boundary. Micro-batch 1 and accumulation
  steps 1 keep DeepSpeed from dividing the loss by a fixed accumulation count.
- *averaging over ranks*: ZeRO averages the reduced gradients (ZeRO-3 offers no `sum`), so the
  accumulated gradient is sum/W.
- *the loss scale*: the ZeRO optimizer's step divides the gradients by its loss scale, clips by the
  global norm computed on the scaled gradients divided by that same scale, and reports that norm.
  Tidal sets the loss scale to N/W for that one step (`set_gradient_divisor`), so the step applies
  exactly sum/N, clips by the true global norm (DeepSpeed's `gradient_clipping` = trainer.max_grad_norm)
  and reports it; at every other time the scale is 1 and backward passes are unscaled.

The normalisation leans on one DeepSpeed detail beyond its config and engine API, isolated in
`set_gradient_divisor` (`override_loss_scale`, the ZeRO optimizers' custom-loss-scaler hook). The
optimizer shards need a second, `fp32_partitions` (where ZeRO keeps this rank's fp32 partitions),
and ZeRO-3 weights are read and written through the documented ZeRO-3 parameter attributes
(`ds_tensor`, `ds_numel`) and `deepspeed.zero.GatheredParameters`. tests/test_deepspeed.py fails if a
DeepSpeed version changes any of them (a contract test for the divisor, exact resume for the shards,
gradients and weights against one process for the rest).

`wrap` returns a `DeepSpeedModule` (the model, with forward passes through the engine). Frozen
copies (reference, old policy): under ZeRO-3 a ZeRO-3 inference engine (partitioned like the policy,
no optimizer), under ZeRO-2 the plain module on every rank (ZeRO-2 does not partition weights either).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from tidal.config import TrainerConfig
from tidal.trainer.deepspeed_config import deepspeed_config, frozen_config
from tidal.trainer.distributed import DistContext, ensure_process_group
from tidal.trainer.packing import enable_activation_checkpointing

INSTALL_HINT = "pip install 'tidal[deepspeed]'"
ACCELERATORS = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}


def _missing() -> ImportError:
    return ImportError(f"trainer.strategy 'deepspeed' needs DeepSpeed, which is not installed: {INSTALL_HINT}")


def import_deepspeed(device_type: str):
    """DeepSpeed, with its accelerator matching Tidal's device (DS_ACCELERATOR, unless already set).
    On CPU the shared-memory all-reduce op is not built: only DeepSpeed's inference tensor
    parallelism uses it (ZeRO's collectives are the process group's), and it is a C++ JIT
    compile on a fresh environment. DeepSpeed keeps its op-compatibility table as a module dict
    whose edits persist (deepspeed/ops/__init__.py), so the op is marked unavailable there."""
    os.environ.setdefault("DS_ACCELERATOR", ACCELERATORS.get(device_type, device_type))
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as err:
        raise _missing() from err
    if os.environ["DS_ACCELERATOR"] == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


# --- the DeepSpeed details beyond its config and engine API ---------------------------------------------


def set_gradient_divisor(zero_optimizer, divisor: float) -> None:
    """Makes the ZeRO optimizer's next `step` divide the accumulated gradients by `divisor`.

    Uses the ZeRO-2/3 optimizers' custom loss-scaler hook, `override_loss_scale`: with it set,
    `engine.backward` multiplies the loss by the scale and the optimizer's `step` divides the
    gradients by it (`unscale_and_clip_grads`), clips with `gradient_clipping` against the norm of
    the scaled gradients divided by it, and reports that norm (`engine.get_global_grad_norm`).
    Tidal keeps it at 1.0 through the backward passes (an exact no-op) and sets it to N/W for the
    step only. tests/test_deepspeed.py::test_gradient_divisor_contract fails if a DeepSpeed version
    changes any of that."""
    zero_optimizer.override_loss_scale(float(divisor))


def fp32_partitions(zero_optimizer) -> list[torch.Tensor]:
    """This rank's flat fp32 master partitions, the tensors the torch optimizer steps and keys its
    state by (one per ZeRO parameter group, or ZeRO-3 sub-group).

    ZeRO-2 keeps them in `single_partition_of_fp32_groups`, ZeRO-3 in `fp32_partitioned_groups_flat`
    (ZeRO-3 empties the torch optimizer's param_groups between steps, so they cannot be read from
    there). tests/test_deepspeed.py's resume check fails if a DeepSpeed version moves them."""
    for attribute in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        partitions = getattr(zero_optimizer, attribute, None)
        if partitions is not None:
            if any(p is None for p in partitions):
                raise NotImplementedError("deepspeed strategy: optimizer state swapped to NVMe has no partition to save")
            return list(partitions)
    raise NotImplementedError(
        f"deepspeed strategy: no fp32 partitions on {type(zero_optimizer).__name__} (a DeepSpeed version this strategy does not know)"
    )


# --- what wrap returns -------------------------------------------------------------------------------------


class DeepSpeedModule(torch.nn.Module):
    """What `wrap` returns, for the policy and the frozen copies: the model as the learner and the
    trainer loop use it (attributes such as `config` and `get_input_embeddings`, `parameters()`,
    `state_dict()` with the model's own keys, `train()`/`eval()`), with forward passes through the
    DeepSpeed engine when there is one (the engine's forward arms its backward hooks). The engine
    itself cannot be handed out: its `config` attribute is DeepSpeed's config, and its state-dict
    keys carry a `module.` prefix.

    Under ZeRO-3, `state_dict()` holds empty placeholders for partitioned weights (use the
    strategy's `full_state_dict` for the weights), and `load_state_dict` accepts such a dict from
    the policy (what `Learner.begin_iteration` passes to the old policy): see `load_partitioned`."""

    def __init__(self, module: torch.nn.Module, engine=None, source=None):
        super().__init__()
        self.module = module
        self.__dict__["engine"] = engine
        self.__dict__["_source"] = source  # () -> the policy's DeepSpeedModule, once it exists

    def forward(self, *args, **kwargs):
        return (self.engine or self.module)(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def train(self, mode: bool = True):
        if self.engine is not None:
            self.engine.train(mode)
        return super().train(mode)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not partitioned(self.module):
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        source = self._source() if self._source else None
        load_partitioned(self.module, state_dict, source.module if source is not None else None, strict=strict)
        return torch.nn.modules.module._IncompatibleKeys([], [])


def partitioned(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def load_partitioned(module: torch.nn.Module, state: dict[str, torch.Tensor], source: torch.nn.Module | None = None, strict: bool = True) -> None:
    """Loads `state` into a ZeRO-3 partitioned `module` on this rank alone (no communication).

    A full tensor is split: this rank keeps its partition. An empty one is the placeholder a
    partitioned module's `state_dict()` holds: its partition is copied from `source`, the module it
    came from, partitioned the same way (the policy, for the old policy's per-iteration copy). A
    missing `lm_head.*` is fine when the embeddings are tied (saved weights drop the alias)."""
    own = module.state_dict(keep_vars=True)  # tied aliases map to the same parameter
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    missing = sorted(k for k in set(own) - set(state) if not (tied and k.startswith("lm_head.")))
    unexpected = sorted(set(state) - set(own))
    if unexpected or (strict and missing):
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    source_state = source.state_dict(keep_vars=True) if source is not None else {}
    with torch.no_grad():
        for name, value in state.items():
            target = own[name]
            if not hasattr(target, "ds_id"):
                target.copy_(value)
            elif value.numel() == 0 and target.ds_numel > 0:
                origin = source_state.get(name)
                if not hasattr(origin, "ds_tensor") or origin.ds_tensor.shape != target.ds_tensor.shape:
                    raise ValueError(f"{name}: an empty (ZeRO-3 partitioned) entry, and no identically partitioned source to copy it from")
                target.ds_tensor.copy_(origin.ds_tensor)
            else:
                _set_partition(target, value)


def _set_partition(param, full: torch.Tensor) -> None:
    """This rank's ZeRO-3 partition of `param` from its full value, with no communication (DeepSpeed
    splits a flattened parameter into world-size equal chunks, the last zero-padded)."""
    part = param.ds_tensor
    rank = dist.get_rank()
    flat = full.detach().reshape(-1).to(part.dtype)
    start = min(rank * part.numel(), flat.numel())
    chunk = flat[start : start + part.numel()]
    part.zero_()
    part.view(-1)[: chunk.numel()].copy_(chunk)
    if param.data.numel() == flat.numel():  # a persistent (never partitioned) or currently gathered parameter
        param.data.copy_(flat.view_as(param.data))


# --- the strategy -------------------------------------------------------------------------------------------


class DeepSpeedStrategy:
    name = "deepspeed"

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, device_type: str | None = None):
        from tidal.devices import resolve_device

        self.cfg, self.ctx = cfg, ctx
        self.device_type = device_type or resolve_device(cfg.device).partition(":")[0]
        self.deepspeed = import_deepspeed(self.device_type)
        ensure_process_group(ctx, self.device_type)
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))  # DeepSpeed insists; torchrun sets it, one process does not
        self.world_size = dist.get_world_size()
        self.config = deepspeed_config(cfg, self.world_size)
        self.engine = None
        self.policy: DeepSpeedModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._backwards = 0  # since the last step; every rank runs the same count
        self._stepped = False

    @property
    def stage(self) -> int:
        return self.cfg.zero_stage

    def wrap(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        if not trainable:
            return self._frozen(model)
        if self.engine is not None:
            raise ValueError("the deepspeed strategy wraps one trainable model (the policy)")
        if self.cfg.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            enable_activation_checkpointing(model)
        # only what trains (under LoRA the adapter) is in the optimizer; ZeRO partitions the frozen base too
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr, betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)
        engine, *_ = self.deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(self.config))
        set_gradient_divisor(engine.optimizer, 1.0)
        self.engine, self.optimizer = engine, optimizer
        self.policy = DeepSpeedModule(engine.module, engine)
        return self.policy

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        device = next(model.parameters()).device.type
        if self.stage != 3 or device != self.device_type:  # ZeRO-2, or a reference kept on another device
            if self.cfg.param_dtype == "bfloat16":  # computes like the policy, which DeepSpeed casts to bf16
                model = model.to(torch.bfloat16)
            return DeepSpeedModule(model)
        engine, *_ = self.deepspeed.initialize(model=model, config=frozen_config(self.config))
        return DeepSpeedModule(engine.module, engine, source=lambda: self.policy).eval()

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The torch AdamW the engine steps (over this rank's fp32 partitions): the learner's LambdaLR
        sets its learning rate. DeepSpeed's ZeRO wrapper is not a torch Optimizer."""
        if self.optimizer is None or model is not self.policy:
            raise ValueError("make_optimizer: wrap the policy (trainable=True) first")
        return self.optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self._backwards += 1

    def zero_grad(self, model: torch.nn.Module) -> None:
        """The engine's step leaves no gradient behind (its ZeRO buffers are reset there)."""
        if self._backwards:
            raise RuntimeError("deepspeed strategy: gradients were accumulated and never stepped")

    def scale_gradients(self, model: torch.nn.Module, factor: float) -> None:
        """Applied inside the step: the engine holds sum/W, the step divides by 1/(factor*W)."""
        set_gradient_divisor(self.engine.optimizer, 1.0 / (factor * self.world_size))

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """DeepSpeed clips inside its optimizer step, with the norm it computes there: so this *is* the
        step (divide by N/W, clip by the global norm with gradient_clipping = trainer.max_grad_norm,
        AdamW) and returns the global norm before clipping; `optimizer_step` has nothing left to do."""
        if max_norm != self.config["gradient_clipping"]:
            raise ValueError(
                f"deepspeed strategy: clipping at {max_norm}, but the engine was configured with gradient_clipping {self.config['gradient_clipping']}"
            )
        self._stepped = True
        if not self._backwards:  # nothing accumulated on any rank (the counts are equal): no update, like torch's grad=None
            set_gradient_divisor(self.engine.optimizer, 1.0)
            return 0.0
        try:
            self.engine.step()
        finally:
            set_gradient_divisor(self.engine.optimizer, 1.0)
            self._backwards = 0
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._stepped:
            raise RuntimeError("deepspeed strategy: clip_grad_norm runs the engine's step; call it before optimizer_step")
        self._stepped = False

    # --- weights ---

    def _module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DeepSpeedModule) else model

    def reshard(self, model: torch.nn.Module) -> None:
        """ZeRO-3: releases every gathered parameter to its partition, as the engine's step does. A forward
        alone leaves gathered what its prefetching fetched ahead along the recorded trace (under LoRA the
        old adapter, which the training forwards ran next); the old adapter's copy into its partition at
        the next iteration would then leave that stale full value in place for the forward to use. ZeRO-2
        does not partition weights."""
        if self.stage == 3 and model is self.policy:
            self.engine.empty_partition_cache()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A collective under ZeRO-3 (parameters gathered one at a time): rank 0 gets the full weights
        on the CPU, the others {}. The model's own dtype (bf16 under bf16 training)."""
        module = self._module(model)
        main = dist.get_rank() == 0
        state = {}
        gathered: dict[int, torch.Tensor] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if hasattr(tensor, "ds_id"):
                if id(tensor) not in gathered:
                    with self.deepspeed.zero.GatheredParameters([tensor]):
                        gathered[id(tensor)] = tensor.detach().cpu().clone() if main else None
                value = gathered[id(tensor)]
            else:
                value = tensor.detach().cpu().clone() if main else None
            if main:
                state[name] = value
        if getattr(getattr(module, "config", None), "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        return state

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full weights (read from the shared weight store); each keeps its
        part, with no communication, and refreshes the optimizer's fp32 master partitions from them."""
        module = self._module(model)
        if partitioned(module):
            load_partitioned(module, state, strict=True)
        else:
            from tidal.model.loading import load_state_dict_tied

            load_state_dict_tied(module, state)
        if model is self.policy:
            self.engine.optimizer.refresh_fp32_params()

    def trainable_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A collective under ZeRO-3 (each parameter gathered in turn): rank 0 gets the full values."""
        main = dist.get_rank() == 0
        out = {}
        for name, p in self._module(model).named_parameters():
            if not p.requires_grad:
                continue
            if hasattr(p, "ds_id"):
                with self.deepspeed.zero.GatheredParameters([p]):
                    value = p.detach().cpu().clone() if main else None
            else:
                value = p.detach().cpu().clone() if main else None
            if main:
                out[name] = value
        return out

    def load_partial_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full values of some parameters; each keeps its part, with no
        communication, and the optimizer's fp32 master partitions follow."""
        module = self._module(model)
        if partitioned(module):
            load_partitioned(module, state, strict=False)
        else:
            unexpected = module.load_state_dict(state, strict=False).unexpected_keys
            if unexpected:
                raise ValueError(f"weights do not fit the model: unexpected {sorted(unexpected)[:5]}")
        if model is self.policy:
            self.engine.optimizer.refresh_fp32_params()

    def copy_parameter(self, target: torch.nn.Parameter, source: torch.nn.Parameter) -> None:
        """This rank's part: under ZeRO-3 the partition (and the full value of a parameter kept whole)."""
        with torch.no_grad():
            if hasattr(target, "ds_tensor"):
                target.ds_tensor.copy_(source.ds_tensor)
                if target.data.numel() == target.ds_numel and source.data.numel() == source.ds_numel:
                    target.data.copy_(source.data)
            else:
                target.copy_(source)

    # --- optimizer shards ---

    def _partitions(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"zero{self.stage}.partition{i}", p) for i, p in enumerate(fp32_partitions(self.engine.optimizer))]

    def optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This rank's partition: AdamW's moments and step per flat partition, and the fp32 master
        partition itself when the model's weights are lower precision (bf16) so a resumed run
        continues from the same master weights."""
        low_precision = any(p.dtype != torch.float32 for p in self._module(model).parameters())
        out = {}
        for name, p in self._partitions():
            for key, value in optimizer.state.get(p, {}).items():
                out[f"{name}::{key}"] = (value if torch.is_tensor(value) else torch.as_tensor(value)).detach().cpu().clone()
            if low_precision:
                out[f"{name}::fp32_master"] = p.detach().cpu().clone()
        return out

    def load_optimizer_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
        """Restores a shard written by `optimizer_tensors` at the same world size and zero stage
        (load the full weights first, as resuming does)."""
        partitions = dict(self._partitions())
        for key, value in tensors.items():
            name, field = key.rsplit("::", 1)
            if name not in partitions:
                raise ValueError(f"optimizer shard entry {key!r} has no partition here (saved with another zero_stage or model?)")
            p = partitions[name]
            if field != "step" and value.shape != p.shape:
                raise ValueError(f"optimizer shard entry {key!r} has shape {tuple(value.shape)}, this rank's partition {tuple(p.shape)}")
            if field == "fp32_master":
                with torch.no_grad():
                    p.copy_(value)
            else:
                optimizer.state[p][field] = value.clone() if field == "step" else value.to(p.device, copy=True)

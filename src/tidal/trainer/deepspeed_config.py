"""The DeepSpeed config of `trainer.strategy: deepspeed`: the keys Tidal must own (its streaming
accumulation and 1/N normalisation, see deepspeed_strategy), checked against the user's
`trainer.deepspeed` pass-through and merged into it. Torch-free: config validation uses it."""

from __future__ import annotations

import copy
from typing import Any

DS_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NO_PRINT = 2**31 - 1  # steps_per_print: DeepSpeed's own progress lines are noise next to Tidal's metrics

STREAMING = "Tidal streams a variable number of packed micro-batches per step (trainer.token_budget) and normalises once at the step (docs/design.md, loss normalisation)"
NORMALISATION = "Tidal's 1/N normalisation needs DeepSpeed's plain mean over ranks (docs/design.md, loss normalisation)"


# --- the DeepSpeed config: Tidal's keys, the user's pass-through ------------------------------------------


def _owned_keys(cfg, world_size: int | None) -> list[tuple[str, Any, str]]:
    """(dotted key, the value Tidal needs, where it comes from). world_size None: skip world-dependent keys."""
    owned = [
        ("train_micro_batch_size_per_gpu", 1, STREAMING),
        ("gradient_accumulation_steps", 1, STREAMING),
        ("managed_gradient_accumulation", False, STREAMING),
        ("gradient_clipping", cfg.max_grad_norm, "trainer.max_grad_norm"),
        ("zero_optimization.stage", cfg.zero_stage, "trainer.zero_stage"),
        ("bf16.enabled", cfg.param_dtype == "bfloat16", "trainer.param_dtype"),
        ("fp16.enabled", False, "trainer.param_dtype (float16's dynamic loss scale would share the slot Tidal's normalisation uses)"),
        ("gradient_allreduce_op", "mean", NORMALISATION),
        ("prescale_gradients", False, NORMALISATION),
        ("gradient_predivide_factor", 1.0, NORMALISATION),
        ("zero_allow_untested_optimizer", True, "trainer.lr/betas/weight_decay (Tidal hands DeepSpeed a torch AdamW)"),
    ]
    if cfg.param_dtype == "bfloat16":  # without it ZeRO-2 under bf16 would apply a step whose gradient norm is inf or NaN
        owned.append(("bf16.check_grad_overflow", True, "trainer.max_skipped_steps (a non-finite gradient norm skips the step)"))
    if cfg.reduce_dtype is not None:
        owned.append(("communication_data_type", DS_DTYPES[cfg.reduce_dtype], "trainer.reduce_dtype"))
    if cfg.cpu_offload:
        owned.append(("zero_optimization.offload_optimizer.device", "cpu", "trainer.cpu_offload"))
        if cfg.zero_stage == 3:
            owned.append(("zero_optimization.offload_param.device", "cpu", "trainer.cpu_offload"))
    if world_size is not None:
        owned.append(("train_batch_size", world_size, f"the trainer's {world_size} rank(s) x micro-batch 1 ({STREAMING})"))
    return owned


FORBIDDEN_BLOCKS = {
    "optimizer": "Tidal builds the optimizer (torch AdamW from trainer.lr, trainer.betas, trainer.weight_decay)",
    "scheduler": "the learner owns the learning-rate schedule (trainer.warmup_steps)",
}


def _get(tree: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _put(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def check_user_config(cfg, world_size: int | None = None) -> None:
    """A key of `trainer.deepspeed` that contradicts one Tidal must own is an error naming both."""
    user = cfg.deepspeed or {}
    for block, why in FORBIDDEN_BLOCKS.items():
        if block in user:
            raise ValueError(f"trainer.deepspeed.{block} cannot be set: {why}")
    if cfg.param_dtype == "float16":
        raise ValueError(
            "trainer.param_dtype float16 is not supported by trainer.strategy 'deepspeed': its dynamic loss scale would "
            "share the slot Tidal's 1/N normalisation uses; use bfloat16 (or float32)"
        )
    for key, value, source in _owned_keys(cfg, world_size):
        present, given = _get(user, key)
        if present and given != value:
            raise ValueError(f"trainer.deepspeed.{key} is {given!r} but Tidal sets it to {value!r} from {source}: remove it from trainer.deepspeed")


def deepspeed_config(cfg, world_size: int) -> dict:
    """The policy engine's DeepSpeed config: the user's `trainer.deepspeed` with Tidal's keys set."""
    check_user_config(cfg, world_size)
    merged = copy.deepcopy(cfg.deepspeed or {})
    for key, value, _ in _owned_keys(cfg, world_size):
        _put(merged, key, value)
    if cfg.cpu_offload:  # the torch AdamW Tidal hands over, not DeepSpeedCPUAdam (a C++ op)
        merged.setdefault("zero_force_ds_cpu_optimizer", False)
    merged.setdefault("steps_per_print", NO_PRINT)
    return merged


def frozen_config(policy_config: dict) -> dict:
    """A ZeRO-3 inference engine for the frozen copies: the policy's partitioning, dtype and
    offload of parameters, no optimizer."""
    zero = {k: v for k, v in policy_config["zero_optimization"].items() if k != "offload_optimizer"}
    out = {k: policy_config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print")}
    out["zero_optimization"] = zero
    for key in ("bf16", "communication_data_type"):
        if key in policy_config:
            out[key] = policy_config[key]
    return out

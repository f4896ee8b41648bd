"""The `trainer` block: the algorithm, its optimizer, and how the trainer runs (device, ranks, threads)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tidal.algo.names import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from tidal.config.base import Strict, built_in
from tidal.config.model import Dtype


class TrainerConfig(Strict):
    iterations: int = Field(30, gt=0, description="Iterations the run trains in all; raise it and re-run the same command to train on.")
    prompts_per_iteration: int = Field(16, gt=0, description="Prompts (groups) per iteration.")
    updates_per_iteration: int = Field(1, gt=0, description=">1: PPO-style mini-batch steps against the old policy.")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(3, ge=0, description="Linear learning-rate warm-up, in optimizer steps; constant after.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clipping.")
    advantage: str = Field(
        "grpo",
        description="The advantage estimator: a built-in, a name registered with tidal.algo.register_advantage, or `module:function`.",
        json_schema_extra=built_in("advantage estimator"),
    )
    std_normalize: bool = Field(True, description="grpo only: divide by the group's reward std.")
    policy_loss: str = Field(
        "ppo_clip",
        description="The policy loss: a built-in, a name registered with tidal.algo.register_policy_loss, or `module:function`.",
        json_schema_extra=built_in("policy loss"),
    )
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (the upper side too, unless `clip_eps_high`).")
    clip_eps_high: float | None = Field(None, gt=0, description="DAPO clip-higher; unset: same as clip_eps.")
    loss_aggregation: Literal[LOSS_AGGREGATIONS] = Field(
        "token_mean", description="How per-token losses are averaged; each is exact under streaming."
    )
    aggregation_constant: float | None = Field(None, gt=0, description="seq_mean_token_sum_norm's normaliser; unset: rollout.max_new_tokens.")
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient against the frozen reference; at 0 no reference is loaded.")
    kl_estimator: Literal[KL_ESTIMATORS] = Field("k3", description="KL estimator (Schulman's k1, k2, k3).")
    kl_in_reward: bool = Field(False, description="True: KL is a reward penalty instead of a loss term.")
    reference_device: str | None = Field(None, description='E.g. "cpu" to offload the reference; unset: with the policy.')
    tis_cap: float | None = Field(None, gt=0, description="Truncated importance sampling vs the engine's log-probs.")
    behaviour_weight_cap: float = Field(
        5.0,
        gt=0,
        description="Mode bounded: cap of the decoupled-PPO weight pi_proximal / pi_behaviour on stale samples (AReaL's "
        "behaviour importance-weight cap); tis_cap, when set, caps every sample instead.",
    )
    dynamic_sampling: bool = Field(False, description="DAPO: drop all-equal-reward groups, replace with new prompts.")
    max_replacements: int | None = Field(None, ge=0, description="Per iteration; unset: 4 x prompts_per_iteration.")
    attention: Literal["auto", "sdpa", "segmented", "flex", "naive"] = Field(
        "auto", description="Shared-prompt kernel; auto: flex on CUDA, else segmented; flex trains on CUDA only."
    )
    token_budget: int = Field(16384, gt=0, description="Tokens per packed micro-batch.")
    device: str = Field("auto", description="auto: CUDA, else an Ascend NPU, else CPU.")
    strategy: Literal["auto", "single", "fsdp2", "deepspeed"] = Field(
        "auto",
        description="Several trainer ranks (torchrun): auto is single at one rank, fsdp2 above; deepspeed needs the `deepspeed` extra.",
    )
    zero_stage: Literal[2, 3] = Field(2, description="deepspeed: the DeepSpeed ZeRO stage.")
    deepspeed: dict[str, Any] | None = Field(
        None,
        description="A DeepSpeed config passed through (`strategy: deepspeed` only). Tidal sets micro-batch, accumulation, "
        "optimizer, clipping, stage, dtype: a contradiction is an error.",
    )
    ranks: int = Field(
        1, gt=0, description="Trainer ranks `tidal run` starts on this machine (under torchrun; the PyTorchJob sets its own world size)."
    )
    param_dtype: Dtype | None = Field(None, description="fsdp2 mixed precision; unset: the model's dtype.")
    reduce_dtype: Dtype | None = Field(None, description="fsdp2 gradient reduction dtype.")
    cpu_offload: bool = Field(False, description="fsdp2: parameters, gradients and optimizer state on the CPU.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    threads: PositiveInt | Literal["auto"] | None = Field(
        None, description="Unset: an even split of the cores (sync mode: every core); auto: tidal plan's."
    )
    tail_threads: PositiveInt | Literal["auto"] | None = Field(
        "auto",
        description="Periodic mode: once every group of an iteration is in, the workers wait for the next weights, so the "
        "trainer may use their cores for the rest of the iteration. auto: in `tidal run`, its own threads and its workers' "
        "together; a number: that many; unset: trainer.threads throughout (e.g. a pod).",
    )
    group_timeout_seconds: float = Field(600.0, gt=0, description="An iteration fails when no group has arrived for this long.")
    max_skipped_steps: int = Field(
        3, ge=0, description="Optimizer steps a run may skip for a non-finite loss or gradient norm (weights kept) before it fails."
    )

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _registered_name(cls, name: str, info: ValidationInfo) -> str:
        if name in (ADVANTAGES if info.field_name == "advantage" else POLICY_LOSSES):  # reading a config should not wait for torch
            return name
        from tidal.algo import advantage_fn, policy_loss_fn  # lazy: the registries import torch

        try:
            (advantage_fn if info.field_name == "advantage" else policy_loss_fn)(name)
        except ValueError as err:  # a custom error keeps the message free of pydantic's "Value error, " prefix
            raise PydanticCustomError("unregistered_name", "{reason}", {"reason": str(err)}) from None
        return name

    @model_validator(mode="after")
    def _deepspeed_passthrough(self) -> TrainerConfig:
        if self.deepspeed is not None and self.strategy != "deepspeed":
            reason = f"trainer.deepspeed is set but trainer.strategy is {self.strategy!r}: it applies to strategy 'deepspeed' only"
            raise PydanticCustomError("deepspeed_config", "{reason}", {"reason": reason})
        if self.strategy == "deepspeed":
            from tidal.trainer.deepspeed_config import check_user_config

            try:
                check_user_config(self)
            except ValueError as err:
                raise PydanticCustomError("deepspeed_config", "{reason}", {"reason": str(err)}) from None
        return self

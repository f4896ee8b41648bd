"""The tri-model trainer: policy (trainable), old policy (only when an iteration takes more than one
optimizer step) and frozen reference (only when the KL coefficient is > 0), one packing path.

Loss normalisation under streaming (DESIGN §4): the aggregation's denominator (response tokens or
sequences of the update) is unknown until the last group is in, so we accumulate the gradient of
the *numerator* group by group and scale the gradients by 1/units just before the step. Gradients
are linear in the loss, so this equals the synchronous update.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from tidal.algo import (
    aggregate_numerator,
    compute_advantages,
    kl_estimate,
    kl_reward_penalty,
    logprob_mismatch,
    overlong_penalty,
    policy_token_loss,
    truncated_importance_weights,
)
from tidal.config import RewardConfig, TrainerConfig
from tidal.devices import resolve_device
from tidal.model.loading import load_state_dict_tied
from tidal.model.packing import GroupTokenLogprobs, naive_token_logprobs, pack_groups, packed_token_logprobs, split_into_microbatches


def warmup_then_constant(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / (warmup_steps + 1))


def as_packing_group(group: dict) -> tuple[list[int], list[list[int]]]:
    return [int(t) for t in group["prompt_ids"]], [[int(t) for t in r["token_ids"]] for r in group["responses"]]


def padded(rows: list, width: int) -> torch.Tensor:
    """Per-response float arrays -> [G, width], zero-padded."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        out[i, :n] = torch.as_tensor(np.asarray(r[:n], dtype=np.float32))
    return out


def token_logprobs(model, groups: list[tuple], temperature: float, attention: str, device: str, with_entropy: bool = False) -> list[GroupTokenLogprobs]:
    """Per-token log-probs of every response: the shared-prompt packed layout, or the naive one."""
    if attention == "naive":
        return naive_token_logprobs(model, groups, temperature, with_entropy)
    return packed_token_logprobs(model, pack_groups(groups, device=device), temperature, attention, with_entropy)


class Learner:
    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module, pad_id: int, temperature: float = 1.0, reward_cfg: RewardConfig | None = None, max_new_tokens: int = 0):
        self.cfg = cfg
        self.reward_cfg = reward_cfg or RewardConfig()
        self.max_new_tokens = max_new_tokens
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device)
        self.pad_id = pad_id
        self.temperature = temperature
        self.reference = None
        self.reference_device = resolve_device(cfg.reference_device, "trainer.reference_device") if cfg.reference_device else self.device
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).to(self.reference_device).eval().requires_grad_(False)
        self.old_policy = copy.deepcopy(model).eval().requires_grad_(False) if cfg.updates_per_iteration > 1 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(cfg.warmup_steps))
        self.forwards = {"policy": 0, "old": 0, "reference": 0}
        self._reset()

    def _reset(self) -> None:
        self.units = 0.0
        self.tokens = 0
        self.groups = 0
        self.sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipped": 0.0, "computed_tokens": 0.0, "mismatch": 0.0, "tis_truncated": 0.0, "ratio_max": 0.0}
        self.model.zero_grad(set_to_none=True)

    def begin_iteration(self) -> None:
        """The old policy is the weights that generated this iteration's data."""
        if self.old_policy is not None:
            self.old_policy.load_state_dict(self.model.state_dict())

    def _frozen_logprobs(self, model, groups: list[tuple], device: str, role: str) -> list[torch.Tensor]:
        self.forwards[role] += 1
        with torch.no_grad():
            outs = token_logprobs(model, groups, self.temperature, self.cfg.attention, device)
        return [o.logprobs.to(self.device) for o in outs]

    def shaped_rewards(self, group: dict, lengths: torch.Tensor) -> torch.Tensor:
        rewards = torch.tensor([float(r["reward"]) for r in group["responses"]], device=lengths.device)
        if self.reward_cfg.overlong_buffer:
            rewards = rewards + overlong_penalty(lengths, self.max_new_tokens, self.reward_cfg.overlong_buffer, self.reward_cfg.overlong_penalty)
        return rewards

    def train_on_groups(self, groups: list[dict]) -> int:
        """Adds the groups' loss-numerator gradients, packed into micro-batches. Returns their token count."""
        total = 0
        live = []
        for g in groups:
            if self._contributes_no_gradient(g):
                total += self._count_only(g)
            else:
                live.append(g)
        packing = [as_packing_group(g) for g in live]
        start = 0
        for micro in split_into_microbatches(packing, self.cfg.token_budget):
            total += self._train_microbatch(live[start : start + len(micro)], micro)
            start += len(micro)
        return total

    def _contributes_no_gradient(self, group: dict) -> bool:
        """Zero advantage everywhere and no KL term: the gradient is exactly zero, skip the forward."""
        if self.reference is not None:
            return False
        lengths = torch.tensor([len(r["token_ids"]) for r in group["responses"]])
        rewards = self.shaped_rewards(group, lengths)
        return bool((compute_advantages(self.cfg.advantage, rewards, self.cfg.std_normalize) == 0).all())

    def _count_only(self, group: dict) -> int:
        lengths = [len(r["token_ids"]) for r in group["responses"]]
        mask = torch.zeros(len(lengths), max(1, max(lengths)))
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        _, units = aggregate_numerator(torch.zeros_like(mask), mask, self.cfg.loss_aggregation, self.cfg.aggregation_constant or self.max_new_tokens)
        self.units += units
        self.tokens += sum(lengths)
        self.groups += 1
        return sum(lengths)

    def train_on_group(self, group: dict) -> int:
        return self.train_on_groups([group])

    def _train_microbatch(self, groups: list[dict], packing: list[tuple]) -> int:
        cfg = self.cfg
        self.model.train()
        self.forwards["policy"] += 1
        outs = token_logprobs(self.model, packing, self.temperature, cfg.attention, self.device, with_entropy=True)
        old = self._frozen_logprobs(self.old_policy, packing, self.device, "old") if self.old_policy is not None else None
        ref = self._frozen_logprobs(self.reference, packing, self.reference_device, "reference") if self.reference is not None else None
        numerator = None
        n_tokens = 0
        for i, (group, out) in enumerate(zip(groups, outs)):
            mask = out.mask.float()
            logp = out.logprobs
            # One optimizer step per iteration: the old policy *is* the current one, ratio exactly 1.
            old_logp = old[i] if old is not None else logp.detach()
            rewards = self.shaped_rewards(group, mask.sum(-1))
            kl = kl_estimate(logp, ref[i], cfg.kl_estimator) if ref is not None else None
            if kl is not None and cfg.kl_in_reward:
                rewards = kl_reward_penalty(rewards, kl.detach(), mask, cfg.kl_coef)
            advantages = compute_advantages(cfg.advantage, rewards, cfg.std_normalize)[:, None]
            loss_tok, clipped = policy_token_loss(cfg.policy_loss, logp, old_logp, advantages, mask, cfg.clip_eps, cfg.clip_eps_high or cfg.clip_eps)
            rollout_logp = padded([r.get("logprobs", []) for r in group["responses"]], mask.shape[1]).to(logp.device)
            if cfg.tis_cap is not None:
                weights, truncated = truncated_importance_weights(old_logp, rollout_logp, cfg.tis_cap)
                loss_tok = loss_tok * weights
                self.sums["tis_truncated"] += float((truncated.float() * mask).sum())
            if kl is not None and not cfg.kl_in_reward:
                loss_tok = loss_tok + cfg.kl_coef * kl
            num, units = aggregate_numerator(loss_tok, mask, cfg.loss_aggregation, cfg.aggregation_constant or self.max_new_tokens)
            numerator = num if numerator is None else numerator + num
            group_tokens = int(mask.sum())
            n_tokens += group_tokens
            self.units += units
            with torch.no_grad():
                self.sums["loss"] += float(num)
                self.sums["entropy"] += float((out.entropy * mask).sum())
                self.sums["clipped"] += float((clipped.float() * mask).sum())
                self.sums["computed_tokens"] += group_tokens
                self.sums["mismatch"] += logprob_mismatch(old_logp, rollout_logp, mask) * group_tokens
                self.sums["ratio_max"] = max(self.sums["ratio_max"], float((torch.exp(logp - old_logp) * mask).max()))
                if kl is not None:
                    self.sums["kl"] += float((kl.detach() * mask).sum())
        numerator.backward()
        self.tokens += n_tokens
        self.groups += len(groups)
        return n_tokens

    def step(self) -> dict[str, float]:
        """Scales the accumulated gradients by 1/units, clips, steps. Returns the update's metrics."""
        units = max(1.0, self.units)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(units)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        tokens = max(1.0, self.sums["computed_tokens"])
        metrics = {
            "policy_loss": self.sums["loss"] / units,
            "kl": self.sums["kl"] / tokens,
            "entropy": self.sums["entropy"] / tokens,
            "clip_fraction": self.sums["clipped"] / tokens,
            "ratio_max": self.sums["ratio_max"],
            "logprob_mismatch": self.sums["mismatch"] / tokens,
            "tis_truncated_fraction": self.sums["tis_truncated"] / tokens,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "learning_rate": lr,
            "trained_tokens": float(self.tokens),
        }
        self._reset()
        self.model.eval()
        return metrics

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_state_dict_tied(self.model, state_dict)

    # Optimizer state as plain tensors (safetensors) so a restarted trainer resumes without pickle.
    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        names = {p: n for n, p in self.model.named_parameters()}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                out[f"{names[p]}::{key}"] = torch.as_tensor(value).detach().cpu().clone()
        out["__scheduler_step__"] = torch.tensor(self.scheduler.last_epoch)
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            if key == "__scheduler_step__":
                continue
            name, field = key.rsplit("::", 1)
            # Moments live beside their parameter; AdamW keeps its `step` counter on the CPU.
            self.optimizer.state[params[name]][field] = value.clone() if field == "step" else value.to(params[name].device, copy=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(self.cfg.warmup_steps))
        for _ in range(int(tensors.get("__scheduler_step__", torch.tensor(0)))):
            self.scheduler.step()


def merge_updates(updates: list[dict]) -> dict[str, float]:
    """One iteration's metrics from its optimizer steps: token counts add up, the rest average."""
    merged = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    merged["trained_tokens"] = float(sum(u["trained_tokens"] for u in updates))
    merged["ratio_max"] = float(max(u["ratio_max"] for u in updates))
    merged["optimizer_steps"] = float(len(updates))
    return merged


def group_stats(groups: list[dict]) -> dict[str, float]:
    """Reward/accuracy/length statistics over every sample of an iteration."""
    rewards = np.array([r["reward"] for g in groups for r in g["responses"]], dtype=np.float64)
    correct = np.array([r.get("correct", 0.0) for g in groups for r in g["responses"]], dtype=np.float64)
    lengths = np.array([len(r["token_ids"]) for g in groups for r in g["responses"]], dtype=np.float64)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(correct.mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "generated_tokens": float(lengths.sum()),
        "samples": float(len(rewards)),
        "reward_errors": float(sum(g.get("reward_errors", 0) for g in groups)),
    }

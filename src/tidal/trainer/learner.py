"""The policy update: per-group losses accumulated as groups arrive, one optimizer step per iteration.

Token-level aggregation divides by the iteration's total response tokens, unknown until the last
group is in (DESIGN §4): we accumulate the *sum* of per-token losses and scale the gradients by
1/N_total just before the step. Gradients are linear in the loss, so this equals the synchronous update.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from tidal.algo import entropy_from_logits, grpo_advantages, kl_estimate, ppo_clip_token_loss, token_logprobs_from_logits
from tidal.config import TrainerConfig
from tidal.model.loading import load_state_dict_tied


def warmup_then_constant(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / (warmup_steps + 1))


def group_rows(group: dict, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Naive layout: one right-padded row per response, `prompt + response`.

    Returns input ids [G, L], attention mask [G, L], response mask [G, R] and the prompt length.
    """
    prompt = [int(t) for t in group["prompt_ids"]]
    responses = [[int(t) for t in r["token_ids"]] for r in group["responses"]]
    width = len(prompt) + max(len(r) for r in responses)
    ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    rmax = width - len(prompt)
    resp_mask = torch.zeros((len(responses), rmax), dtype=torch.float32)
    for i, r in enumerate(responses):
        row = prompt + r
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        resp_mask[i, : len(r)] = 1.0
    return ids, attn, resp_mask, len(prompt)


class Learner:
    """Holds the policy, the frozen reference (only when kl_coef > 0) and the optimizer."""

    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module, pad_id: int, temperature: float = 1.0):
        self.cfg = cfg
        self.model = model
        self.pad_id = pad_id
        self.temperature = temperature
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(cfg.warmup_steps))
        self._reset()

    def _reset(self) -> None:
        self.tokens = 0
        self.sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipped": 0.0, "computed_tokens": 0.0}
        self.model.zero_grad(set_to_none=True)

    def train_on_group(self, group: dict) -> int:
        """Adds one group's loss gradient (un-normalised sum). Returns its response token count."""
        rewards = torch.tensor([float(r["reward"]) for r in group["responses"]])
        advantages = grpo_advantages(rewards, self.cfg.std_normalize)
        ids, attn, resp_mask, plen = group_rows(group, self.pad_id)
        n_tokens = int(resp_mask.sum())
        self.tokens += n_tokens
        if self.reference is None and bool((advantages == 0).all()):
            return n_tokens  # zero advantage and no KL term: the gradient is exactly zero
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, plen - 1 : -1]
        targets = ids[:, plen:]
        logp = token_logprobs_from_logits(logits, targets, self.temperature)
        # One optimizer step per iteration: the old policy *is* the current one, so the ratio is 1.
        loss_tok, clipped = ppo_clip_token_loss(logp, logp.detach(), advantages[:, None], self.cfg.clip_eps, self.cfg.clip_eps)
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(input_ids=ids, attention_mask=attn).logits[:, plen - 1 : -1]
                ref_logp = token_logprobs_from_logits(ref_logits, targets, self.temperature)
            kl = kl_estimate(logp, ref_logp, "k3")
            loss_tok = loss_tok + self.cfg.kl_coef * kl
            self.sums["kl"] += float((kl.detach() * resp_mask).sum())
        loss_sum = (loss_tok * resp_mask).sum()
        loss_sum.backward()
        with torch.no_grad():
            self.sums["loss"] += float(loss_sum)
            self.sums["entropy"] += float((entropy_from_logits(logits.detach(), self.temperature) * resp_mask).sum())
            self.sums["clipped"] += float((clipped.float() * resp_mask).sum())
            self.sums["computed_tokens"] += n_tokens
        return n_tokens

    def step(self) -> dict[str, float]:
        """Scales the accumulated gradients by 1/N_total, clips, steps. Returns the update's metrics."""
        n = max(1, self.tokens)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(n)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        computed = max(1.0, self.sums["computed_tokens"])
        metrics = {
            "policy_loss": self.sums["loss"] / n,
            "kl": self.sums["kl"] / n,
            "entropy": self.sums["entropy"] / computed,
            "clip_fraction": self.sums["clipped"] / computed,
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
                out[f"{names[p]}::{key}"] = torch.as_tensor(value).detach().clone()
        out["__scheduler_step__"] = torch.tensor(self.scheduler.last_epoch)
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            if key == "__scheduler_step__":
                continue
            name, field = key.rsplit("::", 1)
            self.optimizer.state[params[name]][field] = value.clone()
        steps = int(tensors.get("__scheduler_step__", torch.tensor(0)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(self.cfg.warmup_steps), last_epoch=-1)
        for _ in range(steps):
            self.scheduler.step()


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

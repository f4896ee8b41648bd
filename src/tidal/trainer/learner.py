"""The tri-model trainer: policy (trainable), old policy (only when an iteration takes more than one
optimizer step) and frozen reference (only when the KL coefficient is > 0), one packing path.

Loss normalisation under streaming: the aggregation's denominator (response tokens or
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
    sampled_only,
    stale_token_weights,
)
from tidal.config import RewardConfig, TrainerConfig
from tidal.devices import resolve_device
from tidal.model.lora import OLD_ADAPTER, AdapterForward, adapter_keys, adapter_pairs, adapter_state_dict, add_old_adapter, is_lora
from tidal.model.probe import probe_logprobs, sample_responses
from tidal.protocol import Group, Sample
from tidal.trainer.assignment import assign_groups, group_token_count
from tidal.trainer.distributed import SINGLE, all_reduce_max, all_reduce_sum
from tidal.trainer.guard import record_skip, step_is_finite
from tidal.trainer.packing import (
    GroupTokenLogprobs,
    naive_token_logprobs,
    pack_groups,
    packed_row_logprobs,
    packed_token_logprobs,
    split_into_microbatches,
    stack_groups,
)
from tidal.trainer.strategy import SingleStrategy, Strategy
from tidal.trainer.vision_packing import has_images, naive_vision_token_logprobs, packed_vision_rows, packed_vision_token_logprobs


def warmup_then_constant(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / (warmup_steps + 1))


def as_packing_group(group: Group) -> tuple:
    """(prompt, responses, loss masks), and the prompt's processed images when it has any."""
    masks = [None if s.loss_mask is None else s.loss_mask.tolist() for s in group.samples]
    parts = (group.prompt_ids.tolist(), [s.token_ids.tolist() for s in group.samples], masks)
    return parts if group.images is None else (*parts, group.images)


def padded(rows: list, width: int) -> torch.Tensor:
    """Per-response float arrays -> [G, width], zero-padded (filled in numpy: a group's rows are a dozen
    tokens or so, where each torch call costs more than the copy)."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        out[i, :n] = r[:n]
    return torch.from_numpy(out)


def token_logprobs(
    model, groups: list[tuple], temperature: float, attention: str, device: str, with_entropy: bool = False
) -> list[GroupTokenLogprobs]:
    """Per-token log-probs of every response: the shared-prompt packed layout, or the naive one."""
    if has_images(groups):  # one vision-encoder call for the row, each group's images once (naive: once per sample)
        if attention == "naive":
            return naive_vision_token_logprobs(model, groups, temperature, with_entropy)
        return packed_vision_token_logprobs(model, groups, device, temperature, attention, with_entropy)
    if attention == "naive":
        return naive_token_logprobs(model, groups, temperature, with_entropy)
    return packed_token_logprobs(model, pack_groups(groups, device=device), temperature, attention, with_entropy)


def row_token_logprobs(model, groups: list[tuple], temperature: float, attention: str, device: str, with_entropy: bool = False) -> GroupTokenLogprobs:
    """`token_logprobs` as one block of response rows [responses, longest], every group's rows in order."""
    if attention == "naive":
        return stack_groups(token_logprobs(model, groups, temperature, attention, device, with_entropy))
    if has_images(groups):
        return packed_vision_rows(model, groups, device, temperature, attention, with_entropy)[1]
    return packed_row_logprobs(model, pack_groups(groups, device=device), temperature, attention, with_entropy)


class Learner:
    def __init__(
        self,
        cfg: TrainerConfig,
        model: torch.nn.Module,
        pad_id: int,
        temperature: float = 1.0,
        reward_cfg: RewardConfig | None = None,
        max_new_tokens: int = 0,
        strategy: Strategy | None = None,
        device: str | None = None,
    ):
        self.cfg = cfg
        self.reward_cfg = reward_cfg or RewardConfig()
        self.max_new_tokens = max_new_tokens
        self.strategy = strategy or SingleStrategy(cfg, SINGLE)
        self.ctx = self.strategy.ctx
        self.device = device or resolve_device(cfg.device)
        self.pad_id = pad_id
        self.temperature = temperature
        model = model.to(self.device)
        self.lora = is_lora(model)
        # the frozen copies are taken before the policy is sharded, and sharded alike (tri-model, one layout);
        # under LoRA the reference is the policy with its adapter disabled: no copy
        self.reference = None
        self.reference_device = resolve_device(cfg.reference_device, "trainer.reference_device") if cfg.reference_device else self.device
        self.reference_is_base = cfg.kl_coef > 0 and self.lora
        if self.reference_is_base:
            self.reference_device = self.device
        elif cfg.kl_coef > 0:
            frozen = copy.deepcopy(model).to(self.reference_device).eval().requires_grad_(False)
            self.reference = self.strategy.wrap(frozen, trainable=False)
        self.old_policy = None
        self.old_adapter: list[tuple] = []  # under LoRA: (old adapter's parameter, trained one's), copied each iteration
        if cfg.updates_per_iteration > 1 and self.lora:
            add_old_adapter(model)  # the old policy is a second adapter on the same base: no copy of the base
        elif cfg.updates_per_iteration > 1:
            self.old_policy = self.strategy.wrap(copy.deepcopy(model).eval().requires_grad_(False), trainable=False)
        self.peft_model = model if self.lora else None  # the unwrapped peft model (its names are the model's own)
        self.model = self.strategy.wrap(model, trainable=True)
        if cfg.updates_per_iteration > 1 and self.lora:
            self.old_adapter = adapter_pairs(model)
            self.old_policy = AdapterForward(self.model, OLD_ADAPTER)
        self.optimizer = self.strategy.make_optimizer(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(cfg.warmup_steps))
        self.forwards = {"policy": 0, "old": 0, "reference": 0}
        self.version = 0  # the iteration being trained: groups generated by an older version are stale
        self.steps_skipped_total = 0  # optimizer steps skipped for a non-finite loss or gradient norm, over the run (checkpointed)
        self._reset()

    def _reset(self) -> None:
        self.units = 0.0
        self.tokens = 0
        self.groups = 0
        self.sums = {
            "loss": 0.0,
            "kl": 0.0,
            "entropy": 0.0,
            "clipped": 0.0,
            "computed_tokens": 0.0,
            "mismatch": 0.0,
            "fresh_tokens": 0.0,
            "drift": 0.0,
            "tis_truncated": 0.0,
            "ratio_max": 0.0,
        }
        self.strategy.zero_grad(self.model)

    def begin_iteration(self, version: int = 0) -> None:
        """The old (proximal) policy is the weights at the start of iteration `version`."""
        self.version = version
        if self.old_adapter:
            for old, trained in self.old_adapter:
                self.strategy.copy_parameter(old, trained)
        elif self.old_policy is not None:
            self.old_policy.load_state_dict(self.model.state_dict())

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_is_base

    def _reference_logprobs(self, packing: list[tuple]) -> list[torch.Tensor]:
        if not self.reference_is_base:
            return self._frozen_logprobs(self.reference, packing, self.reference_device, "reference")
        with self.model.disable_adapter():
            return self._frozen_logprobs(self.model, packing, self.device, "reference")

    def _frozen_logprobs(self, model, groups: list[tuple], device: str, role: str) -> torch.Tensor:
        self.forwards[role] += 1
        with torch.no_grad():
            out = row_token_logprobs(model, groups, self.temperature, self.cfg.attention, device)
        return sampled_only(out.logprobs, out.trained).to(self.device)

    def shaped_rewards(self, group: Group, lengths: torch.Tensor) -> torch.Tensor:
        rewards = torch.tensor(group.rewards, dtype=torch.float32, device=lengths.device)
        if self.reward_cfg.overlong_buffer:
            rewards = rewards + overlong_penalty(lengths, self.max_new_tokens, self.reward_cfg.overlong_buffer, self.reward_cfg.overlong_penalty)
        return rewards

    def group_advantages(self, group: Group) -> torch.Tensor:
        """[G] advantages from the group's shaped rewards (without a KL penalty in the reward)."""
        lengths = torch.tensor([len(s.token_ids) for s in group.samples])
        return compute_advantages(self.cfg.advantage, self.shaped_rewards(group, lengths), self.cfg.std_normalize)

    def train_on_groups(self, groups: list[Group]) -> int:
        """Adds the loss-numerator gradients of this rank's share of `groups`, packed into micro-batches;
        returns this rank's token count.

        Every rank is given the same groups (rank 0 broadcasts them) and computes the same token-balanced
        assignment and micro-batch split for every rank; a rank with fewer micro-batches runs zero-gradient
        ones, so that all ranks make the same number of forward/backward passes (FSDP's collectives hang
        otherwise). At one rank this is the plain loop."""
        rank, world = self.ctx.rank, self.ctx.world_size
        live, silent, advantages = [], [], []
        for g in groups:
            # zero advantage everywhere and no KL term: the gradient is exactly zero, no forward is needed
            adv = None if self.has_reference else self.group_advantages(g)
            if adv is not None and bool((adv == 0).all()):
                silent.append(g)
            else:
                live.append(g)
                advantages.append(adv)
        total = sum(self._count_only(g) for g in silent[rank::world])  # each counted by exactly one rank
        shares = assign_groups([group_token_count(g) for g in live], world)
        plans = [split_into_microbatches([as_packing_group(live[i]) for i in share], self.cfg.token_budget) for share in shares]
        mine = [live[i] for i in shares[rank]]
        mine_advantages = [advantages[i] for i in shares[rank]]
        start = 0
        for micro in plans[rank]:
            end = start + len(micro)
            total += self._train_microbatch(mine[start:end], micro, mine_advantages[start:end])
            start = end
        for _ in range(max(len(plan) for plan in plans) - len(plans[rank])):
            self._train_microbatch([self.padding_group], [as_packing_group(self.padding_group)], [None], counted=False)
        return total

    @property
    def padding_group(self) -> Group:
        """A one-token group that runs the same collectives as a real micro-batch; its gradient is multiplied by 0."""
        sample = Sample(np.array([self.pad_id], dtype=np.int32), np.zeros(1, dtype=np.float32), 0.0)
        other = Sample(np.array([self.pad_id], dtype=np.int32), np.zeros(1, dtype=np.float32), 1.0)
        return Group(self.version, -1, self.version, "padding", np.array([self.pad_id], dtype=np.int32), [sample, other])

    def _count_only(self, group: Group) -> int:
        """The units and trained tokens of a group whose gradient is zero, without a forward pass."""
        trained = [s.trained_mask() for s in group.samples]
        mask = torch.zeros(len(trained), max(1, max(m.size for m in trained)))
        for i, m in enumerate(trained):
            mask[i, : m.size] = torch.from_numpy(m)
        _, units = aggregate_numerator(torch.zeros_like(mask), mask, self.cfg.loss_aggregation, self.cfg.aggregation_constant or self.max_new_tokens)
        tokens = int(mask.sum())
        self.units += units
        self.tokens += tokens
        self.groups += 1
        return tokens

    def train_on_group(self, group: Group) -> int:
        return self.train_on_groups([group])

    def behaviour_weight_cap(self, groups: list[Group]) -> float | None:
        """The cap of the importance weight pi_old / pi_behaviour (the engine's log-probs), or None
        for no weight. tis_cap corrects every sample for engine-vs-trainer mismatch; otherwise only
        stale tokens (bounded mode) are corrected, decoupled-PPO style (`stale_tokens`): a fresh one
        was generated by exactly the weights being trained, so bounded mode with max_staleness 0 equals
        periodic. A group's policy_version is its oldest token's, so groups with none stale need no weight
        (and a group without stale tokens among stale ones gets weight 1 on every token)."""
        if self.cfg.tis_cap is not None:
            return self.cfg.tis_cap
        return self.cfg.behaviour_weight_cap if any(g.policy_version < self.version for g in groups) else None

    def stale_tokens(self, trained: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """bool [rows, width]: the tokens the cap applies to: every token under tis_cap; else the sampled ones
        (`trained`) not `fresh`, i.e. sampled by an older version (with partial rollouts a sample may hold both kinds)."""
        if self.cfg.tis_cap is not None:
            return torch.ones_like(trained)
        return trained & ~fresh

    def fresh_tokens(self, groups: list[Group], trained: torch.Tensor) -> torch.Tensor:
        """bool [rows, width]: the sampled tokens (`trained`, every group's rows in order) that the weights
        being trained sampled, whose log-probs the engine and the trainer compute from the same weights."""
        samples = [(g, s) for g in groups for s in g.samples]
        if all(s.versions is None for _, s in samples):  # every token of its group's version
            rows = torch.tensor([g.policy_version == self.version for g, _ in samples], device=trained.device)
            return trained & rows[:, None]
        versions = padded([s.token_versions(g.policy_version) for g, s in samples], trained.shape[1])
        return trained & (versions == self.version).to(trained.device)

    def _train_microbatch(self, groups: list[Group], packing: list[tuple], advantages: list[torch.Tensor | None], counted: bool = True) -> int:
        """One forward and backward over a micro-batch; every per-token term is computed on one block of
        response rows [the groups' samples, longest response], every group's rows in order. `advantages`:
        each group's, or None where they are computed here (a KL penalty in the reward)."""
        cfg = self.cfg
        saved = (self.units, self.tokens, self.groups, dict(self.sums), dict(self.forwards))
        self.model.train()
        self.forwards["policy"] += 1
        out = row_token_logprobs(self.model, packing, self.temperature, cfg.attention, self.device, with_entropy=True)
        # only the tokens the policy sampled are trained on, counted and measured (mask 1); an
        # advantage is per trajectory, the same for each of its sampled tokens
        trained = out.trained
        mask = trained.float()
        logp = sampled_only(out.logprobs, trained)
        # One optimizer step per iteration: the old policy *is* the current one, ratio exactly 1.
        old = self._frozen_logprobs(self.old_policy, packing, self.device, "old") if self.old_policy is not None else None
        old_logp = old if old is not None else logp.detach()
        ref = self._reference_logprobs(packing) if self.has_reference else None
        kl = kl_estimate(logp, ref, cfg.kl_estimator) if ref is not None else None
        row_advantages = self._row_advantages(groups, advantages, out.mask.sum(-1), kl, mask).to(logp.device)[:, None]
        loss_tok, clipped = policy_token_loss(cfg.policy_loss, logp, old_logp, row_advantages, mask, cfg.clip_eps, cfg.clip_eps_high or cfg.clip_eps)
        samples = [s for g in groups for s in g.samples]
        rollout_logp = sampled_only(padded([s.logprobs for s in samples], mask.shape[1]).to(logp.device), trained)
        fresh = self.fresh_tokens(groups, trained)
        cap = self.behaviour_weight_cap(groups)
        if cap is not None:
            weights, truncated = stale_token_weights(old_logp, rollout_logp, self.stale_tokens(trained, fresh), cap)
            loss_tok = loss_tok * weights
            self.sums["tis_truncated"] += float((truncated.float() * mask).sum())
        if kl is not None and not cfg.kl_in_reward:
            loss_tok = loss_tok + cfg.kl_coef * kl
        numerator, units = aggregate_numerator(loss_tok, mask, cfg.loss_aggregation, cfg.aggregation_constant or self.max_new_tokens)
        n_tokens = int(mask.sum())
        self.units += units
        with torch.no_grad():
            self.sums["loss"] += float(numerator)
            self.sums["entropy"] += float((out.entropy * mask).sum())
            self.sums["clipped"] += float((clipped.float() * mask).sum())
            self.sums["computed_tokens"] += n_tokens
            # engine against trainer on the tokens both compute from the same weights; the stale ones
            # (bounded mode) measure how far the weights moved since they were sampled
            fresh_count = int(fresh.sum())
            self.sums["mismatch"] += logprob_mismatch(old_logp, rollout_logp, fresh) * fresh_count
            self.sums["fresh_tokens"] += fresh_count
            if fresh_count < n_tokens:
                self.sums["drift"] += logprob_mismatch(old_logp, rollout_logp, trained & ~fresh) * (n_tokens - fresh_count)
            # with no old policy the ratio is exp(0) = 1 on every token
            ratio_max = float((torch.exp(logp - old_logp) * mask).max()) if old is not None else float(n_tokens > 0)
            self.sums["ratio_max"] = max(self.sums["ratio_max"], ratio_max)
            if kl is not None:
                self.sums["kl"] += float((kl.detach() * mask).sum())
        if not counted:  # padding: the passes and collectives happen, nothing is added
            self.strategy.backward(numerator * 0.0)
            self.units, self.tokens, self.groups, self.sums, self.forwards = saved
            return 0
        self.strategy.backward(numerator)
        self.tokens += n_tokens
        self.groups += len(groups)
        return n_tokens

    def _row_advantages(
        self, groups: list[Group], advantages: list[torch.Tensor | None], lengths: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        """[rows] each sample's advantage; a group's computed here from its shaped rewards, less the KL
        penalty when the KL is in the reward, where it is not given."""
        parts, start = [], 0
        for group, adv in zip(groups, advantages, strict=True):
            end = start + len(group.samples)
            if adv is None:
                rewards = self.shaped_rewards(group, lengths[start:end])
                if kl is not None and self.cfg.kl_in_reward:
                    rewards = kl_reward_penalty(rewards, kl[start:end].detach(), mask[start:end], self.cfg.kl_coef)
                adv = compute_advantages(self.cfg.advantage, rewards, self.cfg.std_normalize)
            parts.append(adv.to(lengths.device))
            start = end
        return torch.cat(parts)

    def step(self) -> dict[str, float]:
        """Scales the accumulated gradients by 1/units (over all ranks), clips globally, steps.
        Returns the update's metrics, the same on every rank."""
        summed = ["loss", "kl", "entropy", "clipped", "computed_tokens", "mismatch", "fresh_tokens", "drift", "tis_truncated"]
        totals = all_reduce_sum([self.units, float(self.tokens), *(self.sums[k] for k in summed)], self.ctx)
        units, tokens_trained = max(1.0, totals[0]), totals[1]
        sums = dict(zip(summed, totals[2:]))
        sums["ratio_max"] = all_reduce_max([self.sums["ratio_max"]], self.ctx)[0]
        self.strategy.scale_gradients(self.model, 1.0 / units)
        lr = self.optimizer.param_groups[0]["lr"]
        # every rank sees the same all-reduced loss and global norm, so every rank skips alike
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.max_grad_norm) if step_is_finite(sums["loss"]) else float("nan")
        skipped = not step_is_finite(sums["loss"], grad_norm)
        if skipped:  # _reset drops the gradients; the scheduler counts optimizer steps, so it does not move either
            self.steps_skipped_total += 1
        else:
            self.strategy.optimizer_step(self.optimizer)
            self.scheduler.step()
        tokens = max(1.0, sums["computed_tokens"])
        metrics = {
            "policy_loss": sums["loss"] / units,
            "kl": sums["kl"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "clip_fraction": sums["clipped"] / tokens,
            "ratio_max": sums["ratio_max"],
            "logprob_mismatch": sums["mismatch"] / max(1.0, sums["fresh_tokens"]),
            "stale_logprob_drift": sums["drift"] / max(1.0, sums["computed_tokens"] - sums["fresh_tokens"]),
            "tis_truncated_fraction": sums["tis_truncated"] / tokens,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "learning_rate": lr,
            "trained_tokens": tokens_trained,
            "steps_skipped": float(skipped),
            "steps_skipped_total": float(self.steps_skipped_total),
        }
        self._reset()
        self.model.eval()
        if skipped:
            record_skip(self.version, sums["loss"] / units, grad_norm, self.steps_skipped_total, self.cfg.max_skipped_steps)
        return metrics

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Full weights (every rank reads them from the weight store; each rank keeps its shard), or under LoRA the adapter."""
        if self.lora:
            keys = adapter_keys(self.peft_model)
            if set(state_dict) != set(keys):
                missing, unexpected = sorted(set(keys) - set(state_dict)), sorted(set(state_dict) - set(keys))
                raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
            self.strategy.load_partial_state_dict(self.model, {keys[k]: v for k, v in state_dict.items()})
        else:
            self.strategy.load_full_state_dict(self.model, state_dict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What the weight store keeps of the policy: the full weights on rank 0 ({} elsewhere; a collective
        under fsdp2: every rank calls it), or under LoRA the adapter's tensors."""
        if self.lora:  # the trained parameters gathered (a collective under fsdp2 and ZeRO-3), in peft's names
            state = self.strategy.trainable_state_dict(self.model)
            return adapter_state_dict(self.peft_model, state) if self.ctx.is_main else {}
        return self.strategy.full_state_dict(self.model)

    def pushed_state(self) -> dict[str, torch.Tensor]:
        """What the NCCL push sends (one trainer rank): the model's own tensors where they lie (no copy
        of the full weights), or under LoRA the adapter's tensors alone, in peft's names."""
        return self.full_state_dict() if self.lora else self.model.state_dict()

    def sample_probe(self, probe: list[dict], seed: int) -> list[dict]:
        """The probe with responses the policy samples (tidal.model.probe.sample_responses), every rank together."""
        try:
            return sample_responses(self.model, probe, seed)
        finally:
            self.strategy.reshard(self.model)

    def probe_logprobs(self, probe: list[dict]) -> list[list[float]]:
        """The policy's log-probs of the arrival check's probe: a forward with no backward, which every rank
        runs (a collective under fsdp2 and ZeRO-3); the model is left laid out as training left it."""
        try:
            return probe_logprobs(self.model, probe)
        finally:
            self.strategy.reshard(self.model)

    # Optimizer state as plain tensors (safetensors) so a restarted trainer resumes without pickle;
    # under a sharding strategy each rank saves and loads only its own shard.
    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out = self.strategy.optimizer_tensors(self.model, self.optimizer)
        out["__scheduler_step__"] = torch.tensor(self.scheduler.last_epoch)
        out["__steps_skipped__"] = torch.tensor(self.steps_skipped_total)
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        counters = ("__scheduler_step__", "__steps_skipped__")
        self.strategy.load_optimizer_tensors(self.model, self.optimizer, {k: v for k, v in tensors.items() if k not in counters})
        self.steps_skipped_total = int(tensors.get("__steps_skipped__", torch.tensor(0)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_constant(self.cfg.warmup_steps))
        for _ in range(int(tensors.get("__scheduler_step__", torch.tensor(0)))):
            self.scheduler.step()


def merge_updates(updates: list[dict]) -> dict[str, float]:
    """One iteration's metrics from its optimizer steps: token counts add up, the rest average."""
    merged = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    merged["trained_tokens"] = float(sum(u["trained_tokens"] for u in updates))
    merged["ratio_max"] = float(max(u["ratio_max"] for u in updates))
    merged["optimizer_steps"] = float(len(updates))
    merged["steps_skipped"] = float(sum(u["steps_skipped"] for u in updates))
    merged["steps_skipped_total"] = float(max(u["steps_skipped_total"] for u in updates))
    return merged

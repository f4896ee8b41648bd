"""Cross-checks of tidal.algo against an independent implementation: verl's `core_algos`.

verl (pinned in the `test` extra) is a hard requirement: it is imported at module level, so a missing
or broken install makes this module fail to collect instead of skipping. Every check runs on random
float32 tensors with fixed seeds, several shapes, and padded masks (padding filled with junk that must
not leak into any result).

Conventions that differ on purpose, and how the tests pin them rather than hide them:
  * a group of ONE response: tidal gives advantage 0 (no baseline exists); verl gives the raw
    reward (GRPO: mean 0 / std 1, RLOO: no baseline) -> `test_singleton_group_convention_vs_verl_core_algos`;
  * a response with NO loss tokens in the seq-mean modes: tidal counts it as a unit (1/G over the
    whole group, as in the Dr.GRPO / DAPO formulas); verl leaves it out of the sequence count
    -> `test_empty_response_rows_vs_verl_core_algos_agg_loss`;
  * verl's vanilla PPO loss adds dual-clip (clip_ratio_c, default 3) for negative advantages; tidal
    has none, so the reference is run with clip_ratio_c=1e9 (dual-clip off);
  * verl clamps log-ratios (+-20, GSPO <= 10) and k3 (<= 10) for numerical safety; the random inputs
    stay well inside those ranges.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close
from verl.trainer.ppo import core_algos  # hard requirement: no importorskip
from verl.workers.config import ActorConfig

from tidal.algo.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from tidal.algo.aggregation import aggregate_loss
from tidal.algo.kl import kl_estimate
from tidal.algo.losses import gspo_token_loss, ppo_clip_token_loss

VERL_MODE = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean", "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
# Group sizes per batch (several groups of unequal size, including G=2 and all-equal rewards by chance).
GROUP_LAYOUTS = [(2,), (4, 4, 4), (8, 3, 5, 16), (2, 7, 2, 6, 5)]
CLIPS = {"symmetric": (0.2, 0.2), "dapo_clip_higher": (0.2, 0.28)}
NO_DUAL_CLIP = 1e9


def _actor_config(clip_low: float, clip_high: float, **batch_info) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        clip_ratio=clip_low,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=NO_DUAL_CLIP,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        global_batch_info=batch_info,
    )


def _rewards(gen: torch.Generator, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Alternates continuous rewards and 0/1 rewards (the latter often produce all-equal groups)."""
    out = []
    for k, g in enumerate(sizes):
        if k % 2 == 0:
            out.append(torch.randn(g, generator=gen) * 2.0 + 0.5)
        else:
            out.append(torch.randint(0, 2, (g,), generator=gen).float())
    return out


def _mask(gen: torch.Generator, b: int, t: int, min_len: int = 1) -> torch.Tensor:
    lengths = torch.randint(min_len, t + 1, (b,), generator=gen)
    lengths[0] = t  # at least one full row
    return (torch.arange(t)[None, :] < lengths[:, None]).float()


def _verl_outcome_inputs(rewards: list[torch.Tensor], t: int, gen: torch.Generator):
    """verl's layout: one flat batch, the scalar reward on each response's last token, a uid per group."""
    r = torch.cat(rewards)
    mask = _mask(gen, r.numel(), t)
    last = mask.sum(-1).long() - 1
    token_rewards = torch.zeros(r.numel(), t)
    token_rewards[torch.arange(r.numel()), last] = r
    index = np.array([f"uid-{k}" for k, g in enumerate(rewards) for _ in range(len(g))], dtype=object)
    return token_rewards, mask, index


def _policy_batch(gen: torch.Generator, b: int, t: int, min_len: int = 1):
    """logp / old_logp [B, T] with ratios spanning both clip edges; junk (but finite) values in padding."""
    mask = _mask(gen, b, t, min_len)
    logp = -torch.rand(b, t, generator=gen) * 4.0 - 0.05
    old_logp = logp + torch.randn(b, t, generator=gen) * 0.35
    junk = torch.randn(b, t, generator=gen) * 3.0
    logp = torch.where(mask.bool(), logp, junk)
    old_logp = torch.where(mask.bool(), old_logp, -junk)
    adv = grpo_advantages(torch.randn(b, generator=gen))[:, None]
    return logp, old_logp, adv, mask


def _pad_cat(tensors: list[torch.Tensor], t: int, value: float = 0.0) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value) for x in tensors])


# --------------------------------------------------------------------------------------------------
# the reference really is the pinned one


def test_verl_core_algos_is_the_pinned_reference():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"verl==([^"]+)"', pyproject)
    assert pin, "verl must be pinned in the test extra"
    assert importlib.metadata.version("verl") == pin.group(1)
    for name in (
        "compute_grpo_outcome_advantage",
        "compute_rloo_outcome_advantage",
        "compute_policy_loss_vanilla",
        "compute_policy_loss_gspo",
        "agg_loss",
        "kl_penalty",
    ):
        assert callable(getattr(core_algos, name))


# --------------------------------------------------------------------------------------------------
# advantages


@pytest.mark.parametrize("sizes", GROUP_LAYOUTS)
@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_advantages_match_verl_core_algos(sizes, std_normalize):
    gen = torch.Generator().manual_seed(1000 + sum(sizes) + std_normalize)
    rewards = _rewards(gen, sizes)
    token_rewards, mask, index = _verl_outcome_inputs(rewards, t=9, gen=gen)
    ref, returns = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=std_normalize)
    ours = torch.cat([grpo_advantages(r, std_normalize=std_normalize) for r in rewards])
    assert ref.shape == mask.shape
    assert_close(ours[:, None] * mask, ref)
    assert_close(ref, returns)
    if std_normalize:  # a non-trivial check: normalised advantages have (unbiased) std 1 in a non-constant group
        g0 = ours[: sizes[0]]
        assert g0.std() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("sizes", GROUP_LAYOUTS)
def test_dr_grpo_advantages_match_verl_core_algos_grpo_without_std(sizes):
    gen = torch.Generator().manual_seed(2000 + sum(sizes))
    rewards = _rewards(gen, sizes)
    token_rewards, mask, index = _verl_outcome_inputs(rewards, t=7, gen=gen)
    ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=False)
    ours = torch.cat([dr_grpo_advantages(r) for r in rewards])
    assert_close(ours[:, None] * mask, ref)


@pytest.mark.parametrize("sizes", GROUP_LAYOUTS)
def test_rloo_advantages_match_verl_core_algos(sizes):
    gen = torch.Generator().manual_seed(3000 + sum(sizes))
    rewards = _rewards(gen, sizes)
    token_rewards, mask, index = _verl_outcome_inputs(rewards, t=6, gen=gen)
    ref, _ = core_algos.compute_rloo_outcome_advantage(token_rewards, mask, index)
    ours = torch.cat([rloo_advantages(r) for r in rewards])
    assert_close(ours[:, None] * mask, ref)


def test_singleton_group_convention_vs_verl_core_algos():
    """G=1 has no group baseline: tidal returns 0, verl returns the raw reward (documented divergence)."""
    r = torch.tensor([0.7])
    token_rewards, mask, index = _verl_outcome_inputs([r], t=3, gen=torch.Generator().manual_seed(0))
    grpo_ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, index)
    rloo_ref, _ = core_algos.compute_rloo_outcome_advantage(token_rewards, mask, index)
    assert_close(grpo_ref[0, 0], torch.tensor(0.7 / (1 + 1e-6)))
    assert_close(rloo_ref[0, 0], torch.tensor(0.7))
    assert_close(grpo_advantages(r), torch.zeros(1))
    assert_close(rloo_advantages(r), torch.zeros(1))


# --------------------------------------------------------------------------------------------------
# PPO-clip / DAPO clip-higher, with aggregation


def _ours_and_verl_ppo(seed: int, sizes: tuple[int, ...], ts: tuple[int, ...], clip: tuple[float, float], mode: str, constant: float | None):
    gen = torch.Generator().manual_seed(seed)
    groups = [_policy_batch(gen, g, t) for g, t in zip(sizes, ts)]
    t_max = max(ts)

    leaves = [lp.clone().requires_grad_(True) for lp, _, _, _ in groups]
    per_tok, clipped = zip(*[ppo_clip_token_loss(lp, old, adv, *clip) for lp, (_, old, adv, _) in zip(leaves, groups)])
    ours = aggregate_loss(list(per_tok), [m for *_, m in groups], mode, constant)
    ours.backward()

    ref_leaves = [lp.clone().requires_grad_(True) for lp, _, _, _ in groups]
    batch_info = {"loss_scale_factor": constant} if mode == "seq_mean_token_sum_norm" else {}
    ref, metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=_pad_cat([old for _, old, _, _ in groups], t_max),
        log_prob=_pad_cat(ref_leaves, t_max),
        advantages=_pad_cat([adv.expand_as(lp) for lp, _, adv, _ in groups], t_max),
        response_mask=_pad_cat([m for *_, m in groups], t_max),
        loss_agg_mode=VERL_MODE[mode],
        config=_actor_config(*clip, **batch_info),
    )
    ref.backward()
    masks = [m for *_, m in groups]
    clip_frac = sum(float((c.float() * m).sum()) for c, m in zip(clipped, masks)) / sum(float(m.sum()) for m in masks)
    return ours, ref, leaves, ref_leaves, clip_frac, metrics


@pytest.mark.parametrize("clip_name", sorted(CLIPS))
@pytest.mark.parametrize("sizes,ts", [((4,), (5,)), ((4, 4, 4), (7, 3, 12)), ((8, 3, 5), (16, 16, 2)), ((2, 6), (1, 33))])
def test_ppo_clip_token_mean_loss_matches_verl_core_algos_vanilla(clip_name, sizes, ts):
    ours, ref, leaves, ref_leaves, clip_frac, metrics = _ours_and_verl_ppo(4000 + sum(ts), sizes, ts, CLIPS[clip_name], "token_mean", None)
    assert_close(ours, ref)
    for ours_leaf, ref_leaf in zip(leaves, ref_leaves):  # per-token gradients, padding included (must be 0)
        assert_close(ours_leaf.grad, ref_leaf.grad[:, : ours_leaf.shape[1]])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clip_frac, abs=1e-6)
    assert 0.0 < clip_frac < 1.0, "the inputs must exercise both the clipped and the unclipped branch"


def test_dapo_clip_higher_differs_from_symmetric_in_verl_core_algos_too():
    """The asymmetric upper edge matters on these inputs (so the DAPO case is not a copy of the symmetric one)."""
    sym = _ours_and_verl_ppo(4100, (8, 8), (10, 10), CLIPS["symmetric"], "token_mean", None)
    dapo = _ours_and_verl_ppo(4100, (8, 8), (10, 10), CLIPS["dapo_clip_higher"], "token_mean", None)
    assert abs(float(sym[0].detach()) - float(dapo[0].detach())) > 1e-4
    assert abs(float(sym[1].detach()) - float(dapo[1].detach())) > 1e-4
    assert sym[4] > dapo[4]  # fewer tokens clipped with the higher upper edge


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("clip_name", sorted(CLIPS))
def test_ppo_clip_seq_mean_losses_match_verl_core_algos_vanilla(mode, clip_name):
    constant = 40.0 if mode == "seq_mean_token_sum_norm" else None
    ours, ref, leaves, ref_leaves, _, _ = _ours_and_verl_ppo(4200, (5, 3, 6), (9, 17, 4), CLIPS[clip_name], mode, constant)
    assert_close(ours, ref)
    for ours_leaf, ref_leaf in zip(leaves, ref_leaves):
        assert_close(ours_leaf.grad, ref_leaf.grad[:, : ours_leaf.shape[1]])


# --------------------------------------------------------------------------------------------------
# GSPO (sequence-level ratio)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.05, 0.05), (0.2, 0.28)], ids=["gspo_paper", "symmetric", "dapo"])
@pytest.mark.parametrize("b,t", [(4, 6), (8, 20), (3, 1)])
def test_gspo_sequence_ratio_loss_matches_verl_core_algos(clip, b, t):
    gen = torch.Generator().manual_seed(5000 + b * t)
    logp, old_logp, adv, mask = _policy_batch(gen, b, t)
    old_logp = torch.where(mask.bool(), logp + torch.randn(b, t, generator=gen) * 0.02, old_logp)  # GSPO-sized ratios

    ours_leaf = logp.clone().requires_grad_(True)
    tok, clipped = gspo_token_loss(ours_leaf, old_logp, adv, mask, *clip)
    ours = aggregate_loss([tok], [mask], "seq_mean_token_mean")
    ours.backward()

    ref_leaf = logp.clone().requires_grad_(True)
    ref, metrics = core_algos.compute_policy_loss_gspo(old_logp, ref_leaf, adv.expand(b, t), mask, config=_actor_config(*clip))
    ref.backward()

    assert_close(ours, ref)
    assert_close(ours_leaf.grad, ref_leaf.grad)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float((clipped.float() * mask).sum() / mask.sum()), abs=1e-6)


# --------------------------------------------------------------------------------------------------
# aggregation modes on arbitrary per-token losses


@pytest.mark.parametrize("mode", sorted(VERL_MODE))
@pytest.mark.parametrize("b,t", [(1, 1), (4, 9), (16, 32), (7, 3)])
def test_aggregation_matches_verl_core_algos_agg_loss(mode, b, t):
    gen = torch.Generator().manual_seed(6000 + b * t)
    loss_mat = torch.randn(b, t, generator=gen) * 3.0
    mask = _mask(gen, b, t)
    constant = float(t + 5) if mode == "seq_mean_token_sum_norm" else None
    ref = core_algos.agg_loss(loss_mat, mask, VERL_MODE[mode], loss_scale_factor=constant)
    assert_close(aggregate_loss([loss_mat], [mask], mode, constant), ref)
    # streaming: the same rows split into groups, each padded only to its own length, give the same loss
    cuts = sorted({0, b, *torch.randint(0, b + 1, (2,), generator=gen).tolist()})
    parts = [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1) if cuts[i + 1] > cuts[i]]
    loss_parts, mask_parts = [], []
    for lo, hi in parts:
        width = int(mask[lo:hi].sum(-1).max())
        loss_parts.append(loss_mat[lo:hi, :width])
        mask_parts.append(mask[lo:hi, :width])
    assert_close(aggregate_loss(loss_parts, mask_parts, mode, constant), ref)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_empty_response_rows_vs_verl_core_algos_agg_loss(mode):
    """A row with no loss tokens: tidal still counts it as a sequence (1/G), verl drops it from the count."""
    gen = torch.Generator().manual_seed(6500)
    loss_mat = torch.randn(6, 8, generator=gen)
    mask = _mask(gen, 6, 8)
    mask[2] = 0
    mask[5] = 0
    constant = 8.0 if mode == "seq_mean_token_sum_norm" else None
    ref = core_algos.agg_loss(loss_mat, mask, VERL_MODE[mode], loss_scale_factor=constant)
    ours = aggregate_loss([loss_mat], [mask], mode, constant)
    assert_close(ours, ref * 4 / 6)


# --------------------------------------------------------------------------------------------------
# KL estimators


@pytest.mark.parametrize("kind,verl_names", [("k1", ("k1", "kl")), ("k2", ("k2", "mse")), ("k3", ("k3", "low_var_kl"))])
@pytest.mark.parametrize("b,t", [(2, 3), (8, 64), (5, 1)])
def test_kl_estimators_match_verl_core_algos_kl_penalty(kind, verl_names, b, t):
    gen = torch.Generator().manual_seed(7000 + b * t)
    logp = -torch.rand(b, t, generator=gen) * 5.0
    ref_logp = logp + (torch.randn(b, t, generator=gen) * 0.6).clamp(-2.0, 2.0)
    ours = kl_estimate(logp, ref_logp, kind)
    for name in verl_names:
        assert_close(ours, core_algos.kl_penalty(logp, ref_logp, name))
    if kind != "k1":
        assert (ours >= 0).all()


# --------------------------------------------------------------------------------------------------
# the comparisons can fail


def test_perturbed_inputs_are_detected_against_verl_core_algos():
    gen = torch.Generator().manual_seed(8000)
    rewards = _rewards(gen, (4, 4))
    rewards[0] = torch.tensor([0.1, 0.9, -1.3, 2.2])
    token_rewards, mask, index = _verl_outcome_inputs(rewards, t=5, gen=gen)
    ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, index)
    perturbed = [rewards[0] + torch.tensor([0.0, 0.0, 1e-3, 0.0]), rewards[1]]
    ours = torch.cat([grpo_advantages(r) for r in perturbed])
    with pytest.raises(AssertionError):
        assert_close(ours[:, None] * mask, ref)

    logp, old_logp, adv, mask = _policy_batch(gen, 4, 6)
    ref_loss, _ = core_algos.compute_policy_loss_vanilla(old_logp, logp, adv.expand_as(logp), mask, "token-mean", _actor_config(0.2, 0.28))
    bumped = adv.clone()
    bumped[1] += 1e-2  # one sequence's advantage: moves the loss whichever clip branch its tokens take
    tok, _ = ppo_clip_token_loss(logp, old_logp, bumped, 0.2, 0.28)
    with pytest.raises(AssertionError):
        assert_close(aggregate_loss([tok], [mask], "token_mean"), ref_loss)

"""Each algorithm function alone, against hand-computed values."""

import pytest
import torch

from tidal.algo import (
    aggregate_loss,
    aggregate_numerator,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    gspo_token_loss,
    has_no_signal,
    kl_estimate,
    kl_reward_penalty,
    logprob_mismatch,
    overlong_penalty,
    policy_token_loss,
    ppo_clip_token_loss,
    rloo_advantages,
    sampled_only,
    sequence_log_ratio,
    token_logprobs_from_logits,
    truncated_importance_weights,
)


def test_grpo_advantages_are_centred_and_scaled():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = grpo_advantages(r, std_normalize=True)
    assert torch.allclose(a, (r - 0.5) / (r.std() + 1e-6))
    assert torch.allclose(grpo_advantages(r, std_normalize=False), r - 0.5)
    assert torch.equal(grpo_advantages(torch.ones(4)), torch.zeros(4))


def test_dr_grpo_and_rloo():
    r = torch.tensor([3.0, 0.0, 1.0, 0.0])
    assert torch.allclose(dr_grpo_advantages(r), r - 1.0)
    assert torch.allclose(rloo_advantages(r), torch.tensor([8 / 3, -4 / 3, 0.0, -4 / 3]))
    assert torch.equal(rloo_advantages(torch.tensor([5.0])), torch.zeros(1))
    assert torch.allclose(compute_advantages("rloo", r), rloo_advantages(r))
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", r)


def test_ppo_clip_symmetric_and_clip_higher():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    loss, clipped = ppo_clip_token_loss(old, old, torch.tensor([[2.0]]), 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.0]])) and not clipped.any()
    new = torch.log(torch.tensor([[0.9, 0.3]]))  # ratios 1.8 and 0.6
    loss, clipped = ppo_clip_token_loss(new, old, torch.tensor([[1.0]]), 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.6]])) and clipped.tolist() == [[True, False]]
    loss, _ = ppo_clip_token_loss(new, old, torch.tensor([[1.0]]), 0.2, 0.28)  # DAPO clip-higher
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.6]]))
    loss, _ = ppo_clip_token_loss(new, old, torch.tensor([[-1.0]]), 0.2, 0.28)  # negative advantage: low clip
    assert torch.allclose(loss, torch.tensor([[1.8, 0.8]]))


def test_gspo_uses_the_length_normalised_sequence_ratio():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, 0.3, 9.0], [0.1, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(sequence_log_ratio(logp, old, mask), torch.tensor([[0.3], [0.0]]))
    adv = torch.tensor([[1.0], [1.0]])
    loss, clipped = gspo_token_loss(logp, old, adv, mask, 0.2, 0.2)
    # seq 0: ratio e^0.3 = 1.35 > 1.2 -> clipped at 1.2 for every token; seq 1: ratio 1
    assert torch.allclose(loss[0, :2], torch.tensor([-1.2, -1.2])) and clipped[0, :2].all()
    assert torch.allclose(loss[1], torch.tensor([-1.0, -1.0, -1.0])) and not clipped[1].any()
    (loss[1] * mask[1]).sum().backward()
    assert torch.allclose(logp.grad[1], torch.tensor([-1.0, -1.0, -1.0]))  # token gradient sg[s_i] * d logp
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_token_loss("reinforce", logp, old, adv, mask, 0.2, 0.2)


def test_streaming_aggregation_equals_the_batch_definition():
    torch.manual_seed(0)
    losses = [torch.randn(3, 5), torch.randn(2, 4)]
    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).float(), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]).float()]
    flat_tokens = torch.cat([l[m.bool()] for l, m in zip(losses, masks)])
    assert torch.allclose(aggregate_loss(losses, masks, "token_mean"), flat_tokens.mean())
    seq_means = torch.cat([(l * m).sum(-1) / m.sum(-1) for l, m in zip(losses, masks)])
    assert torch.allclose(aggregate_loss(losses, masks, "seq_mean_token_mean"), seq_means.mean())
    seq_sums = torch.cat([(l * m).sum(-1) for l, m in zip(losses, masks)])
    assert torch.allclose(aggregate_loss(losses, masks, "seq_mean_token_sum_norm", 10.0), (seq_sums / 10.0).mean())
    assert aggregate_numerator(losses[0], masks[0], "token_mean")[1] == 9.0
    with pytest.raises(ValueError, match="constant normaliser"):
        aggregate_numerator(losses[0], masks[0], "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_numerator(losses[0], masks[0], "median")


def test_kl_estimators_and_reward_penalty():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.tensor([float(torch.exp(torch.tensor(-0.5))) + 0.5 - 1.0, 0.0]))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")
    kl_tok = torch.tensor([[0.5, 0.5, 9.0], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(kl_reward_penalty(torch.tensor([1.0, 0.0]), kl_tok, mask, 0.5), torch.tensor([0.5, -0.05]))


def test_dynamic_sampling_filter_and_overlong_penalty():
    assert has_no_signal(torch.tensor([1.0, 1.0, 1.0])) and not has_no_signal(torch.tensor([1.0, 0.0, 1.0]))
    got = overlong_penalty(torch.tensor([4, 6, 8, 10, 12]), max_length=10, buffer=4, factor=1.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.equal(overlong_penalty(torch.tensor([10]), 10, 0), torch.zeros(1))


def test_truncated_importance_weights_and_mismatch():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -3.0, 0.0]])
    w, truncated = truncated_importance_weights(old, rollout, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, float(torch.exp(torch.tensor(-1.0)))]]))
    assert truncated.tolist() == [[False, True, False]]
    assert logprob_mismatch(old, rollout, torch.tensor([[1.0, 1.0, 0.0]])) == pytest.approx(1.0)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    got, _ = token_logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0)
    assert torch.allclose(got, torch.log_softmax(logits / 2.0, -1)[..., 0])


def test_aggregations_over_a_multi_turn_loss_mask():
    """Masks with holes (inserted tokens between sampled turns): each mode reads the sampled tokens only."""
    loss = torch.tensor([[1.0, 50.0, 50.0, 3.0, 0.0], [2.0, 2.0, 70.0, 70.0, 4.0]])
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]).float()
    assert aggregate_numerator(loss, mask, "token_mean") == (torch.tensor(12.0), 5.0)
    num, units = aggregate_numerator(loss, mask, "seq_mean_token_mean")
    assert torch.allclose(num, torch.tensor((1 + 3) / 2 + (2 + 2 + 4) / 3)) and units == 2.0
    num, units = aggregate_numerator(loss, mask, "seq_mean_token_sum_norm", 4.0)
    assert torch.allclose(num, torch.tensor((4 + 8) / 4)) and units == 2.0


def test_sampled_only_zeroes_inserted_tokens_and_their_gradient():
    logp = torch.tensor([[-1.0, -900.0, -2.0]], requires_grad=True)
    kept = sampled_only(logp, torch.tensor([[1, 0, 1]]))
    assert kept.tolist() == [[-1.0, 0.0, -2.0]]
    (torch.exp(-kept) * torch.tensor([[1.0, 0.0, 1.0]])).sum().backward()  # exp(900) would be inf: inf * 0 = nan
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0

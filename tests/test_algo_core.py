import torch

from tidal.algo import grpo_advantages, kl_estimate, ppo_clip_token_loss, token_logprobs_from_logits


def test_grpo_advantages_are_centred_and_scaled():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = grpo_advantages(r, std_normalize=True)
    assert torch.allclose(a.mean(), torch.tensor(0.0), atol=1e-7)
    assert torch.allclose(a, (r - 0.5) / (r.std() + 1e-6))
    assert torch.allclose(grpo_advantages(r, std_normalize=False), r - 0.5)
    assert torch.equal(grpo_advantages(torch.ones(4)), torch.zeros(4))


def test_ppo_clip_at_ratio_one_is_minus_advantage_and_clips_outside():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    loss, clipped = ppo_clip_token_loss(logp, logp, torch.tensor([[2.0]]), 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.0]])) and not clipped.any()
    new = torch.log(torch.tensor([[0.9, 0.3]]))  # ratios 1.8 and 0.6
    loss, clipped = ppo_clip_token_loss(new, logp, torch.tensor([[1.0]]), 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.6]]))
    assert clipped.tolist() == [[True, False]]


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.allclose(k3, torch.tensor([torch.exp(torch.tensor(-0.5)) + 0.5 - 1.0, 0.0]))
    assert (k3 >= 0).all()


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    got = token_logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0)
    assert torch.allclose(got, torch.log_softmax(logits / 2.0, -1)[..., 0])

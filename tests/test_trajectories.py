"""Multi-turn trajectories through the trainer: only the tokens the policy sampled (loss mask 1) are
trained on, counted and measured; the tokens the environment or the chat template inserted (mask 0)
shape the context of later tokens and nothing else. Real forward/backward passes of the tiny model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tidal.algo import grpo_advantages, token_logprobs_from_logits
from tidal.config import TinyModelConfig, TrainerConfig
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import Group, Sample
from tidal.trainer.learner import Learner

MAX_NEW_TOKENS = 8


def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    return model.eval(), tok


def trajectory(rng: np.random.Generator, runs: list[tuple[int, int]], reward: float) -> Sample:
    """Runs of (sampled?, length): sampled turns with inserted tokens between or after them."""
    mask = np.concatenate([np.full(n, flag, dtype=np.uint8) for flag, n in runs])
    tokens = np.asarray(rng.integers(4, 90, mask.size), dtype=np.int32)
    logprobs = np.where(mask == 1, rng.normal(-2.0, 0.5, mask.size), 0.0).astype(np.float32)
    return Sample(tokens, logprobs, reward, loss_mask=mask)


def multi_turn_groups(seed: int = 0) -> list[Group]:
    rng = np.random.default_rng(seed)
    shapes = [
        ([[(1, 3), (0, 4), (1, 2)], [(1, 5)], [(1, 2), (0, 3), (1, 1), (0, 2), (1, 3)]], [1.0, 0.0, 0.5]),
        ([[(0, 2), (1, 4)], [(1, 1), (0, 6), (1, 2)]], [0.0, 1.0]),
    ]
    groups = []
    for i, (runs, rewards) in enumerate(shapes):
        prompt = np.asarray(rng.integers(4, 90, 4 + i), dtype=np.int32)
        groups.append(Group(0, i, 0, "test", prompt, [trajectory(rng, r, w) for r, w in zip(runs, rewards)]))
    return groups


def learner_gradients(model, tok, groups: list[Group], **cfg) -> tuple[dict[str, torch.Tensor], Learner]:
    """The accumulated gradient of the loss numerator, scaled by 1/units as the step does."""
    learner = Learner(TrainerConfig(warmup_steps=0, max_grad_norm=1e9, **cfg), copy.deepcopy(model), tok.pad_token_id, max_new_tokens=MAX_NEW_TOKENS)
    learner.train_on_groups(groups)
    grads = {n: p.grad.clone() / learner.units for n, p in learner.model.named_parameters() if p.grad is not None}
    return grads, learner


def hand_gradients(model, groups: list[Group], mode: str) -> tuple[dict[str, torch.Tensor], float, int]:
    """The same update one trajectory at a time (prompt + trajectory as one row), with the
    aggregation written out over the sampled tokens only."""
    ref = copy.deepcopy(model).train()
    per_sequence, tokens = [], 0
    for g in groups:
        prompt = g.prompt_ids.tolist()
        for s, advantage in zip(g.samples, grpo_advantages(torch.tensor(g.rewards))):
            ids = torch.tensor([prompt + s.token_ids.tolist()])
            logits = ref(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            logp = token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]
            sampled = logp[torch.from_numpy(s.trained_mask())]
            # ppo_clip at ratio 1 (one step per iteration): -A per token, gradient -A * d log p
            per_sequence.append(-advantage * torch.exp(sampled - sampled.detach()))
            tokens += sampled.numel()
    if mode == "token_mean":
        loss, units = sum(t.sum() for t in per_sequence) / tokens, tokens
    elif mode == "seq_mean_token_mean":
        loss, units = sum(t.sum() / max(1, t.numel()) for t in per_sequence) / len(per_sequence), len(per_sequence)
    else:
        loss, units = sum(t.sum() / MAX_NEW_TOKENS for t in per_sequence) / len(per_sequence), len(per_sequence)
    loss.backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}, float(units), tokens


@pytest.mark.parametrize("attention", ["segmented", "sdpa", "naive"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_every_aggregation_equals_a_hand_computation_over_sampled_tokens(mode, attention):
    """A packed batch of multi-turn trajectories gives the gradient of the batch loss computed one
    trajectory at a time over its sampled tokens; units and trained tokens count those tokens only."""
    model, tok = tiny()
    groups = multi_turn_groups()
    got, learner = learner_gradients(model, tok, groups, loss_aggregation=mode, attention=attention)
    want, units, tokens = hand_gradients(model, groups, mode)
    assert learner.units == units and learner.tokens == tokens
    assert tokens < sum(len(s.token_ids) for g in groups for s in g.samples)  # some tokens are inserted
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("cfg", [{}, {"kl_coef": 0.5, "kl_estimator": "k1"}, {"policy_loss": "gspo", "loss_aggregation": "seq_mean_token_mean"}])
def test_inserted_tokens_add_no_gradient(cfg):
    """Tokens inserted after the last sampled token influence no sampled token, so they must change
    nothing at all: the same trajectories without them give the same gradient, units and tokens
    (with a KL term too: k1's gradient is non-zero even while the reference equals the policy)."""
    model, tok = tiny()
    rng = np.random.default_rng(7)
    with_tail = [
        Group(
            0,
            0,
            0,
            "t",
            np.array([5, 6, 7], dtype=np.int32),
            [trajectory(rng, [(1, 3), (0, 2), (1, 2), (0, 5)], 1.0), trajectory(rng, [(1, 4), (0, 3)], 0.0)],
        )
    ]
    without = copy.deepcopy(with_tail)
    for s in without[0].samples:
        last = int(np.flatnonzero(s.loss_mask)[-1]) + 1
        s.token_ids, s.logprobs, s.loss_mask = s.token_ids[:last], s.logprobs[:last], s.loss_mask[:last]
    a, la = learner_gradients(model, tok, with_tail, **cfg)
    b, lb = learner_gradients(model, tok, without, **cfg)
    assert (la.units, la.tokens) == (lb.units, lb.tokens) and la.tokens == 9
    for name, grad in b.items():
        torch.testing.assert_close(a[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert la.sums["kl"] == pytest.approx(lb.sums["kl"]) and la.sums["entropy"] == pytest.approx(lb.sums["entropy"], rel=1e-5)


@pytest.mark.parametrize("cfg", [{}, {"kl_coef": 0.1, "tis_cap": 1.5}, {"policy_loss": "gspo", "loss_aggregation": "seq_mean_token_sum_norm"}])
def test_an_all_ones_mask_is_the_single_turn_path_bit_for_bit(cfg):
    """Single-turn is the one-turn case: a sample with an all-ones mask trains exactly as one without."""
    model, tok = tiny()
    rng = np.random.default_rng(3)
    plain = [
        Group(0, i, 0, "t", np.asarray(rng.integers(4, 90, 3 + i), dtype=np.int32),
              [Sample(np.asarray(rng.integers(4, 90, n), dtype=np.int32), np.asarray(rng.normal(-2, 1, n), dtype=np.float32), r) for n, r in zip(lens, rewards)])
        for i, (lens, rewards) in enumerate([([3, 1, 6], [1.0, 0.0, 0.0]), ([4, 4], [0.0, 1.0]), ([2, 5], [1.0, 1.0])])
    ]  # fmt: skip
    ones = copy.deepcopy(plain)
    for g in ones:
        for s in g.samples:
            s.loss_mask = np.ones(s.token_ids.size, dtype=np.uint8)
    a, la = learner_gradients(model, tok, plain, **cfg)
    b, lb = learner_gradients(model, tok, ones, **cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert (la.units, la.tokens, la.sums) == (lb.units, lb.tokens, lb.sums)
    assert la.step() == lb.step()


def test_a_group_without_signal_counts_only_its_sampled_tokens():
    """A group whose rewards are all equal skips its forward pass but still counts its units: the
    sampled tokens, as a trained group would."""
    model, tok = tiny()
    rng = np.random.default_rng(5)
    flat = Group(
        0, 0, 0, "t", np.array([5, 6], dtype=np.int32), [trajectory(rng, [(1, 2), (0, 4), (1, 1)], 1.0), trajectory(rng, [(0, 3), (1, 2)], 1.0)]
    )
    learner = Learner(TrainerConfig(), copy.deepcopy(model), tok.pad_token_id)
    assert learner.train_on_groups([flat]) == 5
    assert learner.units == 5.0 and learner.tokens == 5 and learner.forwards["policy"] == 0


def test_an_inserted_token_the_policy_finds_unlikely_cannot_poison_the_update():
    """A tool's output can be far in the tail of the policy (log-prob -1000 and below at a low
    temperature). Its log-probs are zeroed before any per-token term is formed, so no ratio or KL
    overflows there and no inf * 0 = nan reaches the masked sums (old policy and reference included;
    the policy equals both here, so every sampled token's ratio is 1 and its KL 0)."""
    model, tok = tiny()
    rng = np.random.default_rng(11)
    groups = [Group(0, 0, 0, "t", np.array([5, 6, 7], dtype=np.int32), [trajectory(rng, [(1, 2), (0, 6), (1, 2)], r) for r in (1.0, 0.0, 0.0)])]
    cfg = TrainerConfig(warmup_steps=0, updates_per_iteration=2, kl_coef=0.1, kl_estimator="k3")
    learner = Learner(cfg, copy.deepcopy(model), tok.pad_token_id, temperature=0.005, max_new_tokens=MAX_NEW_TOKENS)
    learner.train_on_groups(groups)
    assert all(torch.isfinite(p.grad).all() for p in learner.model.parameters() if p.grad is not None)
    metrics = learner.step()
    assert metrics["steps_skipped"] == 0.0 and np.isfinite(metrics["policy_loss"]) and np.isfinite(metrics["kl"])


def test_the_trainer_holds_a_trajectory_to_the_runs_turn_and_token_limits():
    """What a group may contain follows rollout.*: single-turn limits without an environment, the
    turn limits with one."""
    from tidal.config import config_from_dict
    from tidal.protocol import ProtocolError, decode_group, pack
    from tidal.roles import group_limits

    model, tok = tiny()
    learner = Learner(TrainerConfig(), model, tok.pad_token_id)
    rng = np.random.default_rng(2)
    runs = [(1, 3), (0, 4), (1, 3)]  # 6 sampled tokens in two turns, 4 inserted
    message = pack(Group(0, 0, 0, "t", np.array([5, 6], dtype=np.int32), [trajectory(rng, runs, 1.0), trajectory(rng, runs, 0.0)]))
    single = config_from_dict({"rollout": {"group_size": 2, "max_new_tokens": 8}})
    with pytest.raises(ProtocolError, match="10 tokens, more than max_new_tokens 8"):
        decode_group(message, group_limits(single, learner, 10**6)(0))
    agent = config_from_dict(
        {
            "rollout": {"group_size": 2, "max_new_tokens": 3, "agent": {"env": "tools", "max_turns": 2, "max_env_tokens_per_turn": 4}},
            "eval": {"enabled": False},
        }
    )
    assert decode_group(message, group_limits(agent, learner, 10**6)(0)).samples[0].loss_mask.tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    tight = agent.model_copy(
        update={"rollout": agent.rollout.model_copy(update={"agent": agent.rollout.agent.model_copy(update={"max_env_tokens_per_turn": 3})})}
    )
    with pytest.raises(ProtocolError, match="10 tokens, more than 2 turns"):
        decode_group(message, group_limits(tight, learner, 10**6)(0))

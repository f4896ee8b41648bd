"""Partial rollouts (rollout.partial, bounded mode): a response whose tokens come from two policy versions.

Real parts: a tiny model built from a config, the HF engine's decode loop, the generator, the protocol
codec, the learner's forward/backward. The trigger is deterministic: a Refresh that says newer weights
wait after N decode steps and, asked to swap, loads them into the engine's model.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from tests.conftest import eos_prone
from tidal.algo import stale_token_weights, token_logprobs_from_logits
from tidal.config import ConfigError, TinyModelConfig, TrainerConfig, config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import Group, GroupLimits, ProtocolError, Sample, WorkItem, decode_group, pack, unpack
from tidal.rewards import RewardScorer
from tidal.rollout.engine import INTERRUPTED, GroupRequest, HFEngine, group_generator
from tidal.rollout.generator import Generator
from tidal.rollout.partial import complete_partial
from tidal.token_versions import NO_VERSION, decode_runs, encode_runs
from tidal.tracking import mlflow_metric_name
from tidal.trainer.learner import Learner
from tidal.trainer.metrics import token_staleness_stats

MAX_NEW = 8


def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    return model.eval(), tok


def other_weights(model) -> dict[str, torch.Tensor]:
    """Version v+1: every tensor moved, so its log-probs differ from version v's everywhere."""
    gen = torch.Generator().manual_seed(7)
    return {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


class StepRefresh:
    """Newer weights 'published' after `after` decode steps of the first engine call; swap loads them."""

    def __init__(self, engine: HFEngine, version: int, weights: dict, after: int):
        self.engine, self.version, self.weights, self.after = engine, version, weights, after
        self.asked = 0
        self.swaps = 0

    def interrupt(self) -> bool:
        self.asked += 1
        return self.swaps == 0 and self.asked == self.after

    async def swap(self) -> int:
        self.engine.load_state_dict(self.weights)
        self.swaps += 1
        self.version += 1
        return self.version


def logprobs_under(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]


def test_a_response_spans_two_versions_and_each_token_carries_its_samplers_logprob():
    model, tok = tiny()
    before = copy.deepcopy(model)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=MAX_NEW)
    new = other_weights(model)
    prompts = [tok(t).input_ids for t in ("12+3=", "45+678=")]
    requests = [GroupRequest(p, 3, group_generator(0, 4, i)) for i, p in enumerate(prompts)]
    refresh = StepRefresh(engine, version=4, weights=new, after=3)
    outputs = asyncio.run(complete_partial(engine, requests, MAX_NEW, refresh))
    assert refresh.swaps == 1
    after = copy.deepcopy(model)  # the engine's model now holds the new weights
    spanning = 0
    for prompt, group in zip(prompts, outputs):
        for c in group:
            assert c.finish_reason in ("stop", "length") and len(c.token_ids) <= MAX_NEW
            if c.versions is None:  # ended (EOS) before the new weights came: all version 4
                assert len(c.token_ids) <= 3
                torch.testing.assert_close(torch.tensor(c.logprobs), logprobs_under(before, prompt, c.token_ids), atol=1e-4, rtol=0)
                continue
            spanning += 1
            assert c.versions == [4] * 3 + [5] * (len(c.token_ids) - 3)
            old, fresh = c.token_ids[:3], c.token_ids[3:]
            torch.testing.assert_close(torch.tensor(c.logprobs[:3]), logprobs_under(before, prompt, old), atol=1e-4, rtol=0)
            # the later tokens are the new weights' own, over the whole prefix (a fresh prefill, not the old cache)
            torch.testing.assert_close(torch.tensor(c.logprobs[3:]), logprobs_under(after, prompt + old, fresh), atol=1e-4, rtol=0)
            assert not torch.allclose(torch.tensor(c.logprobs[3:]), logprobs_under(before, prompt + old, fresh), atol=1e-2)
    assert spanning >= 4  # most rows were still sampling at step 3


def test_the_engine_stops_the_rows_still_sampling_at_the_step_it_is_told():
    model, tok = tiny()
    model = eos_prone(model, tok, eos_logit=4.0)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=MAX_NEW)
    asked = []
    out = engine.generate([GroupRequest(tok("1+2=").input_ids, 6, group_generator(1, 0, 0))], interrupt=lambda: asked.append(1) or len(asked) == 2)[0]
    assert {c.finish_reason for c in out} <= {"stop", INTERRUPTED}
    assert all(len(c.token_ids) == 2 for c in out if c.finish_reason == INTERRUPTED)
    assert all(c.token_ids[-1] == tok.eos_token_id for c in out if c.finish_reason == "stop")
    assert any(c.finish_reason == INTERRUPTED for c in out)


def test_the_generator_makes_groups_whose_samples_carry_their_token_versions(tiny_config_dict):
    cfg = config_from_dict(copy.deepcopy(tiny_config_dict) | {"mode": "bounded", "rollout": {**tiny_config_dict["rollout"], "partial": True}})
    model, tok = tiny()
    engine = HFEngine.for_rollout(model, tok, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    generator = Generator(cfg, engine, tok, RewardScorer.from_config(cfg.reward), "w")
    refresh = StepRefresh(engine, version=2, weights=other_weights(model), after=2)
    items = [WorkItem(3, i, f"{i}+1=", str(i + 1)) for i in range(2)]

    async def groups():
        return [g async for call in generator.calls(items, 2, refresh=refresh) for g in call]

    made = asyncio.run(groups())
    assert [g.policy_version for g in made] == [2, 2]  # the oldest version among their tokens
    versions = [s.token_versions(g.policy_version).tolist() for g in made for s in g.samples]
    assert any(set(v) == {2, 3} for v in versions)
    # through the wire and back, validated against the group's window
    limits = GroupLimits(
        vocab_size=model.config.vocab_size, max_new_tokens=cfg.rollout.max_new_tokens, group_size=cfg.rollout.group_size, newest_version=3
    )
    again = [decode_group(pack(g), limits) for g in made]
    assert [s.token_versions(g.policy_version).tolist() for g in again for s in g.samples] == versions


def test_version_runs_are_compact_and_checked_on_decode():
    versions = np.array([4, 4, 4, 5, 5], dtype=np.int32)
    runs = encode_runs(versions)
    assert runs.tolist() == [[4, 3], [5, 2]]
    assert decode_runs(runs, 5, None, (4, 5)).tolist() == versions.tolist()
    mask = np.array([1, 1, 0, 1, 1], dtype=bool)  # an inserted token carries no version whatever the runs say
    assert decode_runs(runs, 5, mask, (4, 5)).tolist() == [4, 4, NO_VERSION, 5, 5]

    sample = Sample(np.arange(5, dtype=np.int32) + 4, np.full(5, -0.5, dtype=np.float32), 1.0, versions=versions)
    group = Group(5, 1, 4, "w", np.array([3, 4], dtype=np.int32), [sample, copy.deepcopy(sample)])
    wire = unpack(pack(group))
    assert "versions" not in wire["samples"][0] and wire["samples"][0]["version_runs"].shape == (2, 2)
    plain = unpack(pack(Group(5, 1, 4, "w", np.array([3], dtype=np.int32), [Sample(np.array([4], dtype=np.int32), np.zeros(1, np.float32), 0.0)])))
    assert "version_runs" not in plain["samples"][0]  # a one-version sample's message is as before

    def refused(mutate, limits: GroupLimits | None = None) -> str:
        data = unpack(pack(group))
        mutate(data)
        with pytest.raises(ProtocolError) as err:
            decode_group(pack(data), limits or GroupLimits())
        return str(err.value)

    assert "runs of 6 tokens for 5 tokens" in refused(lambda d: d["samples"][0].update(version_runs=np.array([[4, 3], [5, 3]], np.int32)))
    assert "a run of 0 tokens" in refused(lambda d: d["samples"][0].update(version_runs=np.array([[4, 5], [5, 0]], np.int32)))
    assert "a token of version 3, outside [4, 5]" in refused(lambda d: d["samples"][0].update(version_runs=np.array([[3, 1], [4, 4]], np.int32)))
    assert "a token of version 6, outside [4, 5]" in refused(lambda d: d["samples"][0].update(version_runs=np.array([[4, 1], [6, 4]], np.int32)))
    assert "outside [4, 4]" in refused(lambda d: None, GroupLimits(newest_version=4))  # version 5 is not published yet
    assert "(version, count) rows" in refused(lambda d: d["samples"][0].update(version_runs=np.array([4, 5], np.int32)))


def test_the_decoupled_weight_applies_per_token_to_the_stale_tokens_alone():
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, -4.0, -9.0, -9.0]])
    stale = torch.tensor([[True, True, False, False]])
    weights, truncated = stale_token_weights(old, behaviour, stale, cap=5.0)
    expected = torch.tensor([[np.exp(0.5), 5.0, 1.0, 1.0]], dtype=torch.float32)  # e^3 > 5 is capped; fresh tokens: 1
    torch.testing.assert_close(weights, expected)
    assert truncated.tolist() == [[False, True, False, False]]  # a fresh token's ratio e^8 is no truncation


def test_the_loss_equals_a_hand_computation_of_the_per_token_correction():
    """Iteration 3 trains a group of version 2 whose samples hold tokens of versions 2 and 3 (partial
    rollouts): the gradient is that of sum_t -A_i w_t log pi(t) / tokens, with w_t = min(pi_prox / pi_behaviour,
    cap) on version-2 tokens and 1 on version-3 tokens, each token's own behaviour log-prob."""
    model, tok = tiny()
    reference = copy.deepcopy(model)
    cap = 5.0
    learner = Learner(TrainerConfig(behaviour_weight_cap=cap, max_grad_norm=1e9), model, tok.pad_token_id)
    learner.begin_iteration(3)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, 60, 4).tolist()
    lengths, rewards = [5, 4, 6, 5], [1.0, 0.0, 0.0, 1.0]
    versions = [[2, 2, 3, 3, 3], [3, 3, 3, 3], None, [2, 3, 3, 3, 3]]  # None: every token version 2
    samples, hand = [], []
    for n, reward, v in zip(lengths, rewards, versions):
        tokens = rng.integers(4, 60, n).tolist()
        trainer_lp = logprobs_under(reference, prompt, tokens)
        token_versions = np.array(v if v is not None else [2] * n)
        stale = torch.from_numpy(token_versions < 3)
        # stale tokens: behaviour log-probs below the trainer's (weights e^2 > cap, and e^0.5); fresh ones: far off, weight 1 all the same
        shift = torch.where(torch.arange(n) % 2 == 0, torch.tensor(-2.0), torch.tensor(-0.5))
        behaviour = torch.where(stale, trainer_lp + shift, torch.tensor(-20.0))
        samples.append(
            Sample(np.array(tokens, np.int32), behaviour.numpy().astype(np.float32), reward, versions=None if v is None else np.array(v, np.int32))
        )
        weight = torch.where(stale, torch.exp(-shift).clamp(max=cap), torch.tensor(1.0))
        hand.append((tokens, weight))
    learner.train_on_groups([Group(3, 0, 2, "w", np.array(prompt, np.int32), samples)])

    r = torch.tensor(rewards)
    advantages = (r - r.mean()) / (r.std(unbiased=True) + 1e-6)
    total_tokens = sum(lengths)
    loss = sum((-a * w * logprobs_under_grad(reference, prompt, t)).sum() for a, (t, w) in zip(advantages, hand)) / total_tokens
    loss.backward()
    assert learner.sums["loss"] == pytest.approx(sum(float((-a * w).sum()) for a, (_, w) in zip(advantages, hand)), rel=1e-4)
    assert learner.sums["tis_truncated"] == sum(int((w == cap).sum()) for _, w in hand) > 0
    learner.strategy.scale_gradients(learner.model, 1.0 / learner.units)
    trained = dict(learner.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(trained[name].grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_log_prob_mismatch_reads_fresh_tokens_and_the_drift_stale_ones():
    """Iteration 3 trains samples whose tokens are of versions 2 and 3: the engine's log-probs of the version-3
    tokens are the trainer's (up to 1e-3 here), those of version 2 were sampled by weights since moved (0.5 or
    2 off). logprob_mismatch, the engine-against-trainer figure, reads the fresh tokens alone; the stale
    ones are stale_logprob_drift. Measured over every token, the mismatch would be ~0.6."""
    model, tok = tiny()
    learner = Learner(TrainerConfig(behaviour_weight_cap=5.0), model, tok.pad_token_id)
    learner.begin_iteration(3)
    rng = np.random.default_rng(1)
    prompt = rng.integers(4, 60, 4).tolist()
    versions = [[2, 2, 3, 3, 3], [3, 3, 3, 3], None, [2, 3, 3, 3, 3]]  # None: every token version 2
    samples, fresh_gaps, stale_gaps = [], [], []
    for n, v, reward in zip([5, 4, 6, 5], versions, [1.0, 0.0, 0.0, 1.0]):
        tokens = rng.integers(4, 60, n).tolist()
        stale = torch.from_numpy(np.array(v if v is not None else [2] * n) < 3)
        gap = torch.where(stale, torch.where(torch.arange(n) % 2 == 0, torch.tensor(2.0), torch.tensor(0.5)), torch.tensor(1e-3))
        behaviour = logprobs_under(model, prompt, tokens) - gap
        samples.append(
            Sample(np.array(tokens, np.int32), behaviour.numpy().astype(np.float32), reward, versions=None if v is None else np.array(v, np.int32))
        )
        fresh_gaps += gap[~stale].tolist()
        stale_gaps += gap[stale].tolist()
    learner.train_on_groups([Group(3, 0, 2, "w", np.array(prompt, np.int32), samples)])
    metrics = learner.step()
    assert metrics["logprob_mismatch"] == pytest.approx(np.mean(fresh_gaps), abs=1e-5)
    assert metrics["stale_logprob_drift"] == pytest.approx(np.mean(stale_gaps), rel=1e-4)
    assert mlflow_metric_name("stale_logprob_drift") == "train/stale_logprob_drift"


def test_groups_trained_in_one_micro_batch_equal_the_groups_trained_one_by_one():
    """The learner computes a micro-batch's per-token terms on one block of every group's rows: a fresh group
    (3 samples, the weights being trained), a stale one of 4 with tokens of two versions, and a stale one of 2
    with its own reward shape, of unequal lengths, trained together give the gradient, the loss and the
    counts of the three trained one at a time."""
    model, tok = tiny()
    rng = np.random.default_rng(3)

    def group(version: int, lengths: list[int], rewards: list[float], versions: list | None = None) -> Group:
        prompt = rng.integers(4, 60, int(rng.integers(3, 7))).tolist()
        samples = []
        for i, (n, reward) in enumerate(zip(lengths, rewards)):
            tokens = rng.integers(4, 60, n).tolist()
            behaviour = (logprobs_under(model, prompt, tokens) - torch.from_numpy(rng.uniform(0.0, 1.5, n)).float()).numpy()
            v = None if versions is None or versions[i] is None else np.array(versions[i], np.int32)
            samples.append(Sample(np.array(tokens, np.int32), behaviour.astype(np.float32), reward, versions=v))
        return Group(3, 0, version, "w", np.array(prompt, np.int32), samples)

    groups = [
        group(3, [5, 2, 7], [1.0, 0.0, 0.5]),
        group(2, [4, 6, 3, 5], [0.0, 1.0, 1.0, 0.0], [[2, 2, 3, 3], None, [2, 3, 3], [3, 3, 3, 3, 3]]),
        group(2, [9, 1], [1.0, 0.0]),
    ]

    def trained(batches: list[list[Group]]) -> tuple[dict, dict]:
        learner = Learner(TrainerConfig(behaviour_weight_cap=2.0, max_grad_norm=1e9), copy.deepcopy(model), tok.pad_token_id)
        learner.begin_iteration(3)
        for batch in batches:
            learner.train_on_groups(batch)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
        return grads, {**learner.sums, "units": learner.units, "tokens": learner.tokens, "groups": learner.groups}

    together, apart = trained([groups]), trained([[g] for g in groups])
    assert together[1]["tis_truncated"] > 0 and together[1]["drift"] > 0  # the stale tokens are weighted and measured
    for key, value in apart[1].items():
        assert together[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, grad in apart[0].items():
        torch.testing.assert_close(together[0][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def logprobs_under_grad(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]


def test_per_token_staleness_is_logged_beside_the_per_sample_histogram():
    def sample(n: int, versions=None, mask=None) -> Sample:
        return Sample(
            np.full(n, 5, np.int32),
            np.zeros(n, np.float32),
            0.0,
            loss_mask=None if mask is None else np.array(mask, np.uint8),
            versions=None if versions is None else np.array(versions, np.int32),
        )

    groups = [
        Group(4, 0, 3, "w", np.array([1], np.int32), [sample(4, [3, 3, 4, 4]), sample(2)]),
        Group(4, 1, 4, "w", np.array([1], np.int32), [sample(3), sample(3, [4, NO_VERSION, 4], mask=[1, 0, 1])]),
    ]
    stats = token_staleness_stats(groups, 4, 1)
    # staleness per sampled token: [1, 1, 0, 0] + [1, 1] + [0, 0, 0] + [0, 0] -> 4 of 11 at 1
    assert stats["token_staleness_fraction_1"] == pytest.approx(4 / 11)
    assert stats["token_staleness_fraction_0"] == pytest.approx(7 / 11)
    assert stats["token_staleness_mean"] == pytest.approx(4 / 11)
    assert stats["mixed_version_sample_fraction"] == pytest.approx(1 / 4)
    assert mlflow_metric_name("token_staleness_fraction_1") == "rollout/token_staleness_fraction_1"
    assert mlflow_metric_name("mixed_version_sample_fraction") == "rollout/mixed_version_sample_fraction"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "periodic"}, "rollout.partial needs mode 'bounded' (mode 'periodic'"),
        ({"mode": "sync"}, "rollout.partial needs mode 'bounded' (mode 'sync'"),
    ],
)
def test_partial_rollouts_outside_bounded_mode_are_refused_in_one_line(tiny_config_dict, overrides, message):
    data = copy.deepcopy(tiny_config_dict)
    data["rollout"]["partial"] = True
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert message in str(err.value) and "\n" not in str(err.value).strip()


def test_partial_rollouts_load_in_bounded_mode(tiny_config_dict):
    cfg = config_from_dict(copy.deepcopy(tiny_config_dict) | {"mode": "bounded", "rollout": {**tiny_config_dict["rollout"], "partial": True}})
    assert cfg.rollout.partial and not config_from_dict(copy.deepcopy(tiny_config_dict)).rollout.partial
    on_vllm = config_from_dict(
        copy.deepcopy(tiny_config_dict) | {"mode": "bounded", "rollout": {**tiny_config_dict["rollout"], "partial": True, "engine": "vllm"}}
    )
    assert on_vllm.rollout.partial and on_vllm.rollout.engine == "vllm"  # single-turn: vLLM aborts and resumes (tests/test_vllm_partial.py)

"""Partial rollouts of multi-turn trajectories (rollout.partial with rollout.agent, HF engine).

Real parts: a tiny model built from a config, the HF engine's row batch and turn loop, the generator,
the protocol codec. The trigger is deterministic: the first time a row's turn ends, its environment's
answer is held until newer weights are in, and the next decode step says they wait. So at the swap one
row is between turns (its answer pending) and the others are stopped in the middle of a turn. The
learner's per-token correction on such samples is checked against a hand computation.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from tests.conftest import eos_prone
from tests.test_partial_rollouts import logprobs_under_grad
from tidal.algo import token_logprobs_from_logits
from tidal.config import TinyModelConfig, TrainerConfig, config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import Group, Sample
from tidal.rollout import hf_rows
from tidal.rollout.engine import GroupRequest, HFEngine, group_generator
from tidal.rollout.generator import mixed_versions
from tidal.rollout.trajectory import Turn
from tidal.token_versions import NO_VERSION
from tidal.trainer.learner import Learner

MAX_NEW = 7
START = 4  # the version the trajectories start with


def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok).eval()
    return eos_prone(model, tok, 2.5), tok


def other_weights(model) -> dict[str, torch.Tensor]:
    """Version START + 1: every tensor moved, so its log-probs differ from version START's everywhere."""
    gen = torch.Generator().manual_seed(7)
    return {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


class HeldFirstAnswer:
    """An environment per row that answers each turn with tokens of its own (unequal lengths) and ends
    some rows early; it records every call. The first answer of the call waits until new weights are in,
    and meanwhile tells the refresh that they wait."""

    def __init__(self, tok, ends_after: dict[int, int]):
        self.tok, self.ends_after = tok, ends_after
        self.seen: dict[int, list[Turn]] = {}
        self.held: int | None = None
        self.loaded = asyncio.Event()

    def inserted(self, row: int, t: int) -> list[int]:
        return self.tok(f"<r{row}t{t}>" + "=" * (row % 3), add_special_tokens=False).input_ids

    async def respond(self, row: int, turn: Turn) -> list[int] | None:
        self.seen.setdefault(row, []).append(turn)
        if self.held is None:
            self.held = row
            await asyncio.wait_for(self.loaded.wait(), 60)  # a missed swap fails the test instead of hanging it
        t = len(self.seen[row])
        return None if t >= self.ends_after.get(row, 99) else self.inserted(row, t)


class NewWeightsWhenHeld:
    """A Refresh (tidal.rollout.refresh): newer weights wait once the environment holds an answer;
    swap loads them into the engine's model."""

    def __init__(self, engine: HFEngine, env: HeldFirstAnswer, weights: dict):
        self.engine, self.env, self.weights, self.version = engine, env, weights, START
        self.swaps = 0

    def interrupt(self) -> bool:
        return self.swaps == 0 and self.env.held is not None

    async def swap(self) -> int:
        self.engine.load_state_dict(self.weights)
        self.swaps += 1
        self.version += 1
        self.env.loaded.set()
        return self.version


def logprobs_under(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]


@pytest.fixture
def reloads(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(rows between turns, rows stopped mid-turn) at each reload of the row batch."""
    real = hf_rows.HFRows.reload
    seen: list[tuple[list[int], list[int]]] = []

    def reload(self, version: int) -> None:
        seen.append((sorted(self.kept), sorted(self.stopped)))
        real(self, version)

    monkeypatch.setattr(hf_rows.HFRows, "reload", reload)
    return seen


def test_trajectories_span_two_versions_each_token_with_its_samplers_logprob_and_every_answer_inserted_once(reloads):
    model, tok = tiny()
    before = copy.deepcopy(model)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW)
    prompts = [tok(t).input_ids for t in ("12+3=", "45+678=", "9-1000+20=")]
    requests = [GroupRequest(p, n, group_generator(0, 1, i)) for i, (p, n) in enumerate(zip(prompts, (3, 2, 4)))]
    env = HeldFirstAnswer(tok, ends_after={0: 2, 5: 1})
    refresh = NewWeightsWhenHeld(engine, env, other_weights(model))
    trajectories = asyncio.run(engine.play(requests, env, max_turns=3, refresh=refresh))
    after = copy.deepcopy(model)  # the engine's model now holds the new weights
    assert refresh.swaps == 1 and len(reloads) == 1
    between, stopped = reloads[0]
    assert env.held in between and stopped, "the swap found a row between turns and rows mid-turn"

    rows_prompts = [r.prompt_ids for r in requests for _ in range(r.n)]
    spanning_turns = 0
    for row, (prompt, t) in enumerate(zip(rows_prompts, trajectories)):
        mask = np.array(t.loss_mask, dtype=bool)
        versions = np.array(t.versions)
        assert versions.size == mask.size and (versions[~mask] == NO_VERSION).all() and set(versions[mask]) <= {START, START + 1}
        # the environment was asked once per turn, and each answer is in the trajectory once, as given
        assert len(env.seen[row]) == t.turns
        expected = []
        for k, turn in enumerate(env.seen[row]):
            expected += turn.token_ids
            if k + 1 < t.turns:
                expected += env.inserted(row, k + 1)
        assert t.token_ids == expected
        spanning_turns += sum(len(set(turn.versions)) == 2 for turn in env.seen[row])
        # each sampled token's behaviour log-prob is the one the weights that sampled it give over everything before it
        old, new = logprobs_under(before, prompt, t.token_ids), logprobs_under(after, prompt, t.token_ids)
        expected_lp = torch.where(torch.from_numpy(versions == START), old, new)[torch.from_numpy(mask)]
        torch.testing.assert_close(torch.tensor(t.logprobs)[mask], expected_lp, atol=1e-4, rtol=0)
        fresh = torch.from_numpy(versions[mask] == START + 1)
        if fresh.any():  # the new weights really differ there: a stale cache would not match them
            assert not torch.allclose(torch.tensor(t.logprobs)[mask][fresh], old[torch.from_numpy(mask)][fresh], atol=1e-2)
    assert spanning_turns >= 1  # a turn stopped mid-way went on with the new weights
    held = trajectories[env.held]
    if held.turns > 1:  # the held row's next turn, after its answer, is the new version's alone
        first_turn = len(env.seen[env.held][0].token_ids)
        assert set(np.array(held.versions)[first_turn:][np.array(held.loss_mask[first_turn:], bool)]) == {START + 1}


class TwoSwaps(NewWeightsWhenHeld):
    """Newer weights twice: once the environment holds its first answer, and again `later` decode steps
    after, when `third` weights are loaded (None: that snapshot is refused, and the engine keeps the
    weights and version it has, as PolicyRefresh.swap does)."""

    def __init__(self, engine: HFEngine, env: HeldFirstAnswer, weights: dict, later: int, third: dict | None):
        super().__init__(engine, env, weights)
        self.later, self.third, self.asked_after = later, third, 0

    def interrupt(self) -> bool:
        if self.swaps == 1:
            self.asked_after += 1
            return self.asked_after == self.later
        return super().interrupt()

    async def swap(self) -> int:
        if self.swaps != 1:
            return await super().swap()
        self.swaps += 1
        if self.third is not None:
            self.engine.load_state_dict(self.third)
            self.version += 1
        return self.version


@pytest.mark.parametrize("second", ["loaded", "refused"])
def test_a_second_stop_goes_on_with_the_weights_the_engine_then_holds(reloads, second):
    """Three versions in one call (or two, when the second snapshot is refused): every sampled token's
    log-prob is its own version's, across two reloads of the row batch."""
    model, tok = tiny()
    weights = {START: copy.deepcopy(model)}
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW)
    requests = [GroupRequest(tok(t).input_ids, 3, group_generator(0, 2, i)) for i, t in enumerate(("7*8=", "123-45="))]
    env = HeldFirstAnswer(tok, ends_after={})
    new = other_weights(model)
    third = {k: v.flip(0) if v.dim() else v for k, v in new.items()} if second == "loaded" else None
    refresh = TwoSwaps(engine, env, new, later=3, third=third)

    async def play_and_keep_each_version():
        real_swap = refresh.swap

        async def swap() -> int:
            version = await real_swap()
            weights.setdefault(version, copy.deepcopy(model))
            return version

        refresh.swap = swap
        return await engine.play(requests, env, max_turns=3, refresh=refresh)

    trajectories = asyncio.run(play_and_keep_each_version())
    assert refresh.swaps == 2 and len(reloads) == 2 and all(stopped for _, stopped in reloads)
    assert sorted(weights) == ([START, START + 1, START + 2] if second == "loaded" else [START, START + 1])
    prompts = [r.prompt_ids for r in requests for _ in range(r.n)]
    seen = set()
    for prompt, t in zip(prompts, trajectories):
        mask, versions = np.array(t.loss_mask, bool), np.array(t.versions)
        seen |= set(versions[mask].tolist())
        expected = torch.zeros(len(t.token_ids))
        for version, m in weights.items():
            expected = torch.where(torch.from_numpy(versions == version), logprobs_under(m, prompt, t.token_ids), expected)
        torch.testing.assert_close(torch.tensor(t.logprobs)[mask], expected[torch.from_numpy(mask)], atol=1e-4, rtol=0)
    assert seen == set(weights)


def test_a_trajectorys_versions_ride_on_its_sample_only_when_they_differ_from_the_groups():
    assert mixed_versions(None, 3) is None
    assert mixed_versions([3, 3, NO_VERSION, 3], 3) is None
    assert mixed_versions([3, NO_VERSION, 4], 3).tolist() == [3, NO_VERSION, 4]
    assert mixed_versions([4, 4], 3).tolist() == [4, 4]  # one version, but not the group's


def test_partial_rollouts_load_with_an_agent_on_either_engine(tiny_config_dict):
    data = copy.deepcopy(tiny_config_dict)
    data["mode"] = "bounded"
    data["rollout"] |= {"partial": True, "agent": {"env": "tests.environments:Chatty", "max_turns": 2}}
    assert config_from_dict(copy.deepcopy(data)).rollout.partial
    data["rollout"]["engine"] = "vllm"
    data["eval"]["engine"] = "hf"  # held-out eval through an agent runs on the HF engine
    assert config_from_dict(data).rollout.partial  # vLLM streams each turn's request (vllm_partial.TurnSwaps)


def test_the_loss_of_multi_turn_samples_spanning_two_versions_equals_a_hand_computation():
    """Iteration 3 trains a group of version 2 whose trajectories hold sampled tokens of versions 2 and 3
    and inserted tokens (loss mask 0, no version): the gradient is that of sum over sampled tokens of
    -A_i w_t log pi(t) / sampled tokens, w_t = min(pi_prox / pi_behaviour, cap) on version-2 tokens and 1
    on version-3 tokens; inserted tokens count nowhere."""
    model, tok = tiny()
    reference = copy.deepcopy(model)
    cap = 5.0
    learner = Learner(TrainerConfig(behaviour_weight_cap=cap, max_grad_norm=1e9), model, tok.pad_token_id)
    learner.begin_iteration(3)
    rng = np.random.default_rng(1)
    prompt = rng.integers(4, 60, 4).tolist()
    n = NO_VERSION
    # sampled turn, inserted tokens, sampled turn; versions None: every sampled token version 2
    versions = [[2, 2, n, n, 2, 3, 3], [2, 3, n, n, n, 3, 3], None, [3, 3, n, 3, 3, 3, 3]]
    rewards = [1.0, 0.0, 0.0, 1.0]
    samples, hand = [], []
    for reward, v in zip(rewards, versions):
        tokens = rng.integers(4, 60, 7).tolist()
        token_versions = np.array(v if v is not None else [2, 2, n, n, 2, 2, 2])
        mask = token_versions != NO_VERSION
        trainer_lp = logprobs_under(reference, prompt, tokens)
        stale = torch.from_numpy(token_versions == 2)
        shift = torch.where(torch.arange(7) % 2 == 0, torch.tensor(-2.0), torch.tensor(-0.5))
        behaviour = torch.where(stale, trainer_lp + shift, torch.tensor(-20.0))
        behaviour = torch.where(torch.from_numpy(mask), behaviour, torch.tensor(0.0))
        samples.append(
            Sample(
                np.array(tokens, np.int32),
                behaviour.numpy().astype(np.float32),
                reward,
                loss_mask=mask.astype(np.uint8),
                versions=None if v is None else token_versions.astype(np.int32),
            )
        )
        weight = torch.where(stale, torch.exp(-shift).clamp(max=cap), torch.tensor(1.0))
        hand.append((tokens, weight, torch.from_numpy(mask)))
    learner.train_on_groups([Group(3, 0, 2, "w", np.array(prompt, np.int32), samples)])

    r = torch.tensor(rewards)
    advantages = (r - r.mean()) / (r.std(unbiased=True) + 1e-6)
    sampled = sum(int(m.sum()) for _, _, m in hand)
    loss = sum((-a * w * logprobs_under_grad(reference, prompt, t))[m].sum() for a, (t, w, m) in zip(advantages, hand)) / sampled
    loss.backward()
    assert learner.sums["loss"] == pytest.approx(sum(float((-a * w)[m].sum()) for a, (_, w, m) in zip(advantages, hand)), rel=1e-4)
    assert learner.sums["tis_truncated"] == sum(int((w[m] == cap).sum()) for _, w, m in hand) > 0
    learner.strategy.scale_gradients(learner.model, 1.0 / learner.units)
    trained = dict(learner.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(trained[name].grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)

"""The rollout side's environment loop (rollout.agent.env) over the HF engine and the tiny model's tool
chat template: trajectory groups whose tokens are the sampled ones plus the template's rendering of
each observation, with the loss mask, rewards and environment counts the trainer reads."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.conftest import eos_prone
from tests.conftest import mask_runs as runs
from tests.environments import steps_at_once
from tidal import sandbox
from tidal.blocking import run_blocking
from tidal.config import TrainerConfig, config_from_dict
from tidal.demo.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from tidal.protocol import Group, WorkItem, decode_group, pack
from tidal.rewards import RewardScorer
from tidal.roles import group_limits
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import Generator, generate_groups
from tidal.rollout.worker import pull_size
from tidal.trainer.learner import Learner

G, MAX_NEW_TOKENS = 3, 6


def tiny_engine(eos_logit: float = 2.0):
    """The tiny model with an EOS bias so turns end (an untrained model rarely samples EOS)."""
    from tidal.config import TinyModelConfig

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(
        TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_position_embeddings=256), tok
    )
    model = eos_prone(model, tok, eos_logit)
    return HFEngine(model.eval(), tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS), tok


def agent_config(env: str, **agent):
    return config_from_dict(
        {
            "rollout": {"group_size": G, "max_new_tokens": MAX_NEW_TOKENS, "agent": {"env": env, "tools": ["calc"], "max_turns": 3, **agent}},
            "trainer": {"prompts_per_iteration": 2},
            "eval": {"enabled": False},
        }
    )


def items():
    return [WorkItem(0, 0, "12+34=", "46"), WorkItem(0, 1, "5-7=", "-2")]


def test_trajectory_groups_are_the_sampled_tokens_and_the_templates_rendering_of_each_observation():
    engine, tok = tiny_engine(eos_logit=2.5)
    cfg = agent_config("tests.environments:Chatty")
    agent = AgentLoop.from_config(cfg, tok, 256)
    assert agent.chat_template == TOOL_CHAT_TEMPLATE  # the tiny tokenizer has none of its own
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w", agent=agent)
    assert [g.prompt_id for g in groups] == [0, 1]
    assert tok.decode(groups[0].prompt_ids.tolist()) == "tools: calc\n<u>12+34=\n<a>"
    inserted = tok("<t>ok\n<a>", add_special_tokens=False).input_ids
    turns = []
    for g in groups:
        for s in g.samples:
            parts = runs(s.loss_mask)
            assert parts[0][0] == 1 and parts[-1][0] == 1  # starts and ends with a sampled turn
            for value, start, end in parts:
                tokens = s.token_ids[start:end].tolist()
                if value == 0:
                    assert tokens == inserted and (s.logprobs[start:end] == 0).all()
                else:  # a turn that goes on ended with EOS; the tokens are exactly the engine's
                    assert end == len(s.token_ids) or tokens[-1] == tok.eos_token_id
            turns.append(sum(v for v, _, _ in parts))
            # max_turns: the environment wanted more after the third turn; length: the last turn was cut
            _, last_start, last_end = parts[-1]
            cut = last_end - last_start == MAX_NEW_TOKENS and s.token_ids[-1] != tok.eos_token_id
            assert s.finish_reason == ("length" if cut else "max_turns") and (cut or turns[-1] == 3)
            assert s.reward == float(turns[-1]) and s.reward_parts == {"turns": float(turns[-1])}
        assert g.env_stats["trajectories"] == G and g.env_stats["turns"] == sum(turns[-G:])
    assert max(turns) == 3 and 3 in turns  # the environment never ends a trajectory: max_turns does
    # the trainer accepts it (the run's limits) and sees the engine's log-probs on every sampled token
    limits = group_limits(cfg, Learner(TrainerConfig(), copy.deepcopy(engine.model), tok.pad_token_id), 10**6)(0)
    decoded = [decode_group(pack(g), limits) for g in groups]
    learner = Learner(TrainerConfig(), copy.deepcopy(engine.model), tok.pad_token_id, max_new_tokens=MAX_NEW_TOKENS)
    learner.train_on_groups(decoded)
    assert learner.tokens == sum(s.sampled_tokens for g in groups for s in g.samples)
    assert learner.step()["logprob_mismatch"] < 1e-5


def test_the_hf_engine_runs_one_turns_environment_steps_at_once(tmp_path, monkeypatch):
    """A turn's steps run together, on threads and in several environment processes: a slow step
    costs its latency once per turn, not once per row. The trajectories are the ones the steps one at
    a time give."""
    engine, tok = tiny_engine()
    cfg = agent_config("tests.environments:Overlapping", env_processes=len(items()) * G)  # a process per trajectory: none waits for another's
    monkeypatch.setenv("TIDAL_TEST_MARKERS", str(tmp_path))
    sandbox.configure(sandbox.SandboxPolicy(write_paths=(str(tmp_path),)))
    try:
        groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w")
    finally:
        sandbox.configure(sandbox.SandboxPolicy())
    most, processes = steps_at_once(tmp_path)
    assert most > 1 and processes > 1
    assert groups[0].env_stats["turns"] > G  # some rows took several turns, each stepped
    chatty = generate_groups(
        engine, tok, RewardScorer.from_config(cfg.reward), items(), agent_config("tests.environments:Chatty"), version=0, worker_id="w"
    )
    for g, h in zip(groups, chatty):
        assert [s.token_ids.tolist() for s in g.samples] == [s.token_ids.tolist() for s in h.samples]


def test_a_group_goes_out_when_its_trajectories_end_not_when_the_engine_call_does():
    """Problem 0's tool calls take 3 s each; problem 1's group, in the same engine call, is yielded on its
    own first (the worker publishes it and the trainer trains it meanwhile), then problem 0's."""
    engine, tok = tiny_engine(eos_logit=2.5)
    cfg = agent_config("tests.environments:SlowOnProblemZero", env_processes=len(items()) * G)
    generator = Generator.for_worker(cfg, engine, tok, RewardScorer.from_config(cfg.reward), "w")

    async def yields() -> list[list[int]]:
        return [[g.prompt_id for g in groups] async for groups in generator.calls(items(), 0)]

    try:
        order = run_blocking(yields())
    finally:
        generator.close()
    assert order == [[1], [0]]


def test_the_next_item_joins_the_running_call_when_a_group_ends():
    """Two groups in flight at most: problem 0's tool calls take 3 s each; when problem 1's group ends,
    problem 2's joins the running call (not a call of its own after problem 0's), and goes out before
    problem 0's. Every group is made once, from its own trajectories."""
    engine, tok = tiny_engine(eos_logit=2.5)
    cfg = agent_config("tests.environments:SlowOnProblemZero", env_processes=3 * G)
    generator = Generator.for_worker(cfg, engine, tok, RewardScorer.from_config(cfg.reward), "w")
    three = [*items(), WorkItem(0, 2, "3*4=", "12")]

    async def yields() -> list[list[Group]]:
        return [groups async for groups in generator.calls(three, 0, max_groups_per_call=2)]

    try:
        made = run_blocking(yields())
    finally:
        generator.close()
    assert [[g.prompt_id for g in groups] for groups in made] == [[1], [2], [0]]
    for (group,) in made:
        assert len(group.samples) == G and group.env_stats["trajectories"] == G
        assert tok.decode(group.prompt_ids.tolist()).endswith(three[group.prompt_id].prompt + "\n<a>")


def test_long_observations_are_cut_to_the_per_turn_limit_and_counted():
    engine, tok = tiny_engine()
    cfg = agent_config("tests.environments:Verbose", max_env_tokens_per_turn=20)
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items()[:1], cfg, version=0, worker_id="w")
    inserted = [end - start for g in groups for s in g.samples for v, start, end in runs(s.loss_mask) if v == 0]
    assert inserted and max(inserted) <= 20
    assert groups[0].env_stats["truncated_observations"] >= len(inserted)


def test_an_environment_that_raises_ends_only_its_own_trajectory():
    engine, tok = tiny_engine(eos_logit=2.5)
    cfg = agent_config("tests.environments:Fragile")
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w")
    reasons = [s.finish_reason for g in groups for s in g.samples]
    errors = sum(g.env_stats["env_errors"] for g in groups)
    assert errors == reasons.count("env_error") > 0
    assert all(len(g.samples) == G for g in groups)


def test_a_trajectory_past_its_time_ends_at_the_next_turn_boundary():
    engine, tok = tiny_engine()
    cfg = agent_config("tests.environments:Chatty", trajectory_timeout_seconds=1e-9)
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items()[:1], cfg, version=0, worker_id="w")
    for s in groups[0].samples:
        assert s.loss_mask.all() and s.finish_reason in ("timeout", "length")


def test_a_turn_cut_at_max_new_tokens_ends_the_trajectory():
    engine, tok = tiny_engine(eos_logit=-50.0)  # never samples EOS
    cfg = agent_config("tests.environments:Chatty")
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items()[:1], cfg, version=0, worker_id="w")
    assert all(s.finish_reason == "length" and len(s.token_ids) == MAX_NEW_TOKENS and s.loss_mask.all() for s in groups[0].samples)


def test_a_worker_pulls_for_whole_trajectories():
    """The token budget of one engine call counts every turn and what is inserted between them."""
    single = config_from_dict({"rollout": {"group_size": 4, "max_new_tokens": 10, "generation_token_budget": 4000}})
    agent = config_from_dict(
        {
            "rollout": {
                "group_size": 4,
                "max_new_tokens": 10,
                "generation_token_budget": 4000,
                "agent": {"env": "tools", "max_turns": 3, "max_env_tokens_per_turn": 20},
            },
            "eval": {"enabled": False},
        }
    )
    longest = [(single, 40 + 10), (agent, 40 + 3 * 10 + 2 * 20)]  # prompt + every turn + the observations between them
    for cfg, tokens in longest:
        pull, group = pull_size(cfg, 40), 4 * tokens
        assert pull * group <= 4000 < (pull + 1) * group, (pull, tokens)  # the pull's worst case fits; one group more would not
    assert pull_size(agent, 40) < pull_size(single, 40)


def test_a_named_model_without_a_chat_template_is_refused():
    from tidal.envs import EnvError

    tok = build_char_tokenizer()
    cfg = config_from_dict({"model": {"name_or_path": "/some/model"}, "rollout": {"agent": {"env": "tools"}}, "eval": {"enabled": False}})
    with pytest.raises(EnvError, match="rollout.agent needs a chat template"):
        AgentLoop.from_config(cfg, tok)


def test_agent_metrics_from_the_groups():
    from tidal.protocol import Group, Sample
    from tidal.trainer.metrics import agent_stats, group_stats

    def sample(mask):
        mask = np.asarray(mask, dtype=np.uint8)
        return Sample(np.arange(4, 4 + mask.size, dtype=np.int32), np.zeros(mask.size, np.float32), 0.0, loss_mask=mask)

    stats = {"trajectories": 2, "turns": 5, "tool_calls": 4, "tool_errors": 1, "malformed_calls": 1, "refused_calls": 0, "env_seconds": 0.5}
    stats |= {"tool_timeouts": 1, "tool_crashes": 0, "tool_outputs_cut": 2}
    g = Group(0, 0, 0, "w", np.array([1], dtype=np.int32), [sample([1, 0, 0, 1]), sample([1, 1, 0, 0, 0, 0, 1, 1])], env_stats=stats)
    m = agent_stats([g])
    assert m["agent_turns_mean"] == 2.5 and m["agent_tool_calls_mean"] == 2.0
    assert m["agent_tool_error_rate"] == pytest.approx(2 / 5)  # a failed and an unreadable call of five attempted
    assert m["agent_masked_token_fraction"] == pytest.approx(6 / 12) and m["agent_trajectory_length_max"] == 8.0
    assert m["agent_env_seconds"] == 0.5 and m["agent_trajectory_length_p50"] == 6.0
    assert (m["agent_tool_timeouts"], m["agent_tool_crashes"], m["agent_tool_outputs_cut"]) == (1.0, 0.0, 2.0)
    single = Group(0, 1, 0, "w", np.array([1], dtype=np.int32), [Sample(np.array([5], dtype=np.int32), np.zeros(1, np.float32), 1.0)])
    assert agent_stats([single]) == {} and not any(k.startswith("agent_") for k in group_stats([single]))


def test_a_conversation_rendered_again_comes_from_the_kept_renders_and_equals_a_fresh_rendering():
    engine, tok = tiny_engine()
    cfg = agent_config("tests.environments:Chatty")
    agent = AgentLoop.from_config(cfg, tok, 256)
    calls = []
    render = agent._render
    agent._render = lambda *a: calls.append(a) or render(*a)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "12+34="}]
    first = agent.render(conversation, tools, True)
    first.append(-1)  # a caller's change to its list does not reach the kept rendering
    again = agent.render([dict(m) for m in conversation], tools, True)
    assert len(calls) == 1 and again == render(conversation, tools, True) and -1 not in again
    assert agent.render(conversation, tools, False) == render(conversation, tools, False) and len(calls) == 2
    assert agent.render([{"role": "user", "content": "5-7="}], tools, True) != again and len(calls) == 3
    # a whole call: every row of a group and each prompt's chunking render one conversation once
    calls.clear()
    generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w", agent=agent)
    first_prompts = [a for a in calls if a[2] and len(a[0]) == 1]
    assert len(first_prompts) == len(items())

"""The calculator demo's parts: the warm start's synthetic tool-use traces (played through the run's
own environment, template and token layout), held-out evaluation through the environment, and the
tool-use lines of the end-of-run table."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.test_agent_loop import tiny_engine
from tidal.config import config_from_dict, load_config
from tidal.data import Problem, make_arithmetic
from tidal.demo.tiny import build_char_tokenizer
from tidal.demo.tool_traces import TRACE_KINDS, make_traces, mistype, play_trace, trace_batcher, trace_tool
from tidal.demo.warm_start import batch_loss, plays_tool_traces, warm_start_key
from tidal.evaluate import answer_scores, held_out_agent_scores
from tidal.protocol import tool_use_rates
from tidal.rollout.agent import AgentLoop
from tidal.summary import agent_before_after, agent_lines, agent_training


def calculator_config(agent: dict | None = None, **overrides):
    cfg = {
        "data": {"task": "arithmetic", "operations": ["*"], "max_digits": 3, "num_train": 200, "num_eval": 20},
        "model": {"tiny": {"max_position_embeddings": 256}},
        "rollout": {"max_new_tokens": 80, "agent": {"env": "tools", "tools": ["calc"], "max_turns": 3, "max_env_tokens_per_turn": 96}},
        "eval": {"engine": "hf"},
    }
    for key, value in overrides.items():
        cfg.setdefault(key, {}).update(value)
    cfg["rollout"]["agent"].update(agent or {})
    return config_from_dict(cfg)


@pytest.fixture(scope="module")
def loop():
    agent = AgentLoop.from_config(calculator_config(), build_char_tokenizer())
    yield agent
    agent.close()


def sampled_text(loop, trace) -> list[str]:
    """The labelled runs of a trace, decoded: what the policy is taught to sample."""
    runs, current = [], []
    for token, label in zip(trace.token_ids, trace.labels):
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return [loop.tokenizer.decode(r) for r in runs]


def test_a_tool_trace_is_the_rollouts_token_layout_with_only_the_policys_turns_labelled(loop):
    problem = Problem(0, "931*140=", "130340")
    trace = play_trace(loop, problem, "tool", random.Random(0))
    call = '<tool_call>{"name":"calc","arguments":{"expression":"931*140"}}</tool_call>'
    assert sampled_text(loop, trace) == [call + "<eos>", "A: 130340<eos>"]
    row = loop.start_row(problem)
    prompt = loop.render(row.messages, row.env.tool_schemas, True)
    inserted = loop.inserted_tokens([{"role": "tool", "name": "calc", "content": "130340"}], row.env.tool_schemas)
    call_ids = loop.tokenizer(call, add_special_tokens=False).input_ids + [loop.eos]
    answer_ids = loop.tokenizer("A: 130340", add_special_tokens=False).input_ids + [loop.eos]
    assert trace.token_ids == prompt + call_ids + inserted + answer_ids
    assert trace.labels == [-100] * len(prompt) + call_ids + [-100] * len(inserted) + answer_ids


def test_wrong_calls_run_through_the_environment_and_the_answer_follows_what_it_said(loop):
    problem = Problem(0, "931*140=", "130340")
    typo = sampled_text(loop, play_trace(loop, problem, "typo", random.Random(1)))
    expression = json.loads(typo[0].removeprefix("<tool_call>").split("</tool_call>")[0])["arguments"]["expression"]
    assert expression != "931*140" and len(expression) == len("931*140")
    assert typo[1] == f"A: {eval(expression)}<eos>"  # noqa: S307 - digits and one operator, checked above
    malformed = play_trace(loop, problem, "malformed", random.Random(2))
    text = loop.tokenizer.decode(malformed.token_ids)
    assert "error: calc: unknown argument(s) ['expr']" in text and sampled_text(loop, malformed)[1] == "A: 130340<eos>"
    direct = play_trace(loop, problem, "direct", random.Random(3))
    assert sampled_text(loop, direct) == ["A: 130340<eos>"]


@pytest.fixture(scope="module")
def python_loop():
    agent = AgentLoop.from_config(calculator_config(agent={"tools": ["python"]}, rollout={"max_new_tokens": 96}), build_char_tokenizer())
    yield agent
    agent.close()


def test_python_traces_run_the_program_and_copy_what_it_printed(python_loop):
    problem = Problem(0, "931*140=", "130340")
    tool = sampled_text(python_loop, play_trace(python_loop, problem, "tool", random.Random(0), "python"))
    assert tool == ['<tool_call>{"name":"python","arguments":{"code":"print(931*140)"}}</tool_call><eos>', "A: 130340<eos>"]
    typo = sampled_text(python_loop, play_trace(python_loop, problem, "typo", random.Random(1), "python"))
    code = json.loads(typo[0].removeprefix("<tool_call>").split("</tool_call>")[0])["arguments"]["code"]
    assert code != "print(931*140)" and typo[1] == f"A: {eval(code.removeprefix('print'))}<eos>"  # noqa: S307 - digits and one operator
    silent = play_trace(python_loop, problem, "malformed", random.Random(2), "python")
    assert "<t>(no output)" in python_loop.tokenizer.decode(silent.token_ids)  # computed, never printed: then a guess
    assert sampled_text(python_loop, silent) == ['<tool_call>{"name":"python","arguments":{"code":"931*140"}}</tool_call><eos>', "A: 130340<eos>"]


def test_mistype_changes_exactly_one_digit():
    rng = random.Random(0)
    for _ in range(50):
        changed = mistype("931*140", rng)
        assert sum(a != b for a, b in zip(changed, "931*140")) == 1 and changed[3] == "*"


def test_the_trace_mix_follows_tool_use_and_tool_mistakes(loop):
    problems = make_arithmetic(0, 400, 0, 3, ["*"]).train
    traces = make_traces(loop, problems, tool_use=0.5, tool_mistakes=0.4, seed=0)
    counts = {k: sum(t.kind == k for t in traces) for k in TRACE_KINDS}
    assert 0.4 < (400 - counts["direct"]) / 400 < 0.6
    assert 0.3 < (counts["typo"] + counts["malformed"]) / (400 - counts["direct"]) < 0.5
    assert make_traces(loop, problems[:20], 0.5, 0.4, 0) == traces[:20]  # deterministic from the seed
    assert {t.kind for t in make_traces(loop, problems, 0.0, 0.4, 0)} == {"direct"}


def test_chunked_batches_give_the_loss_of_one_padded_batch(loop):
    import torch

    from tidal.config import TinyModelConfig
    from tidal.demo.tiny import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(
        TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_position_embeddings=256), loop.tokenizer
    )
    traces = make_traces(loop, make_arithmetic(0, 12, 0, 3, ["*"]).train, 0.5, 0.3, 0)
    indices = list(range(12))
    whole = batch_loss(model, trace_batcher(traces, loop.tokenizer.pad_token_id, chunks=1)(indices))
    chunked = batch_loss(model, trace_batcher(traces, loop.tokenizer.pad_token_id, chunks=3)(indices))
    assert len(trace_batcher(traces, loop.tokenizer.pad_token_id, chunks=3)(indices)) == 3
    assert torch.allclose(whole, chunked, atol=1e-5)


def test_only_the_built_in_environment_with_a_built_in_tool_plays_tool_traces():
    assert plays_tool_traces(calculator_config())
    assert plays_tool_traces(calculator_config(agent={"tools": ["tests.tools:pid", "python"]}))
    assert not plays_tool_traces(calculator_config(agent={"tools": ["tests.tools:pid"]}))
    assert warm_start_key(calculator_config()) != warm_start_key(calculator_config(agent={"tools": ["python"]}))
    example = load_config(Path(__file__).resolve().parents[1] / "examples" / "python-tool.yaml")
    assert plays_tool_traces(example) and trace_tool(example.rollout.agent.tools) == "python"
    assert not plays_tool_traces(calculator_config(agent={"env": "tests.environments:Chatty"}))
    assert not plays_tool_traces(config_from_dict({"eval": {"enabled": False}}))


def test_a_shared_warm_start_seed_gives_every_run_seed_the_same_warm_start():
    shared = [warm_start_key(calculator_config(model={"warm_start": {"seed": 0}}).model_copy(update={"seed": s})) for s in (0, 1)]
    own = [warm_start_key(calculator_config().model_copy(update={"seed": s})) for s in (0, 1)]
    assert shared[0] == shared[1] and own[0] != own[1]
    assert shared[0] == own[0]  # warm_start.seed 0 is what an unset one resolves to for run seed 0


def test_scores_and_tool_use_rates_are_computed_from_what_happened():
    problems = [Problem(0, "2*3=", "6"), Problem(1, "2*4=", "8")]
    scores = answer_scores([(problems[0], ["A: 5", "A: 6"]), (problems[1], ["A: 8", "A: 8"])], 2, 2, (1, 2))
    assert scores["accuracy"] == 0.75 and scores["pass_at_2"] == 1.0 and scores["maj_at_1"] == 0.5
    rates = tool_use_rates({"trajectories": 4, "tool_using": 3, "tool_calls": 3, "tool_errors": 1, "malformed_calls": 1, "turns": 7})
    assert rates == {"tool_use_rate": 0.75, "tool_error_rate": 0.5, "tool_success_rate": 0.5, "turns_mean": 1.75}
    assert tool_use_rates({"trajectories": 2, "turns": 2})["tool_success_rate"] is None


def test_held_out_eval_through_the_environment_scores_the_trajectories_it_played():
    engine, tok = tiny_engine()
    cfg = calculator_config(rollout={"max_new_tokens": 6}, eval={"samples_per_prompt": 2, "k": [1, 2]})
    loop = AgentLoop.from_config(cfg, tok, 256)
    try:
        problems = make_arithmetic(0, 0, 6, 3, ["*"]).eval
        greedy = held_out_agent_scores(loop, engine, problems, batch_size=4)
        again = held_out_agent_scores(loop, engine, problems, batch_size=3)
        assert greedy == again  # greedy, and seeded per prompt: chunking changes nothing
        sampled = held_out_agent_scores(loop, engine, problems, batch_size=4, samples=2, seed=0, ks=(1, 2))
        assert {"accuracy", "pass_at_2", "maj_at_2", "tool_use_rate", "tool_success_rate", "turns_mean"} <= set(sampled)
        assert sampled["turns_mean"] >= 1.0 and 0.0 <= sampled["tool_use_rate"] <= 1.0
    finally:
        loop.close()


def test_the_end_of_run_table_shows_tool_use_before_and_after():
    before = {"accuracy": 0.0, "tool_use_rate": 0.0, "tool_success_rate": None, "sampled_tool_use_rate": 0.35, "sampled_tool_success_rate": 0.7}
    after = {"accuracy": 0.8, "tool_use_rate": 1.0, "tool_success_rate": 0.95, "sampled_tool_use_rate": 0.97, "sampled_tool_success_rate": 0.93}
    summary = agent_before_after(before, after)
    assert summary["tool_use_rate_before"] == 0.0 and summary["sampled_tool_success_rate_after"] == 0.93
    lines = agent_lines(summary)
    assert "calls the tool 0.0% -> 100.0%, calls that work n/a -> 95.0%  (greedy, held out)" in lines[0]
    assert "35.0% -> 97.0%" in lines[1] and "70.0% -> 93.0%" in lines[1]
    assert agent_lines(agent_before_after({"accuracy": 0.1}, {"accuracy": 0.2})) == []


def test_the_table_shows_how_the_trajectories_changed_over_training():
    keys = ("agent_turns_mean", "agent_tool_calls_mean", "agent_tool_error_rate", "agent_env_seconds", "agent_masked_token_fraction")
    history = [dict(zip(keys, (1.0 + i / 10, i / 20, 0.5 - i / 40, 0.1, 0.4)), agent_trajectory_length_p90=100 + i) for i in range(20)]
    summary = agent_training(history)
    assert summary["agent_turns"] == pytest.approx((1.05, 2.85)) and summary["agent_trajectory_length_p90_max"] == 119
    line = agent_lines(summary)[0]
    assert "turns 1.05 -> 2.85" in line and "tool errors 48.8% -> 3.8%" in line and "40.0% of tokens inserted" in line
    assert agent_training([{"samples": 8}]) == {}

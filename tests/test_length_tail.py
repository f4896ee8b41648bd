"""model.warm_start.length_tail: the tiny model's warm-start answers follow a scratch pad of heavy-tailed
length, so its responses are long-tailed (the long-response benchmark of `tidal bench modes`)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics

import numpy as np
import pytest
import torch

from tests.test_tool_traces import calculator_config, sampled_text
from tidal.config import ConfigError, TinyModelConfig, config_from_dict
from tidal.data import Problem
from tidal.demo.length_tail import PAD, ScratchPads, scratch_length, with_scratch
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.demo.tool_traces import make_traces, play_trace
from tidal.demo.warm_start import answer_batcher, supervised_warm_start, warm_start_key
from tidal.rewards.builtin import exact_match, format_reward
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import GroupRequest, HFEngine


def test_pad_lengths_are_log_normal_with_the_median_and_tail_asked_for_and_repeat_per_example():
    lengths = [scratch_length(20, 10.0, seed=3, example=n) for n in range(4000)]
    ordered = sorted(lengths)
    p50, p99 = ordered[2000], ordered[3960]
    assert 18 <= p50 <= 22 and 7 <= p99 / p50 <= 14  # a log-normal's quantiles, drawn 4000 times
    assert statistics.mean(lengths) == pytest.approx(20 * math.exp((math.log(10) / 2.3263) ** 2 / 2), rel=0.1)
    assert min(lengths) >= 1 and [scratch_length(20, 10.0, 3, n) for n in range(50)] == lengths[:50]
    assert [scratch_length(20, 10.0, 4, n) for n in range(50)] != lengths[:50]


def test_a_pad_is_cut_to_leave_its_answer_room_in_one_turn_and_the_cuts_are_reported(caplog):
    pads = ScratchPads(p50_tokens=50, p99_over_p50=10.0, seed=0, max_new_tokens=40)
    texts = [pads.pad(n, "A: 12", 5) for n in range(200)]
    assert all(len(t) + 1 <= 40 for t in texts)  # pad, newline, answer and the end-of-sequence token
    assert all(t.endswith("\nA: 12") and set(t[: -len("\nA: 12")]) == {"."} for t in texts)
    assert pads.cut == sum(scratch_length(50, 10.0, 0, n) > 33 for n in range(200)) > 2
    with caplog.at_level(logging.WARNING, logger="tidal.demo.length_tail"):
        pads.report()
    assert "cut to fit rollout.max_new_tokens (40)" in caplog.text


def test_the_reward_reads_the_answer_after_the_pad():
    padded = with_scratch("A: 130340", 17)
    assert padded.startswith("." * 17 + "\n")
    assert exact_match(padded, "130340") == 1.0 and format_reward(padded, "130340") == 1.0
    assert with_scratch("A: 7", 0) == "A: 7"


def test_single_answers_are_taught_with_their_pads():
    tok = build_char_tokenizer()
    problems = [Problem(i, f"{i}+1=", str(i + 1)) for i in range(8)]
    pads = ScratchPads(6, 10.0, seed=1, max_new_tokens=64)
    (ids, mask, labels), *_ = answer_batcher(tok, problems, pads=pads)([2, 5])
    for row, n in enumerate([2, 5]):
        taught = tok.decode([t for t in labels[row].tolist() if t != -100])
        assert taught == with_scratch(f"A: {n + 1}", pads.lengths[n]) + "<eos>"


def test_a_tool_trace_pads_its_first_turn_and_the_tool_still_answers_the_call():
    cfg = calculator_config(rollout={"max_new_tokens": 160})
    loop = AgentLoop.from_config(cfg, build_char_tokenizer())
    try:
        problem = Problem(0, "931*140=", "130340")
        pads = ScratchPads(30, 10.0, seed=0, max_new_tokens=160)
        trace = play_trace(loop, problem, "tool", random.Random(0), pad=lambda text, tokens: pads.pad(0, text, tokens))
        call = '<tool_call>{"name":"calc","arguments":{"expression":"931*140"}}</tool_call>'
        assert sampled_text(loop, trace) == [with_scratch(call, pads.lengths[0]) + "<eos>", "A: 130340<eos>"]
        assert pads.lengths[0] == scratch_length(30, 10.0, 0, 0)
        unpadded = make_traces(loop, [problem] * 4, 1.0, 0.0, seed=0)
        padded = make_traces(loop, [problem] * 4, 1.0, 0.0, seed=0, pads=ScratchPads(30, 10.0, 0, 160))
        for plain, long in zip(unpadded, padded, strict=True):  # the same mix of traces, only the first turns longer
            assert plain.kind == long.kind and sampled_text(loop, long)[0].endswith(sampled_text(loop, plain)[0])
    finally:
        loop.close()


def test_the_warm_start_key_moves_with_the_tail_and_only_then_with_max_new_tokens():
    base = calculator_config()
    longer = calculator_config(rollout={"max_new_tokens": 200})
    tail = calculator_config(model={"warm_start": {"length_tail": {"p50_tokens": 16}}})
    tail_longer = calculator_config(model={"warm_start": {"length_tail": {"p50_tokens": 16}}}, rollout={"max_new_tokens": 200})
    assert warm_start_key(base) == warm_start_key(longer)  # unset: the warm starts cached before the tail keep their keys
    assert len({warm_start_key(base), warm_start_key(tail), warm_start_key(tail_longer)}) == 3


def test_the_tiny_vision_model_refuses_a_length_tail_in_one_line():
    with pytest.raises(ConfigError, match="length_tail pads the tiny text model's answers"):
        config_from_dict(
            {
                "data": {"task": "count_squares"},
                "model": {"tiny": {"arch": "qwen2_vl"}, "warm_start": {"length_tail": {"p50_tokens": 8}}},
            }
        )


def test_a_model_warm_started_with_pads_samples_responses_as_long_tailed_as_it_was_taught():
    """The job the tail exists for: 150 SFT steps of a small model, then 256 sampled responses whose pads
    have the taught median and a long tail (p90 several times the median), each still ending in an answer."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    problems = [Problem(i, f"{i % 90 + 10}+{i % 7}=", str(i % 90 + 10 + i % 7)) for i in range(2000)]
    median = 8
    pads = ScratchPads(median, 10.0, seed=0, max_new_tokens=96)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: a second thread only contends with the suite's other processes
    try:
        supervised_warm_start(model, answer_batcher(tok, problems, pads=pads), len(problems), 150, 32, 3e-3, 0)
        engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, 96, temperature=1.0)
        prompt = tok("37+4=", add_special_tokens=False).input_ids
        (completions,) = asyncio.run(engine.complete([GroupRequest(prompt, 256, torch.Generator().manual_seed(1))]))
    finally:
        torch.set_num_threads(threads)
    texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    sampled = np.array([len(t) - len(t.lstrip(PAD)) for t in texts])
    p50, p90 = np.percentile(sampled, [50, 90])
    assert median / 2 <= p50 <= 2 * median and p90 >= 2 * p50 and sampled.max() >= 4 * p50, (p50, p90, sampled.max())
    assert np.mean([t.lstrip(PAD).startswith("\nA:") for t in texts]) >= 0.8  # the answer line follows the pad

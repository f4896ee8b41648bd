"""Held-out accuracy with greedy decoding, on the HF engine or vLLM (`eval.engine`)."""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.config import TidalConfig
from tidal.data import Problem
from tidal.model.loading import load_model_and_tokenizer, load_tokenizer
from tidal.rewards import exact_match
from tidal.rollout.engine import GroupRequest, HFEngine, RolloutEngine

log = logging.getLogger(__name__)


def held_out_accuracy(engine: RolloutEngine, tokenizer, problems: list[Problem], batch_size: int = 64, max_new_tokens: int | None = None) -> float:
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        requests = [GroupRequest(tokenizer(p.prompt, add_special_tokens=False).input_ids, 1) for p in chunk]
        for p, (sample,) in zip(chunk, engine.generate(requests, greedy=True, max_new_tokens=max_new_tokens)):
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            correct += exact_match(text, p.answer) > 0
    return correct / max(1, len(problems))


def open_engine(cfg: TidalConfig, model_dir: str | Path, kind: str) -> RolloutEngine:
    """A standalone engine over `model_dir` (its own model copy): "hf" or "vllm"."""
    if kind == "vllm":
        from tidal.rollout.vllm_adapter import BlockingVLLMEngine

        return BlockingVLLMEngine(cfg, model_dir)
    model, tokenizer = load_model_and_tokenizer(model_dir, cfg.model.dtype)
    return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.rollout.max_new_tokens, cfg.rollout.temperature)


def eval_engine_kind(cfg: TidalConfig) -> str:
    return cfg.rollout.engine if cfg.eval.engine == "rollout" else cfg.eval.engine


def evaluate_snapshot(cfg: TidalConfig, model_dir: str | Path, problems: list[Problem], snapshot: str | Path | None = None, engine: RolloutEngine | None = None) -> float:
    """Greedy held-out accuracy of `snapshot` (a weight-store version directory; None: the base model).
    Without `engine`, one is opened for the call and shut down after (a vLLM engine must not sit
    on the accelerator the rollout workers need)."""
    own = engine is None
    engine = engine or open_engine(cfg, model_dir, eval_engine_kind(cfg))
    log.info("held-out eval of %s on %d prompts with the %s engine", snapshot or model_dir, len(problems), type(engine).__name__)
    try:
        if snapshot is not None:
            engine.load_snapshot(snapshot)
        return held_out_accuracy(engine, load_tokenizer(model_dir), problems, cfg.eval.batch_size, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
    finally:
        if own:
            engine.shutdown()

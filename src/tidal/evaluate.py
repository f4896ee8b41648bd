"""Held-out accuracy with greedy decoding."""

from __future__ import annotations

from tidal.data import Problem
from tidal.rewards import exact_match
from tidal.rollout.engine import GroupRequest, HFEngine


def held_out_accuracy(engine: HFEngine, tokenizer, problems: list[Problem], batch_size: int = 64) -> float:
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        requests = [GroupRequest(tokenizer(p.prompt, add_special_tokens=False).input_ids, 1) for p in chunk]
        for p, (sample,) in zip(chunk, engine.generate(requests, greedy=True)):
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            correct += exact_match(text, p.answer) > 0
    return correct / max(1, len(problems))

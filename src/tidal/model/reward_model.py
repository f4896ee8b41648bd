"""The built-in tiny reward model (reward.functions `serve: {}` without a model): the tiny model's
architecture with a one-logit classification head, started from the run's warm start and trained to
tell correct final answers of the arithmetic task from wrong ones. Cached by everything it depends
on and built once (atomic rename), like the warm start."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path

import torch

from tidal.config import TidalConfig
from tidal.data import Problem, arithmetic_completion, load_dataset, prompt_encoder

log = logging.getLogger(__name__)

STEPS = 800
BATCH_SIZE = 64
LR = 1e-3


def reward_model_key(cfg: TidalConfig, base_model: str | Path) -> str:
    spec = {
        "format": 3,
        "base": Path(base_model).name,  # the warm start's own key
        "data": cfg.data.model_dump(mode="json", exclude={"num_eval", "eval_path"}),
        "training": [STEPS, BATCH_SIZE, LR],
        "seed": cfg.seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def wrong_answers(answer: int, rng: random.Random) -> str:
    """A near miss, as a model that can almost add gets it wrong: off by a little, off by ten, a
    digit dropped or repeated, the digits swapped."""
    text = str(answer)
    kind = rng.randrange(5)
    if kind == 0:
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
    elif kind == 1:
        wrong = answer + rng.choice([-20, -10, 10, 20])
    elif kind == 2 and len(text.lstrip("-")) > 1:
        wrong = int(text[:-1] or 0)
    elif kind == 3:
        wrong = int(text + text[-1])
    else:
        wrong = int(text[::-1].rstrip("-") or 0) if text[::-1] != text else answer + 1
    return str(wrong if wrong != answer else answer + 1)


def labelled_examples(problems: list[Problem], rng: random.Random, pool: list[Problem] | None = None) -> list[tuple[str, str, float]]:
    """(problem, completion, label): each problem once right and once wrong: a near miss, the answer of
    another problem of `pool` (so that the model must read the problem, not judge the answer's look
    alone), a line without "A:", or an unfinished one."""
    pool = pool or problems
    out = []
    for p in problems:
        out.append((p.prompt, arithmetic_completion(p.answer), 1.0))
        kind = rng.random()
        if kind < 0.45:
            wrong = arithmetic_completion(wrong_answers(int(p.answer), rng))
        elif kind < 0.85:
            other = rng.choice(pool).answer
            wrong = arithmetic_completion(other if other != p.answer else wrong_answers(int(p.answer), rng))
        elif kind < 0.93:
            wrong = p.answer  # no "A:" line
        else:
            wrong = "A:"
        out.append((p.prompt, wrong, 0.0))
    return out


def batch_tensors(tokenizer, encode, rows: list[tuple[str, str, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the reward server tokenizes: the prompt as the policy saw it, decoded, then the completion."""
    texts = [tokenizer.decode(encode(prompt), skip_special_tokens=False) + completion for prompt, completion, _ in rows]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask, torch.tensor([label for _, _, label in rows])


def ranking_accuracy(model, tokenizer, encode, rows) -> float:
    """The share of problems whose right answer scores above its wrong one (rows in pairs)."""
    ids, mask, _ = batch_tensors(tokenizer, encode, rows)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    return float((logits[0::2] > logits[1::2]).float().mean())


def pair_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry on each (right, wrong) pair of one problem (what RL needs: the right answer
    ranked above the wrong ones of its group), plus the labels' cross-entropy (a score near 0 or 1)."""
    ranking = -torch.nn.functional.logsigmoid(logits[0::2] - logits[1::2]).mean()
    return ranking + torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def train_reward_model(cfg: TidalConfig, base_model: str | Path, problems: list[Problem], held_out: list[Problem], seed: int):
    """The classifier, trained from the warm start's weights (its head new); returns it with its
    held-out ranking accuracy (right above wrong)."""

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rows of a dozen tokens: more threads only wait on each other
    try:
        return _train(cfg, base_model, problems, held_out, seed)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TidalConfig, base_model: str | Path, problems: list[Problem], held_out: list[Problem], seed: int):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    encode = prompt_encoder(tokenizer, cfg.data)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / STEPS))
    model.train()
    for step in range(1, STEPS + 1):
        rows = labelled_examples(rng.sample(problems, BATCH_SIZE // 2), rng, problems)
        ids, mask, labels = batch_tensors(tokenizer, encode, rows)
        loss = pair_loss(model(input_ids=ids, attention_mask=mask).logits[:, 0], labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            log.info("reward model step %d: loss %.3f", step, loss.item())
    model.eval()
    held = ranking_accuracy(model, tokenizer, encode, labelled_examples(held_out, random.Random(seed + 1)))
    return model, tokenizer, held


def prepare_reward_model(cfg: TidalConfig, base_model: str | Path) -> Path:
    """The cached built-in reward model for this run's task and warm start, built on first use."""
    from tidal.model.warm_start import cache_root, save_to_cache

    if cfg.model.name_or_path or cfg.data.task != "arithmetic":
        raise ValueError(
            "reward.functions[].serve.model is unset: the built-in reward model is for the tiny model on data.task 'arithmetic'; "
            "give serve.model (a sequence-classification model directory)"
        )
    target = cache_root(cfg) / "reward-model" / reward_model_key(cfg, base_model)
    if (target / "config.json").is_file():
        return target
    dataset = load_dataset(cfg.data, cfg.seed)
    t0 = time.time()
    model, tokenizer, held = train_reward_model(cfg, base_model, dataset.train, dataset.eval[:500], cfg.seed)
    log.info(
        "built-in reward model: %d steps in %.1fs, held-out: the right answer above the wrong one for %.3f of problems", STEPS, time.time() - t0, held
    )
    return save_to_cache(model, tokenizer, target, {"tidal_reward_model.json": json.dumps({"held_out_ranking_accuracy": held, "steps": STEPS})})

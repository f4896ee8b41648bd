"""Prompt datasets: synthetic arithmetic and square counting (deterministic from the seed) and JSONL files."""

from __future__ import annotations

import json
import logging
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tidal.config import DataConfig
from tidal.images import IMAGE_PLACEHOLDER, ImageError, row_images

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    id: int
    prompt: str
    answer: str  # the final answer as a string, e.g. "936"
    origin: str = ""  # where it was read, "FILE:LINE" (for errors); "" for a generated problem
    images: tuple[bytes, ...] = ()  # the prompt's images, encoded image files (tidal.images), in prompt order


@dataclass(frozen=True)
class Dataset:
    train: list[Problem]
    eval: list[Problem]


ARITHMETIC_OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_prompt(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}="


def arithmetic_completion(answer: int | str) -> str:
    """The target completion: one final-answer line."""
    return f"A: {answer}"


def make_arithmetic(seed: int, num_train: int, num_eval: int, max_digits: int, operations: list[str]) -> Dataset:
    """Unique problems from `seed`; the held-out split shares none with the train split."""
    rng = random.Random(f"tidal-arithmetic-{seed}")
    limit = 10**max_digits
    total = num_train + num_eval
    if total > (limit**2) * len(operations) * 3 // 4:  # keep rejection sampling of duplicates cheap
        raise DatasetError(f"data.max_digits={max_digits} is too small for {total} distinct problems")
    seen: set[tuple[int, str, int]] = set()
    problems: list[Problem] = []
    while len(problems) < total:
        a, b, op = rng.randrange(limit), rng.randrange(limit), rng.choice(operations)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        value = ARITHMETIC_OPERATIONS[op](a, b)
        problems.append(Problem(len(problems), arithmetic_prompt(a, op, b), str(value)))
    return Dataset(train=problems[:num_train], eval=[Problem(i, p.prompt, p.answer) for i, p in enumerate(problems[num_train:])])


_GSM8K_ANSWER = re.compile(r"####\s*(.+)\s*$")


def _answer_from_row(answer: str) -> str:
    match = _GSM8K_ANSWER.search(answer)
    return (match.group(1) if match else answer).strip().replace(",", "")


def _is_utf8(line: str) -> bool:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # surrogateescape kept the undecodable bytes as lone surrogates
        return False
    return True


def read_jsonl_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """Rows need `question` (or `prompt`) and `answer`; GSM8K's `#### 42` answers are understood. A row may
    carry `images`: file paths (relative to the file) or {"bytes": base64} entries, read and checked here."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    problems: list[Problem] = []
    with p.open(encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if not line.isascii() and not _is_utf8(line):
                raise DatasetError(f"{p}:{lineno}: not UTF-8 text")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{p}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{p}:{lineno}: a row must be a JSON object")
            question = row.get("question", row.get("prompt"))
            if not isinstance(question, str) or not isinstance(row.get("answer"), (str, int, float)):
                raise DatasetError(f"{p}:{lineno}: a row needs string fields 'question' and 'answer'")
            try:
                images = row_images(row.get("images"), p.parent, f"{p}:{lineno}")
            except ImageError as err:
                raise DatasetError(str(err)) from None
            problems.append(Problem(len(problems), question.strip() + "\n", _answer_from_row(str(row["answer"])), f"{p}:{lineno}", images))
            if limit is not None and len(problems) >= limit:
                left = sum(1 for rest in fh if rest.strip())
                if left:
                    log.warning("%s: read its first %d rows and left %d more (data.num_train / data.num_eval is %d)", p, limit, left, limit)
                break
    if not problems:
        raise DatasetError(f"{p}: no rows")
    return problems


def make_count_squares(seed: int, num_train: int, num_eval: int, max_count: int, max_distractors: int) -> Dataset:
    """Distinct images from `seed` (tidal.data.count_squares); the held-out split shares none with the train split."""
    from tidal.data.count_squares import COUNT_QUESTION, count_problem_images

    question = COUNT_QUESTION.format(colour="red")
    problems = [
        Problem(i, question, str(count), images=(image,))
        for i, (image, count) in enumerate(count_problem_images(seed, num_train + num_eval, max_count, max_distractors))
    ]
    return Dataset(train=problems[:num_train], eval=[Problem(i, p.prompt, p.answer, images=p.images) for i, p in enumerate(problems[num_train:])])


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    if cfg.task == "arithmetic":
        return make_arithmetic(seed, cfg.num_train, cfg.num_eval, cfg.max_digits, list(cfg.operations))
    if cfg.task == "count_squares":
        return make_count_squares(seed, cfg.num_train, cfg.num_eval, cfg.max_count, cfg.max_distractors)
    train = read_jsonl_problems(cfg.path, cfg.num_train)
    if cfg.eval_path:
        return Dataset(train, read_jsonl_problems(cfg.eval_path, cfg.num_eval))
    split = max(1, len(train) // 10)
    held = [Problem(i, p.prompt, p.answer, p.origin, p.images) for i, p in enumerate(train[-split:])]
    return Dataset(train[:-split], held[: cfg.num_eval])


def iteration_prompt_order(dataset: Dataset, seed: int, iteration: int) -> list[Problem]:
    """The iteration's prompts in order: the first `prompts_per_iteration` are the batch, the rest
    replace groups dropped by dynamic sampling. A function of (seed, iteration) alone."""
    order = list(range(len(dataset.train)))
    random.Random(f"tidal-prompts-{seed}-{iteration}").shuffle(order)
    return [dataset.train[i] for i in order]


def prompts_for_iteration(dataset: Dataset, seed: int, iteration: int, count: int) -> list[Problem]:
    return iteration_prompt_order(dataset, seed, iteration)[:count]


def render_prompt(text: str, cfg: DataConfig, images: int = 0) -> str | list[dict]:
    """The problem's text as the model will see it: a string, or chat messages for a chat template. With
    `images`, one image placeholder each before the text (an image part of the user message under a template)."""
    body = cfg.prompt_template.format(prompt=text)
    if not cfg.chat_template:
        return IMAGE_PLACEHOLDER * images + body
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt is not None else []
    content = [{"type": "image"}] * images + [{"type": "text", "text": body.strip()}] if images else body.strip()
    return system + [{"role": "user", "content": content}]


def prompt_encoder(tokenizer, cfg: DataConfig | None = None) -> Callable[[str], list[int]]:
    """Problem text -> prompt token ids, the same in workers, sync mode, eval and warm start.
    Without `cfg`: the plain text, tokenized."""
    cfg = DataConfig() if cfg is None else cfg
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"data.chat_template is true but the tokenizer ({getattr(tokenizer, 'name_or_path', '?') or 'built-in'}) has no chat template; "
            "use an instruct model's tokenizer, or set data.chat_template: false"
        )

    def encode(text: str, images: int = 0) -> list[int]:
        rendered = render_prompt(text, cfg, images)
        if isinstance(rendered, str):
            return tokenizer(rendered, add_special_tokens=False).input_ids
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    return encode

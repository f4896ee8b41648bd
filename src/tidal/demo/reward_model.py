"""The built-in tiny reward model (reward.functions `serve: {}` without a model): the tiny model's
architecture with a one-logit classification head, started from the run's warm start and trained to
tell correct final answers of the arithmetic task from wrong ones: the warm start's own samples of the
training prompts (the mistakes RL starts from), labelled by exact match, and synthetic near misses.
Cached by everything it depends on and built once (atomic rename), like the warm start."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.config import TidalConfig
from tidal.data import Problem, arithmetic_completion, load_dataset, prompt_encoder
from tidal.rewards import exact_match

log = logging.getLogger(__name__)

# first the body learns the task: the warm start fine-tuned further on the training answers (the
# labelled data the reward model is built from), so that the classifier judges an answer with a model
# that can mostly compute it (over the warm start's own body, the classifier ranked only two thirds
# of the policy's (right, wrong) pairs right)
SFT_STEPS = 1000
SFT_LR = 3e-3
# then the classifier: the body and a new one-logit head, trained with the body's LM loss on the right
# answers beside the classifier's (LM_COEF): alone, the classifier's loss sat near chance for a
# seed-dependent 500 to over 1500 steps while the body forgot how to compute the answers
BATCH_SIZE = 64
LR = 1e-3
LM_COEF = 1.0
# trained until it has learned: every CHECK_EVERY steps its accuracy on the policy's (right, wrong) pairs
# of CHECK_PROBLEMS training problems held aside from its training; it stops at TARGET_ACCURACY. At
# MAX_STEPS without it, the best check's weights are kept if they reach MIN_ACCURACY (a weaker body's
# ceiling can lie below the target), else the build fails rather than serve a model that cannot tell
# right from wrong
CHECK_EVERY = 250
CHECK_PROBLEMS = 300
TARGET_ACCURACY = 0.9
MIN_ACCURACY = 0.85
MAX_STEPS = 3000
# the warm start's samples the reward model learns from: every training prompt, this many samples at
# each temperature (the policy's mistakes at RL's temperature and around it)
POLICY_TEMPERATURES = (0.7, 1.0, 1.3)
POLICY_SAMPLES = 8
POLICY_SHARE = 0.5  # of each batch's pairs; the rest synthetic (labelled_examples)


def reward_model_key(cfg: TidalConfig, base_model: str | Path) -> str:
    spec = {
        "format": 8,
        "base": Path(base_model).name,  # the warm start's own key
        "data": cfg.data.model_dump(mode="json", exclude={"num_eval", "eval_path"}),
        "training": [SFT_STEPS, SFT_LR, BATCH_SIZE, LR, LM_COEF, CHECK_EVERY, CHECK_PROBLEMS, TARGET_ACCURACY, MIN_ACCURACY, MAX_STEPS],
        "samples": [POLICY_TEMPERATURES, POLICY_SAMPLES, POLICY_SHARE],
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": cfg.seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def wrong_answers(answer: int, rng: random.Random) -> str:
    """A near miss, as a model that can almost add gets it wrong: off by a little, off by ten, one
    digit replaced (a carry lost or added), a digit dropped or repeated, the digits swapped."""
    text = str(answer)
    kind = rng.randrange(6)
    if kind == 0:
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
    elif kind == 1:
        wrong = answer + rng.choice([-20, -10, 10, 20])
    elif kind == 2:
        digits = text.lstrip("-")
        at = rng.randrange(len(digits))
        digit = rng.choice([d for d in "0123456789" if d != digits[at] and (at or len(digits) == 1 or d != "0")])
        wrong = int(text[: len(text) - len(digits)] + digits[:at] + digit + digits[at + 1 :])
    elif kind == 3 and len(text.lstrip("-")) > 1:
        wrong = int(text[:-1] or 0)
    elif kind == 4:
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


@dataclass(frozen=True)
class PolicySamples:
    """One problem's samples from the policy, split by exact match (repeats kept: a frequent
    mistake is drawn as often as the policy makes it)."""

    problem: Problem
    right: list[str]
    wrong: list[str]


def policy_samples(model, tokenizer, encode, problems: list[Problem], temperatures, n: int, max_new_tokens: int, seed: int) -> list[PolicySamples]:
    """`n` samples of each problem from `model` at each temperature (the HF engine, as RL samples),
    labelled by exact match with the true answer."""
    from tidal.rollout.engine import GroupRequest, HFEngine

    texts: dict[int, list[str]] = {p.id: [] for p in problems}
    for t_index, temperature in enumerate(temperatures):
        engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_new_tokens, temperature)
        for start in range(0, len(problems), 256):
            chunk = problems[start : start + 256]
            requests = [GroupRequest(encode(p.prompt), n, torch.Generator().manual_seed(seed * 1_000_003 + t_index * 100_003 + p.id)) for p in chunk]
            for p, group in zip(chunk, engine.generate(requests)):
                texts[p.id] += [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
    out = []
    for p in problems:
        marks = [exact_match(t, p.answer) > 0 for t in texts[p.id]]
        out.append(PolicySamples(p, [t for t, ok in zip(texts[p.id], marks) if ok], [t for t, ok in zip(texts[p.id], marks) if not ok]))
    return out


def policy_pairs(samples: list[PolicySamples], rng: random.Random) -> list[tuple[str, str, float]]:
    """(problem, completion, label) rows in (right, wrong) pairs, one per problem: one of the
    policy's wrong answers against one of its right ones (the true answer when it had none)."""
    out = []
    for s in samples:
        right = rng.choice(s.right) if s.right and rng.random() < 0.5 else arithmetic_completion(s.problem.answer)
        out.append((s.problem.prompt, right, 1.0))
        out.append((s.problem.prompt, rng.choice(s.wrong), 0.0))
    return out


def group_ranking_accuracy(model, tokenizer, encode, samples: list[PolicySamples]) -> float:
    """Of the (right, wrong) pairs within each problem's policy samples, the share the model ranks
    right first: what a group-relative advantage needs of a reward."""
    rows = [(s.problem.prompt, t, 0.0) for s in samples for t in s.right + s.wrong]
    return pair_accuracy(samples, score_rows(model, tokenizer, encode, rows))


def pair_accuracy(samples: list[PolicySamples], scores: list[float]) -> float:
    """`scores` in the order of each problem's right then wrong samples: the share of (right, wrong)
    pairs of one problem where right scores higher."""
    good = total = start = 0
    for s in samples:
        right = scores[start : start + len(s.right)]
        wrong = scores[start + len(s.right) : start + len(s.right) + len(s.wrong)]
        start += len(s.right) + len(s.wrong)
        good += sum(r > w for r in right for w in wrong)
        total += len(right) * len(wrong)
    return good / max(1, total)


def score_rows(model, tokenizer, encode, rows, batch: int = 256) -> list[float]:
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            ids, mask, _ = batch_tensors(tokenizer, encode, rows[start : start + batch])
            scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
    return scores


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


@dataclass(frozen=True)
class Trained:
    """How the classifier's training ended: the steps of the check it kept and that check's accuracy."""

    steps: int
    accuracy: float


def train_until(
    step: Callable[[int], None],
    check: Callable[[], float],
    every: int,
    max_steps: int,
    target: float,
    floor: float,
    keep: Callable[[], None] = lambda: None,
    restore: Callable[[], None] = lambda: None,
) -> Trained:
    """Runs `step(n)` for n = 1, 2, ... and `check()` every `every` steps, until a check reaches
    `target`. At `max_steps` without it: `restore()` goes back to the best check (each new best is
    `keep()`-ed), if that reached `floor`; else it raises ValueError."""
    best = Trained(0, float("-inf"))
    for n in range(1, max_steps + 1):
        step(n)
        if n % every == 0 or n == max_steps:
            accuracy = check()
            log.info("reward model step %d: %.3f of the held-aside training pairs ranked right", n, accuracy)
            if accuracy >= target:
                return Trained(n, accuracy)
            if accuracy > best.accuracy:
                best = Trained(n, accuracy)
                keep()
    if best.accuracy < floor:
        raise ValueError(  # tidal's one-line error
            f"the built-in reward model did not learn: in {max_steps} steps it ranked at best {best.accuracy:.3f} of its held-aside "
            f"training problems' (right, wrong) pairs right, under the {floor} it needs; give reward.functions[].serve.model instead"
        )
    log.warning(
        "reward model: %.3f of the held-aside training pairs at best (step %d), under the %s aimed at; serving that state",
        best.accuracy,
        best.steps,
        target,
    )
    restore()
    return best


def train_reward_model(cfg: TidalConfig, base_model: str | Path, problems: list[Problem], held_out: list[Problem], seed: int):
    """The classifier, trained from the warm start's weights (its head new); returns it, its tokenizer,
    how its training ended, and its held-out ranking accuracies: right above a synthetic wrong answer
    (per problem), and above the warm start's wrong samples (per pair within a problem's samples)."""

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rows of a dozen tokens: more threads only wait on each other
    try:
        return _train(cfg, base_model, problems, held_out, seed)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TidalConfig, base_model: str | Path, problems: list[Problem], held_out: list[Problem], seed: int):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from tidal.demo.warm_start import answer_batcher, batch_loss, supervised_warm_start

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    encode = prompt_encoder(tokenizer, cfg.data)
    policy = AutoModelForCausalLM.from_pretrained(base_model)
    t0 = time.time()
    mistakes = [
        s
        for s in policy_samples(policy, tokenizer, encode, problems, POLICY_TEMPERATURES, POLICY_SAMPLES, cfg.rollout.max_new_tokens, seed)
        if s.wrong
    ]
    held_samples = [
        s
        for s in policy_samples(policy, tokenizer, encode, held_out, POLICY_TEMPERATURES, POLICY_SAMPLES, cfg.rollout.max_new_tokens, seed + 1)
        if s.right and s.wrong
    ]
    log.info("reward model: the warm start's samples in %.1fs, %d of %d problems with a wrong one", time.time() - t0, len(mistakes), len(problems))
    t0 = time.time()
    sft = supervised_warm_start(policy, answer_batcher(tokenizer, problems, encode), len(problems), SFT_STEPS, BATCH_SIZE, SFT_LR, seed)
    log.info("reward model: its body fine-tuned on the answers, %d steps in %.1fs (loss %.3f)", sft.steps, time.time() - t0, sft.loss)

    # the training problems split: CHECK_PROBLEMS of those with a mistake are held aside for the checks
    rng = random.Random(seed)
    mistakes = rng.sample(mistakes, len(mistakes))
    aside = [s for s in mistakes[:CHECK_PROBLEMS] if s.right]
    aside_ids = {s.problem.id for s in mistakes[:CHECK_PROBLEMS]}
    mistakes = mistakes[CHECK_PROBLEMS:]
    train = [p for p in problems if p.id not in aside_ids]

    # the classifier shares the body with the language model: one set of weights, two losses
    model = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1)
    setattr(model, model.base_model_prefix, getattr(policy, policy.base_model_prefix))
    model.config.pad_token_id = tokenizer.pad_token_id
    answers = answer_batcher(tokenizer, train, encode)
    lm_rows = torch.Generator().manual_seed(seed)
    policy_count = round(BATCH_SIZE // 2 * POLICY_SHARE) if mistakes else 0
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))

    def step(_: int) -> None:
        model.train()
        rows = policy_pairs(rng.sample(mistakes, policy_count), rng) + labelled_examples(
            rng.sample(train, BATCH_SIZE // 2 - policy_count), rng, train
        )
        ids, mask, labels = batch_tensors(tokenizer, encode, rows)
        loss = pair_loss(model(input_ids=ids, attention_mask=mask).logits[:, 0], labels)
        loss = loss + LM_COEF * batch_loss(policy, answers(torch.randint(len(train), (BATCH_SIZE // 2,), generator=lm_rows).tolist()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    def check() -> float:
        model.eval()
        return group_ranking_accuracy(model, tokenizer, encode, aside)

    t0 = time.time()
    kept: dict[str, torch.Tensor] = {}
    trained = train_until(
        step,
        check,
        CHECK_EVERY,
        MAX_STEPS,
        TARGET_ACCURACY,
        MIN_ACCURACY,
        keep=lambda: kept.update({k: v.detach().clone() for k, v in model.state_dict().items()}),
        restore=lambda: model.load_state_dict(kept),
    )
    log.info("reward model: its classifier trained in %.1fs, kept as it was at step %d", time.time() - t0, trained.steps)
    model.eval()
    held = ranking_accuracy(model, tokenizer, encode, labelled_examples(held_out, random.Random(seed + 1)))
    return model, tokenizer, trained, held, group_ranking_accuracy(model, tokenizer, encode, held_samples)


def prepare_reward_model(cfg: TidalConfig, base_model: str | Path) -> Path:
    """The cached built-in reward model for this run's task and warm start, built on first use."""
    from tidal.demo.warm_start import cache_root, save_to_cache

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
    model, tokenizer, trained, held, held_policy = train_reward_model(cfg, base_model, dataset.train, dataset.eval[:500], cfg.seed)
    log.info(
        "built-in reward model in %.1fs (its classifier as at step %d, %.3f of the held-aside training pairs), held-out: the right answer "
        "above a synthetic wrong one for %.3f of problems, above the warm start's wrong samples for %.3f of its (right, wrong) pairs",
        time.time() - t0,
        trained.steps,
        trained.accuracy,
        held,
        held_policy,
    )
    info = {
        "held_out_ranking_accuracy": held,
        "held_out_policy_pair_accuracy": held_policy,
        "steps": trained.steps,
        "held_aside_training_pair_accuracy": trained.accuracy,
        "seconds": round(time.time() - t0, 1),
    }
    return save_to_cache(model, tokenizer, target, {"tidal_reward_model.json": json.dumps(info)})

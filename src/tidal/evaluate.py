"""Held-out accuracy with greedy decoding, on the HF engine or vLLM (`eval.engine`)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tidal.blocking import run_blocking
from tidal.config import TidalConfig
from tidal.data import Problem, prompt_encoder
from tidal.model.loading import load_model, load_tokenizer
from tidal.protocol import tool_use_rates
from tidal.rewards import exact_match, extract_final_answer
from tidal.rollout.engine import BlockingEngine, GroupRequest, HFEngine, group_generator, group_seed
from tidal.rundir import RunDir

log = logging.getLogger(__name__)


EVAL_ITERATION = 10**9  # seeds eval samples apart from any training iteration's


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021): the probability that at least one of k samples drawn without
    replacement from n (c of them correct) is correct, 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: list[str | None], gold: str) -> bool:
    """maj@k: the most frequent extracted answer (ties: the one seen first; no answer never wins) is correct."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return False
    best = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == best)
    return exact_match(f"A: {winner}", gold) > 0


def held_out_scores(
    engine: BlockingEngine,
    tokenizer,
    problems: list[Problem],
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    samples: int = 0,
    seed: int = 0,
    encode: Callable[[str], list[int]] | None = None,
    ks: tuple[int, ...] = (),
) -> dict[str, float]:
    """`accuracy`: the fraction correct, greedy (samples 0) or the mean over `samples` samples per
    prompt at the engine's temperature, seeded per prompt so that two snapshots are compared on the
    same noise; with samples, `pass@k` and `maj@k` for each k in `ks`, averaged over prompts.
    `encode` turns a problem's text into prompt ids (data.prompt_template / chat_template); default plain."""
    encode = encode or prompt_encoder(tokenizer)
    n = max(1, samples)

    def answers() -> Iterator[tuple[Problem, list[str]]]:
        for chunk, requests in eval_requests(problems, batch_size, n, seed, encode, getattr(engine, "processor", None)):
            for p, group in zip(chunk, engine.generate(requests, greedy=samples == 0, max_new_tokens=max_new_tokens)):
                yield p, [tokenizer.decode(sample.token_ids, skip_special_tokens=True) for sample in group]

    return answer_scores(answers(), len(problems), n, ks)


def held_out_agent_scores(
    loop, engine: BlockingEngine, problems: list[Problem], batch_size: int = 64, samples: int = 0, seed: int = 0, ks: tuple[int, ...] = ()
) -> dict[str, float]:
    """`held_out_scores` through the run's environment (`loop`: an AgentLoop): each problem's
    trajectories, scored on their final answers, plus how the policy used its tools
    (tidal.protocol.tool_use_rates)."""
    from tidal.rollout.agent import add_stats

    n = max(1, samples)
    totals: dict[str, float] = {}

    def answers() -> Iterator[tuple[Problem, list[str]]]:
        for chunk, requests in eval_requests(problems, batch_size, n, seed, None, getattr(engine, "processor", None)):
            played = run_blocking(loop.play(engine, [loop.framed(p.id, p.prompt, p.answer) for p in chunk], requests, greedy=samples == 0))
            for i, p in enumerate(chunk):
                rows = played[i * n : (i + 1) * n]
                for row, tokens in rows:
                    add_stats(totals, row, tokens.turns)
                yield p, [row.final_text for row, _ in rows]

    return {**answer_scores(answers(), len(problems), n, ks), **tool_use_rates(totals)}


def eval_requests(
    problems: list[Problem], batch_size: int, n: int, seed: int, encode: Callable[[str], list[int]] | None, processor=None
) -> Iterator[tuple[list[Problem], list[GroupRequest]]]:
    """The problems in chunks, each with its requests: n rows per problem, seeded per prompt so that
    two snapshots are compared on the same noise (`encode` None: the prompt is set by the caller). A problem
    with images needs the vision-language model's `processor` (tidal.model.vision)."""

    def request(p: Problem) -> GroupRequest:
        prompt, images = encode(p.prompt) if encode else [], None
        if p.images:
            if processor is None:
                raise ValueError(f"held-out problem {p.id} ({p.origin}) has images: a vision-language model's processor takes them")
            if encode is None:  # the agent loop renders the prompt and widens its image tokens
                images = processor.process_images(list(p.images))
            else:
                prompt, images = processor.encode(encode(p.prompt, len(p.images)), list(p.images))
        seeds = group_generator(seed, EVAL_ITERATION, p.id), group_seed(seed, EVAL_ITERATION, p.id)
        return GroupRequest(prompt, n, *seeds, images, list(p.images) or None)

    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        yield chunk, [request(p) for p in chunk]


def answer_scores(answers: Iterable[tuple[Problem, list[str]]], count: int, n: int, ks: tuple[int, ...]) -> dict[str, float]:
    """accuracy over every answer; pass@k and maj@k per problem, averaged."""
    correct = 0
    passes = {k: 0.0 for k in ks}
    majorities = {k: 0 for k in ks}
    for p, texts in answers:
        right = sum(exact_match(t, p.answer) > 0 for t in texts)
        correct += right
        for k in ks:
            passes[k] += pass_at_k(len(texts), right, k)
            majorities[k] += majority_correct([extract_final_answer(t) for t in texts[:k]], p.answer)
    scores = {"accuracy": correct / max(1, n * count)}
    for k in ks:
        scores[f"pass_at_{k}"] = passes[k] / max(1, count)
        scores[f"maj_at_{k}"] = majorities[k] / max(1, count)
    return scores


def held_out_accuracy(*args, **kwargs) -> float:
    """`held_out_scores(...)["accuracy"]`: the fraction correct, greedy or sampled."""
    return held_out_scores(*args, **kwargs)["accuracy"]


def open_engine(cfg: TidalConfig, model_dir: str | Path, kind: str, tokenizer=None) -> BlockingEngine:
    """A standalone engine over `model_dir` (its own model copy): "hf" or "vllm". `tokenizer`: model_dir's, where
    the caller holds it already (else the HF engine loads it)."""
    if kind == "vllm":
        from tidal.rollout.vllm_adapter import BlockingVLLMEngine

        return BlockingVLLMEngine(cfg, model_dir)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    model = load_model(model_dir, cfg.model.dtype)
    if cfg.model.lora is not None:  # snapshots are adapters on top of model_dir (without one: the base exactly)
        from tidal.model.lora import apply_lora

        model = apply_lora(model, cfg.model.lora, cfg.seed)
    return HFEngine.for_rollout(model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature)


def eval_engine_kind(cfg: TidalConfig) -> str:
    return cfg.rollout.engine if cfg.eval.engine == "rollout" else cfg.eval.engine


def evaluate_snapshot(
    cfg: TidalConfig,
    model_dir: str | Path,
    problems: list[Problem],
    snapshot: str | Path | None = None,
    engine: BlockingEngine | None = None,
    tokenizer=None,
) -> dict:
    """Held-out accuracy of `snapshot` (a weight-store version directory; None: the base model):
    `accuracy` greedy, `sampled_accuracy` at the rollout temperature (what RL optimises; None when
    eval.samples_per_prompt is 0), and `pass@k` / `maj@k` over those samples for each eval.k. Without `engine`, one is opened for the call and shut down after
    (a vLLM engine must not sit on the accelerator the rollout workers need). `tokenizer`: model_dir's, where
    the caller holds it already (else loaded here, once for the call)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    own = engine is None
    engine = engine or open_engine(cfg, model_dir, eval_engine_kind(cfg), tokenizer)
    log.info("held-out eval of %s on %d prompts with the %s engine", snapshot or model_dir, len(problems), type(engine).__name__)
    try:
        if snapshot is not None:
            engine.load_snapshot(snapshot)
        max_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        if cfg.rollout.agent is not None:
            return agent_snapshot_scores(cfg, engine, tokenizer, problems)
        k, encode = cfg.eval.samples_per_prompt, prompt_encoder(tokenizer, cfg.data)
        scores = {
            "accuracy": held_out_accuracy(engine, tokenizer, problems, cfg.eval.batch_size, max_tokens, encode=encode),
            "sampled_accuracy": None,
        }
        if k:
            sampled = held_out_scores(
                engine, tokenizer, problems, max(1, cfg.eval.batch_size // k), max_tokens, k, cfg.seed, encode, tuple(cfg.eval.k)
            )
            scores["sampled_accuracy"] = sampled.pop("accuracy")
            scores.update(sampled)
        return scores
    finally:
        if own:
            engine.shutdown()


def agent_snapshot_scores(cfg: TidalConfig, engine: BlockingEngine, tokenizer, problems: list[Problem]) -> dict:
    """evaluate_snapshot's scores through rollout.agent (turns of rollout.max_new_tokens each), with
    the greedy and the sampled trajectories' tool use (tool_use_rate, tool_success_rate, turns_mean;
    `sampled_` in front for the sampled ones)."""
    from tidal.rollout.agent import AgentLoop

    loop = AgentLoop.from_config(cfg, tokenizer, engine.context_length)
    k = cfg.eval.samples_per_prompt
    try:
        scores: dict = held_out_agent_scores(loop, engine, problems, cfg.eval.batch_size)
        scores["sampled_accuracy"] = None
        if k:
            sampled = held_out_agent_scores(loop, engine, problems, max(1, cfg.eval.batch_size // k), k, cfg.seed, tuple(cfg.eval.k))
            scores["sampled_accuracy"] = sampled.pop("accuracy")
            scores.update({(f"sampled_{key}" if key.startswith(("tool_", "turns_")) else key): v for key, v in sampled.items()})
        return scores
    finally:
        loop.close()


def curve_targets(latest: int, every: int, final: int, done: set[int]) -> list[int]:
    """Versions still to evaluate, newest first: every `every`-th one up to `latest`, and the final one.
    Only the newest pending one is worth evaluating when eval falls behind; older ones are skipped."""
    wanted = [v for v in range(0, latest + 1) if (v % every == 0 or v == final) and v not in done]
    return sorted(wanted, reverse=True)


def follow_run(cfg: TidalConfig, run_dir: Path, base_model: str, problems: list[Problem], log_metrics, poll_seconds: float = 0.5) -> list[dict]:
    """The held-out learning curve, while training continues: evaluates each eval.every-th version
    as soon as the weight store holds it, logs `eval/*` at that version's step, appends eval.jsonl,
    and returns once the final version (trainer.iterations) is evaluated. When evaluation is slower
    than training, it evaluates the newest pending version and skips the ones it fell behind on."""
    import time

    from tidal.weights import WeightStore

    store = WeightStore(RunDir(run_dir).weights)
    final = cfg.trainer.iterations
    evals = RunDir(run_dir).evals
    done = {record["version"] for record in evals.read()}
    tokenizer = load_tokenizer(base_model)  # once: the engine and every version's scoring share it
    engine = open_engine(cfg, base_model, eval_engine_kind(cfg), tokenizer)
    records = []
    try:
        while final not in done:
            latest = store.latest_version()
            pending = curve_targets(latest, cfg.eval.every, final, done) if latest is not None else []
            if not pending:
                time.sleep(poll_seconds)
                continue
            version = pending[0]
            t0 = time.perf_counter()
            try:
                scores = evaluate_snapshot(cfg, base_model, problems, store.path(version), engine=engine, tokenizer=tokenizer)
            except Exception:
                if store.path(version).is_dir():
                    raise
                # weight retention (weights.keep_last) deleted it while this follower fell behind: move on
                log.warning("held-out eval: snapshot v%d was deleted by weight retention before it was evaluated; skipping it", version)
                done.update(pending)
                continue
            record = {"version": version, "seconds": time.perf_counter() - t0, **scores}
            log_metrics({f"eval/{k}": v for k, v in scores.items() if v is not None}, version)
            evals.append(record)
            records.append(record)
            done.update(v for v in pending)  # the skipped ones too: the curve moves on
            log.info("held-out eval of v%d: %s", version, scores)
    finally:
        engine.shutdown()
    return records

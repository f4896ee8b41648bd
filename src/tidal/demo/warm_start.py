"""The built-in tiny model's warm start: a short SFT on the task so RL starts with signal, cached by
everything it depends on and built once (atomic rename, so concurrent roles share one copy)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.config import TidalConfig
from tidal.data import Dataset, Problem, arithmetic_completion, load_dataset, prompt_encoder
from tidal.demo.length_tail import ScratchPads

log = logging.getLogger(__name__)


def cache_root(cfg: TidalConfig) -> Path:
    root = cfg.model.warm_start.cache_dir or os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal"
    return Path(root)


def warm_start_seed(cfg: TidalConfig) -> int:
    """model.warm_start.seed, else the run's: runs of several seeds may share one warm start, so
    that they differ only in RL."""
    ws_seed = cfg.model.warm_start.seed
    return cfg.seed if ws_seed is None else ws_seed


VISION_FIELDS = {"vision_depth", "vision_embed_dim", "vision_heads"}
COUNT_FIELDS = {"max_count", "max_distractors"}


def is_tiny_vlm(cfg: TidalConfig) -> bool:
    return cfg.model.tiny.arch == "qwen2_vl"


def warm_start_key(cfg: TidalConfig) -> str:
    """Everything the warm-started weights depend on, hashed."""
    # unset, the length tail stays out of the key (the warm starts cached before it keep theirs); set, its pads
    # are cut to fit rollout.max_new_tokens, so that enters too
    no_length_tail = {"length_tail"} if cfg.model.warm_start.length_tail is None else set()
    spec = {
        "format": 1,
        # a field that does not apply to the model or the task stays out, so the text demo's keys do not change with it
        "tiny": cfg.model.tiny.model_dump(mode="json", exclude=set() if is_tiny_vlm(cfg) else VISION_FIELDS),
        # the seed enters resolved (below): an unset warm_start.seed and one equal to the run's give one model
        "warm_start": cfg.model.warm_start.model_dump(mode="json", exclude={"cache_dir", "seed"} | no_length_tail),
        "data": cfg.data.model_dump(mode="json", exclude={"num_eval", "eval_path"} | (set() if cfg.data.task == "count_squares" else COUNT_FIELDS)),
        "seed": warm_start_seed(cfg),
    }
    if not no_length_tail:
        spec["max_new_tokens"] = cfg.rollout.max_new_tokens
    if is_tiny_vlm(cfg):  # its chat template is saved with it (multi-turn rollouts render tools and tool turns with it)
        from tidal.demo.vision import VISION_CHAT_TEMPLATE

        spec["chat_template"] = hashlib.sha256(VISION_CHAT_TEMPLATE.encode()).hexdigest()[:16]
    if plays_tool_traces(cfg):  # the traces are played through the environment and its template
        spec["agent"] = cfg.rollout.agent.model_dump(mode="json", include={"env", "tools", "tool_parser", "max_turns", "max_env_tokens_per_turn"})
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def sft_batch(
    tokenizer, problems: list[Problem], encode: Callable[[str], list[int]] | None = None, completions: list[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion+eos; labels only on the completion. `encode`: the prompt ids
    RL will use (data.prompt_template), so warm start and RL see the same prompts. `completions`: each
    problem's completion text (default: its final-answer line)."""
    encode = encode or prompt_encoder(tokenizer)
    completions = completions or [arithmetic_completion(p.answer) for p in problems]
    rows, labels = [], []
    for p, text in zip(problems, completions, strict=True):
        prompt = encode(p.prompt)
        completion = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, lab


# ids, attention mask, labels (-100: not trained), and a vision-language model's image inputs by keyword
Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]
# a batch of the examples at some indices, as one chunk or several (rows of similar length together:
# a padded row costs as much as a real one)
Batcher = Callable[[list[int]], list[Chunk]]


def batch_loss(model, chunks: list[Chunk]) -> torch.Tensor:
    """The mean token loss over every labelled token of the batch, whatever its chunks."""
    if len(chunks) == 1:
        return chunk_loss(model, chunks[0])
    counts = [int((chunk[2][:, 1:] != -100).sum()) for chunk in chunks]
    total = sum(counts)
    return sum(chunk_loss(model, chunk) * (n / total) for chunk, n in zip(chunks, counts) if n)


def chunk_loss(model, chunk: Chunk) -> torch.Tensor:
    ids, mask, labels, *images = chunk
    return model(input_ids=ids, attention_mask=mask, labels=labels, **(images[0] if images else {})).loss


@dataclass(frozen=True)
class WarmStartResult:
    steps: int  # steps run: fewer than asked when the probe stopped it early
    loss: float  # the last step's loss
    probe_accuracy: float | None  # greedy accuracy on the probe prompts at the last check


def answer_batcher(tokenizer, problems: list[Problem], encode: Callable[[str], list[int]] | None = None, pads: ScratchPads | None = None) -> Batcher:
    """The single-turn SFT batches: prompt + final-answer line + EOS, labels on the answer (with `pads`, on
    its scratch pad too: model.warm_start.length_tail)."""
    if pads is None:
        return lambda indices: [sft_batch(tokenizer, [problems[i] for i in indices], encode)]
    answers = [arithmetic_completion(p.answer) for p in problems]
    texts = [pads.pad(n, a, len(tokenizer(a, add_special_tokens=False).input_ids)) for n, a in enumerate(answers)]
    pads.report()
    return lambda indices: [sft_batch(tokenizer, [problems[i] for i in indices], encode, [texts[i] for i in indices])]


def supervised_warm_start(
    model,
    batch: Batcher,
    examples: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress=None,
    probe: Callable[[], float] | None = None,
    probe_every: int = 50,
    stop_at_accuracy: float | None = None,
) -> WarmStartResult:
    """A short SFT so RL starts with signal: `batch(indices)` gives the ids, attention mask and
    labels of those of the `examples`. With `probe` (greedy accuracy of the model as it is)
    and `stop_at_accuracy`, it stops at the first check that reaches that accuracy."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(1, steps)))
    model.train()
    loss_value, accuracy, step = float("nan"), None, 0
    for step in range(1, steps + 1):
        loss = batch_loss(model, batch(torch.randint(examples, (batch_size,), generator=gen).tolist()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if progress is not None:
            progress(step, steps, loss_value)
        if probe is not None and stop_at_accuracy is not None and step % probe_every == 0:
            model.eval()
            accuracy = probe()
            model.train()
            log.info("warm start step %d: loss %.3f, probe accuracy %.3f", step, loss_value, accuracy)
            if accuracy >= stop_at_accuracy:
                break
    model.eval()
    return WarmStartResult(step, loss_value, accuracy)


def greedy_probe(
    model, tokenizer, problems: list[Problem], max_new_tokens: int, encode: Callable[[str], list[int]], processor=None
) -> Callable[[], float]:
    """Greedy accuracy of `model` (as it is when called) on `problems`; problems with images need the
    vision-language model's `processor` (the model is not saved yet: the engine cannot load it)."""
    from tidal.evaluate import held_out_accuracy
    from tidal.rollout.engine import HFEngine

    def accuracy() -> float:
        engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_new_tokens)
        engine.processor = processor
        return held_out_accuracy(engine, tokenizer, problems, 128, max_new_tokens, encode=encode)

    return accuracy


def answer_warm_start(cfg: TidalConfig, model, tokenizer, pool: list[Problem], progress=None) -> WarmStartResult:
    """Prompt -> final-answer line, stopped early at ws.stop_at_accuracy greedy accuracy if set."""
    ws = cfg.model.warm_start
    encode = prompt_encoder(tokenizer, cfg.data)
    probe = greedy_probe(model, tokenizer, pool[: ws.probe_prompts], cfg.rollout.max_new_tokens, encode) if ws.stop_at_accuracy else None
    batch = answer_batcher(tokenizer, pool, encode, ScratchPads.from_config(cfg, warm_start_seed(cfg)))
    return supervised_warm_start(
        model, batch, len(pool), ws.steps, ws.batch_size, ws.lr, warm_start_seed(cfg), progress, probe, ws.probe_every, ws.stop_at_accuracy
    )


def vision_warm_start(cfg: TidalConfig, model, processor, pool: list[Problem], progress=None) -> WarmStartResult:
    """The tiny vision-language model's: prompt with its image -> final-answer line, stopped early at
    ws.stop_at_accuracy greedy accuracy if set. `processor`: tidal.model.vision.VisionProcessor."""
    from tidal.demo.vision import vision_sft_batch

    ws = cfg.model.warm_start
    encode = prompt_encoder(processor.tokenizer, cfg.data)
    rows = [(*processor.encode(encode(p.prompt, len(p.images)), list(p.images)), p.answer) for p in pool]
    probe = None
    if ws.stop_at_accuracy:
        probe = greedy_probe(model, processor.tokenizer, pool[: ws.probe_prompts], cfg.rollout.max_new_tokens, encode, processor)
    return supervised_warm_start(
        model,
        lambda indices: [vision_sft_batch(processor, [rows[i] for i in indices])],
        len(rows),
        ws.steps,
        ws.batch_size,
        ws.lr,
        warm_start_seed(cfg),
        progress,
        probe,
        ws.probe_every,
        ws.stop_at_accuracy,
    )


def plays_tool_traces(cfg: TidalConfig) -> bool:
    """The built-in environment with a built-in tool the traces call (calc, python): the warm start
    plays tool-use traces. Any other environment's steps are the user's (they may be costly, or have
    effects), so it gets the single-answer warm start."""
    from tidal.demo.tool_traces import trace_tool

    agent = cfg.rollout.agent
    return agent is not None and agent.env == "tools" and trace_tool(agent.tools) is not None


def tool_use_warm_start(cfg: TidalConfig, model, tokenizer, pool: list[Problem], progress=None) -> WarmStartResult:
    """Synthetic trajectories through the run's environment (tidal.demo.tool_traces): answers in the
    head, calls to the tool, and wrong calls, in the proportions ws.tool_use / ws.tool_mistakes."""
    from tidal.demo.tiny import TOOL_CHAT_TEMPLATE
    from tidal.demo.tool_traces import make_traces, trace_batcher, trace_tool
    from tidal.rollout.agent import AgentLoop

    ws = cfg.model.warm_start
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE  # saved with the model: TRL, vLLM and an exported model render the same turns
    # the traces are scripted: a benchmark's tool latency (rollout.agent.tool_latency) would only slow them down
    agent = cfg.rollout.agent.model_copy(update={"tool_latency": None})
    loop = AgentLoop.from_config(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"agent": agent})}), tokenizer)
    try:
        pads = ScratchPads.from_config(cfg, warm_start_seed(cfg))
        traces = make_traces(loop, pool, ws.tool_use, ws.tool_mistakes, warm_start_seed(cfg), trace_tool(agent.tools), pads)
    finally:
        loop.close()
    if pads is not None:
        pads.report()
    kinds = {k: sum(t.kind == k for t in traces) for k in sorted({t.kind for t in traces})}
    log.info("warm start on %d tool-use traces: %s", len(traces), kinds)
    return supervised_warm_start(
        model, trace_batcher(traces, tokenizer.pad_token_id), len(traces), ws.steps, ws.batch_size, ws.lr, warm_start_seed(cfg), progress
    )


def prepare_base_model(cfg: TidalConfig, dataset: Dataset, progress=None) -> Path | str:
    """The weights RL starts from: the user's model, or the cached tiny warm start (built once)."""
    if cfg.model.name_or_path:
        return cfg.model.name_or_path
    from tidal.demo.tiny import build_char_tokenizer, build_tiny_model

    target = cache_root(cfg) / "warm-start" / warm_start_key(cfg)
    if (target / "config.json").is_file():
        return target
    seed = warm_start_seed(cfg)
    if seed != cfg.seed:
        dataset = load_dataset(cfg.data, seed)  # the warm start's own problems, the same for every run seed
    torch.manual_seed(seed)
    if is_tiny_vlm(cfg):
        from tidal.demo.vision import build_processor, build_tiny_vlm, tiny_vlm_size

        # the processor (tokenizer and image processor) is saved with the model and stands in for the tokenizer
        tokenizer = processor = build_processor()
        model = build_tiny_vlm(processor.tokenizer, tiny_vlm_size(cfg.model.tiny))
        task, warm = "count_squares", vision_warm_start
    else:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg.model.tiny, tokenizer)
        task, warm = "arithmetic", tool_use_warm_start if plays_tool_traces(cfg) else answer_warm_start
    if cfg.model.warm_start.enabled and cfg.model.warm_start.steps:
        if cfg.data.task != task:
            raise ValueError(
                f"model.warm_start for the tiny {cfg.model.tiny.arch} model needs data.task {task!r}; set model.name_or_path for other tasks"
            )
        t0 = time.time()
        result = warm(cfg, model, tokenizer, dataset.train[: cfg.model.warm_start.examples], progress)
        log.info(
            "warm start: %d steps in %.1fs, final loss %.3f, probe accuracy %s", result.steps, time.time() - t0, result.loss, result.probe_accuracy
        )
    return save_to_cache(model, tokenizer, target)


def save_to_cache(model, tokenizer, target: Path, extra_files: dict[str, str] | None = None) -> Path:
    """Saves a model folder at `target` whole or not at all (written beside it, then renamed), so runs that
    build the same cached model at once each find a complete one; returns `target`."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target

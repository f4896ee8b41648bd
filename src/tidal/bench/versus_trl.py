"""Tidal (sync and periodic) against TRL's GRPOTrainer: the same model, prompts, rewards and settings, one run.

TRL is the tool a user would pick instead. Both sides get the same warm-started model, the same
prompts per step, the same rewards and hyper-parameters.

    tidal bench trl [CONFIG | --config CONFIG] [--steps 20] [--warmup 2] [--reps 3] [--systems trl,sync,periodic]
                    [--set k=v ...] [--json out.json] [--tracking-uri URI] [--experiment NAME]
    (or: python benchmarks/versus_trl.py ...; TRL is the `bench` extra: pip install -e '.[bench]')

What is matched, from the config (`trl_settings`): group size (num_generations), max new tokens
(max_completion_length), temperature with no top-p / top-k / min-p / repetition penalty, learning
rate, AdamW betas, weight decay, gradient clipping, warm-up (Tidal's own schedule, handed to TRL's
Trainer), clip range (epsilon, epsilon_high), no KL (beta 0), the loss aggregation (token_mean = TRL's
`dapo`, seq_mean_token_mean = `grpo`, seq_mean_token_sum_norm = `dr_grpo`), the policy loss
(ppo_clip = token-level ratios, gspo = sequence-level), the advantage (grpo with std = scale_rewards
`group`, without std or dr_grpo = `none`), the weighted reward functions (Tidal's, wrapped as TRL reward
functions), one optimizer step per generation batch of prompts_per_iteration x G completions
(num_iterations 1, steps_per_generation = gradient_accumulation_steps), the model's dtype and no
gradient checkpointing unless `trainer.activation_checkpointing`. TRL gets Tidal's prompts for step i
(`prompts_for_iteration`) in order (shuffle off) and generates with HF `generate` in one process. A
setting with no TRL equivalent is refused before anything runs, and the message lists each one.

Multi-turn configs (rollout.agent.env: tools, e.g. examples/calculator.yaml) run TRL's `tools=` loop with the
run's tools (`trl_tools`: Tidal's argument checks, error texts and observation cut, in TRL's process):
rollout.agent.max_turns is max_tool_calling_iterations + 1, rollout.max_new_tokens caps every generate call
(generation_kwargs), max_completion_length is the longest trajectory Tidal can produce, and what has no
equivalent (another environment or parser, a call budget one call per turn could exhaust, a tool
latency) is refused. The tiny model's tokenizer gets a tool-call rendering and a response template for
TRL (`prepare_tokenizer`); TRL's departures from Tidal's loop are counted (`tool_divergences`).

Equal updates on equal completions are checked as part of the run (`gradient_check`): one batch of
completions, generated once, goes through Tidal's learner and through TRL's own reward, advantage and
loss code (`_generate_and_score_completions` with a rollout function that returns these completions,
then `compute_loss`), from the same weights. The figure is the largest relative L2 difference of any
parameter's gradient; above `--grad-tolerance` the benchmark fails. The one known difference is TRL's
std epsilon (1e-4 against Tidal's 1e-6) in the advantage; the same comparison with Tidal's advantages
fed to TRL's loss isolates the loss itself (`--loss-tolerance`).

Timing (tidal.bench.timing, the same function `tidal bench modes` uses): each system runs in its own
process with every core, Tidal's as `tidal run` with eval off; a step's seconds are the wall time between
the ends of consecutive steps (generation, rewards, training, optimizer step, Tidal's snapshot and
checkpoint, and each system's per-step MLflow logging), and a run's seconds per step is their mean
after `--warmup` steps (the measured steps' wall time over their count: what a user waits per step).
Samples/s is the samples trained in those steps over their wall time. `--reps` repetitions alternate
the order of the systems (rep 1 as given, rep 2 reversed, ...); the table shows each rep and the
median over the reps, and periodic over sync per rep, as `tidal bench modes` computes it. Every run is
logged to one MLflow experiment tagged `system`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidal.bench.timing import iteration_wall_seconds, speedup, steady_timing
from tidal.config import ConfigError, TidalConfig, dump_config, load_config
from tidal.rundir import RunDir

TRL_VERSION = "1.16.0"  # the release this mapping was written against (checked by the gradient comparison)
SYSTEMS = ("trl", "sync", "periodic")
TIDAL_MODES = {"sync": "sync", "periodic": "periodic"}

# Tidal's loss aggregation -> TRL's loss_type with the same normaliser (one optimizer step per generation batch)
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
# Tidal's policy loss -> TRL's importance_sampling_level (ratio per token, or GSPO's length-normalised sequence ratio)
IMPORTANCE_LEVELS = {"ppo_clip": "token", "gspo": "sequence"}


class SettingsMismatch(SystemExit):
    """The config has a setting TRL cannot be given: the benchmark refuses to run (exit status 2)."""

    def __init__(self, mismatches: list[str], source: str = "the config"):
        lines = [f"tidal bench trl: {source} cannot be run the same way in TRL's GRPOTrainer; change or remove:"]
        lines += [f"  - {m}" for m in mismatches]
        super().__init__("\n".join(lines))
        self.mismatches = mismatches


def scale_rewards(cfg: TidalConfig) -> str | None:
    """TRL's scale_rewards for Tidal's advantage estimator, or None when there is none."""
    t = cfg.trainer
    if t.advantage == "grpo":
        return "group" if t.std_normalize else "none"
    if t.advantage == "dr_grpo":
        return "none"
    return None


def trl_settings(cfg: TidalConfig, micro_batches: int = 1) -> tuple[dict, list[str]]:
    """GRPOConfig keyword arguments that make TRL take the update Tidal's config describes, and the
    settings that have no TRL equivalent (each a line naming the key). Pure: imports neither TRL nor torch.

    `micro_batches` splits TRL's generation batch into that many gradient-accumulation micro-batches
    (still one optimizer step per generation batch); Tidal packs its micro-batches by `trainer.token_budget`.
    Device placement (`use_cpu`) and the learning-rate schedule (Tidal's, handed to TRL's Trainer as
    `optimizers`) are set by the caller."""
    t, r = cfg.trainer, cfg.rollout
    bad: list[str] = []
    samples = t.prompts_per_iteration * r.group_size
    if micro_batches < 1 or samples % micro_batches:
        bad.append(f"--trl-micro-batches {micro_batches} must divide prompts_per_iteration x group_size ({samples})")
        micro_batches = 1
    if r.engine != "hf":
        bad.append(
            f"rollout.engine {r.engine!r}: TRL is compared on HF generate; TRL 1.16's vLLM mode needs vllm<=0.31 and Tidal's vllm>=0.32, "
            "so they do not install in one environment (use rollout.engine: hf)"
        )
    if r.deterministic:
        bad.append("rollout.deterministic true: per-group seeded sampling has no TRL equivalent (TRL samples the batch from one RNG)")
    if t.kl_coef != 0:
        bad.append(f"trainer.kl_coef {t.kl_coef}: the KL term is not mapped onto TRL's beta (set it to 0)")
    if t.kl_in_reward and t.kl_coef != 0:
        bad.append("trainer.kl_in_reward true: TRL has no KL reward penalty")
    scale = scale_rewards(cfg)
    if scale is None:
        bad.append(f"trainer.advantage {t.advantage!r}: TRL's GRPOTrainer has group-mean advantages only (grpo, dr_grpo)")
    if t.policy_loss not in IMPORTANCE_LEVELS:
        bad.append(f"trainer.policy_loss {t.policy_loss!r}: TRL's clipped losses are ppo_clip (token ratios) and gspo (sequence ratios)")
    loss_type = LOSS_TYPES[t.loss_aggregation]
    completion_length = trajectory_budget(cfg) if r.agent is not None else r.max_new_tokens  # TRL's max_completion_length
    constant = t.aggregation_constant if t.aggregation_constant is not None else float(r.max_new_tokens)  # Tidal's dr_grpo divisor
    if t.loss_aggregation == "seq_mean_token_sum_norm" and constant != completion_length:
        bad.append(
            f"trainer.aggregation_constant {t.aggregation_constant}: TRL's dr_grpo divides by max_completion_length ({completion_length}); "
            f"set it to {completion_length}" + ("" if r.agent is not None else " or leave it unset")
        )
    if r.agent is not None:
        bad += agent_mismatches(cfg)
    if t.updates_per_iteration != 1:
        bad.append(
            f"trainer.updates_per_iteration {t.updates_per_iteration}: Tidal's mini-batches follow completion order, TRL's are shuffled; "
            "only one optimizer step per generation batch is compared"
        )
    if t.dynamic_sampling:
        bad.append("trainer.dynamic_sampling true: TRL's GRPOTrainer does not drop and replace all-equal-reward groups")
    if t.tis_cap is not None:
        bad.append(f"trainer.tis_cap {t.tis_cap}: TRL's importance-sampling correction exists only for vLLM generation")
    if cfg.reward.overlong_buffer:
        bad.append(f"reward.overlong_buffer {cfg.reward.overlong_buffer}: the overlong penalty is not mapped onto a TRL reward function")
    if t.ranks != 1:
        bad.append(f"trainer.ranks {t.ranks}: the comparison runs one trainer process on each side")
    if t.strategy not in ("auto", "single"):
        bad.append(f"trainer.strategy {t.strategy!r}: the comparison runs one plain (single) trainer on each side")
    kwargs = {
        # the batch: one generation batch of prompts_per_iteration x G completions per optimizer step
        "num_generations": r.group_size,
        "per_device_train_batch_size": samples // micro_batches,
        "gradient_accumulation_steps": micro_batches,
        "steps_per_generation": micro_batches,
        "num_iterations": 1,
        "shuffle_dataset": False,  # step i trains on Tidal's prompts of iteration i, in order
        # sampling
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "use_vllm": False,
        "use_transformers_continuous_batching": False,
        # the update
        "learning_rate": t.lr,
        "adam_beta1": t.betas[0],
        "adam_beta2": t.betas[1],
        "adam_epsilon": 1e-8,  # torch AdamW's default, which Tidal uses
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "lr_scheduler_type": "constant",  # replaced by Tidal's warm-up schedule (passed as `optimizers`)
        "beta": 0.0,
        "epsilon": t.clip_eps,
        "epsilon_high": t.clip_eps_high or t.clip_eps,
        "delta": None,
        "loss_type": loss_type,
        "importance_sampling_level": IMPORTANCE_LEVELS.get(t.policy_loss, "token"),
        "scale_rewards": scale or "group",
        "multi_objective_aggregation": "sum_then_normalize",
        "reward_weights": [f.weight for f in cfg.reward.functions],
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "disable_dropout": False,
        # precision and memory: the model in its config dtype on both sides, no autocast
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": t.activation_checkpointing,
        "seed": cfg.seed,
    }
    if r.agent is not None:  # TRL's tools= loop: the mapping below
        kwargs.update(
            max_completion_length=completion_length,
            generation_kwargs={"max_new_tokens": r.max_new_tokens},
            max_tool_calling_iterations=r.agent.max_turns - 1,
        )
    return kwargs, bad


# --- multi-turn (rollout.agent.env: tools) against TRL's tools= loop ---------------------------------
#
# TRL's GRPOTrainer(tools=[...]) renders the prompt with the tools' schemas, generates a turn, parses
# it with `tokenizer.parse_response` (a response template on the tokenizer), calls each parsed call's
# function in the trainer's process, appends the results in the chat template's tool format (token ids
# concatenated, nothing re-tokenised), generates the next turn from there, up to
# `max_tool_calling_iterations` rounds, and masks the inserted tokens out of the loss (`tool_mask`).
# Tidal's rollout keys map onto it as follows:
#   rollout.agent.max_turns          -> max_tool_calling_iterations = max_turns - 1 (each round adds a turn)
#   rollout.max_new_tokens           -> generation_kwargs.max_new_tokens: every generate call, i.e. every turn
#   max_turns x max_new_tokens + (max_turns - 1) x max_env_tokens_per_turn
#                                    -> max_completion_length: TRL's cap on the whole trajectory after the
#                                       prompt, which no Tidal trajectory can exceed (so it never cuts one)
#   agent.max_env_tokens_per_turn    -> TRL shows results whole; the tools TRL gets (`trl_tools`) cut
#                                       their text as Tidal's loop cuts a turn's observation
#   rollout.agent.max_tool_calls     -> no per-trajectory budget in TRL: compared only when one call per
#                                       tool-calling turn cannot exhaust it; turns with several calls are
#                                       counted in the TRL run (`tool_divergences`)
#   rollout.agent.tools              -> the same functions, as `trl_tools` wraps them


def trajectory_budget(cfg: TidalConfig) -> int:
    """The most tokens a Tidal trajectory has after its prompt: every turn at max_new_tokens and every
    observation at max_env_tokens_per_turn."""
    r, a = cfg.rollout, cfg.rollout.agent
    return a.max_turns * r.max_new_tokens + (a.max_turns - 1) * a.max_env_tokens_per_turn


def agent_mismatches(cfg: TidalConfig) -> list[str]:
    """The rollout.agent settings TRL's tools= loop cannot be given, one line each."""
    r = cfg.rollout.agent
    bad = []
    if r.env != "tools":
        bad.append(
            f"rollout.agent.env {r.env!r}: TRL's tools= loop is the built-in one (tool calls until a turn makes none); an environment's "
            "reset/step/reward have no equivalent there (use rollout.agent.env: tools)"
        )
    if not r.tools:
        bad.append("rollout.agent.tools []: TRL's tools= loop needs at least one tool")
    if r.tool_parser != "hermes":
        bad.append(f"rollout.agent.tool_parser {r.tool_parser!r}: TRL reads Hermes <tool_call> blocks through the tokenizer's response template")
    if r.max_tool_calls < r.max_turns - 1:
        bad.append(
            f"rollout.agent.max_tool_calls {r.max_tool_calls}: TRL's tools= loop has no per-trajectory call budget; only a budget that one call "
            f"per tool-calling turn cannot exhaust (>= max_turns - 1 = {r.max_turns - 1}) is compared"
        )
    if r.tool_latency is not None:
        bad.append("rollout.agent.tool_latency: TRL runs the tools in its own process, without the latency Tidal's tool process adds")
    return bad


# The tiny model's tool template (tidal.demo.tiny.TOOL_CHAT_TEMPLATE) renders an assistant message
# as its text, tool calls included: the model writes them into the text and Tidal never renders a
# parsed call back. TRL refuses a template that drops an assistant message's `tool_calls`
# (trl.chat_template_utils.supports_tool_calling: "The provided chat template does not support tool
# calling"), so the benchmark gives TRL's copy of the tokenizer a variant that renders them as the
# model writes them. TRL renders no assistant message into any token it trains on or generates from
# (prompts have none; a tool result's tokens are cut after the dummy assistant turn's EOS), so the
# tokens are the same. The saved model keeps its template.
TINY_ASSISTANT = "{%- if m.role == 'assistant' %}{{ '<a>' + m.content + eos_token }}"
TINY_ASSISTANT_WITH_CALLS = (
    "{%- if m.role == 'assistant' %}{{ '<a>' + m.content }}{% for c in m.tool_calls or [] %}"
    "{{ '<tool_call>{\"name\":' + (c.function.name | tojson) + ',\"arguments\":' + (c.function.arguments | tojson) + '}</tool_call>' }}"
    "{% endfor %}{{ eos_token }}"
)
# transformers' response template for that format (TRL parses every turn with it: `parse_response`):
# the text after the `<a>` header, Hermes `<tool_call>{json}</tool_call>` blocks as tool calls, up to EOS.
TINY_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<a>",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def prepare_tokenizer(cfg: TidalConfig, tokenizer):
    """TRL's copy of the tokenizer for a multi-turn config: the tiny model's tool template (with its
    tool-call rendering, above) and its response template. A user's model keeps its own template (TRL
    sets a response template for the chat templates it knows)."""
    from tidal.demo.tiny import TOOL_CHAT_TEMPLATE

    if cfg.rollout.agent is None or cfg.model.name_or_path is not None:
        return tokenizer
    if getattr(tokenizer, "chat_template", None) not in (None, TOOL_CHAT_TEMPLATE):
        raise SystemExit("tidal bench trl: the tiny model's tokenizer has a chat template other than tidal.demo.tiny.TOOL_CHAT_TEMPLATE")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE.replace(TINY_ASSISTANT, TINY_ASSISTANT_WITH_CALLS)
    tokenizer.response_template = TINY_RESPONSE_TEMPLATE
    return tokenizer


def agent_loop(cfg: TidalConfig, tokenizer):
    """Tidal's environment loop for rendering and fitting (its tools in this process): the prompts and
    the observation cuts TRL's side must match."""
    from tidal.demo.tiny import TOOL_CHAT_TEMPLATE
    from tidal.envs import EnvironmentFactory
    from tidal.rollout.agent import AgentLoop

    r = cfg.rollout.agent
    factory = EnvironmentFactory.from_names(r.env, r.tools, r.tool_parser, tokenizer, r.max_tool_calls)
    return AgentLoop(cfg, tokenizer, factory, TOOL_CHAT_TEMPLATE if cfg.model.name_or_path is None else None)


def trl_tools(cfg: TidalConfig, tokenizer) -> list:
    """The run's tools as TRL's `tools=` takes them: functions with each tool's name, signature and
    docstring (so the chat template shows the same schema), whose body is Tidal's call of the tool:
    the arguments checked against its schema, a failure as Tidal's error text, and the text cut to
    fit rollout.agent.max_env_tokens_per_turn as Tidal's loop cuts one observation. A call TRL cannot make
    (no such tool: TRL answers `{'error': 'Tool NAME not found.'}`) is counted by `tool_divergences`."""
    import inspect
    from types import SimpleNamespace

    from transformers.utils import get_json_schema

    from tidal.envs import tool_message

    loop = agent_loop(cfg, tokenizer)
    schemas = [t.schema for t in loop.factory.tools]
    cuts = SimpleNamespace(truncated_observations=0)
    functions = []
    for t in loop.factory.tools:

        def call(_tool=t, **arguments):
            text = _tool(arguments).text
            tokens, fitted = loop.fitted_observations([tool_message(text, _tool.name)], schemas, cuts)
            return text if tokens is None else fitted[0]["content"]

        call.__name__ = call.__qualname__ = t.name
        call.__doc__ = t.fn.__doc__
        call.__signature__ = inspect.signature(t.fn)
        call.__annotations__ = dict(getattr(t.fn, "__annotations__", {}))
        if get_json_schema(call) != t.schema:
            raise SystemExit(f"tidal bench trl: tool {t.name!r} does not keep its schema when wrapped for TRL")
        functions.append(call)
    return functions


def final_text(messages: list[dict]) -> str:
    """The final answer a reward function reads, from TRL's messages of a trajectory: the last
    assistant message's text, with its parsed tool calls written back as the model writes them
    (compact Hermes blocks), as Tidal's trajectory.final_text holds the turn's text."""
    from tidal.demo.tool_traces import tool_call_text

    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role", "assistant") == "assistant":
            calls = "".join(tool_call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in m.get("tool_calls") or [])
            return str(m.get("content") or "") + calls
    return ""


def tool_divergences(completions: list, cfg: TidalConfig) -> dict[str, int]:
    """Where TRL's tools= loop went where Tidal's would not have, counted from TRL's trajectories:
    calls past rollout.agent.max_tool_calls (Tidal answers them with an error), turns with several calls
    (Tidal fits their results to max_env_tokens_per_turn together, TRL's tools one by one), tool-call
    markup TRL's parser could not read (TRL ends the trajectory; Tidal shows an error and goes on)
    and calls of tools that do not exist (TRL's error text differs from Tidal's)."""
    r = cfg.rollout.agent
    out = {"over_call_budget": 0, "multi_call_turns": 0, "unparsed_tool_calls": 0, "unknown_tools": 0}
    names = {t.split(":")[-1] for t in r.tools}
    for messages in completions:
        if not isinstance(messages, list):
            continue
        assistant = [m for m in messages if m.get("role") == "assistant"]
        results = [m for m in messages if m.get("role") == "tool"]
        out["over_call_budget"] += int(len(results) > r.max_tool_calls)
        out["multi_call_turns"] += sum(len(m.get("tool_calls") or []) > 1 for m in assistant)
        out["unknown_tools"] += sum(m.get("name") not in names for m in results)
        last = assistant[-1] if assistant else {}
        out["unparsed_tool_calls"] += int("<tool_call>" in str(last.get("content") or "") and len(assistant) < r.max_turns)
    return out


def check_settings(cfg: TidalConfig, micro_batches: int = 1, source: str = "the config") -> dict:
    kwargs, bad = trl_settings(cfg, micro_batches)
    if bad:
        raise SettingsMismatch(bad, source)
    return kwargs


def require_trl():
    try:
        import trl
    except ImportError as err:
        raise SystemExit(f"tidal bench trl needs TRL {TRL_VERSION} ({err}): pip install -e '.[bench]'  (or: make bench-trl)") from None
    return trl


# --- the shared pieces: prompts, rewards, the TRL trainer ---------------------------------------


def prompt_rows(cfg: TidalConfig, dataset, steps: int, loop=None) -> list[dict]:
    """TRL's train dataset: Tidal's prompts of iterations 0..steps-1, in order, as TRL rows
    (`prompt`: text, or chat messages with data.chat_template, or with rollout.agent the environment's
    first messages, from `loop` (`agent_loop`); `answer` for the reward functions)."""
    from tidal.data import prompts_for_iteration, render_prompt

    rows = []
    for v in range(steps):
        for p in prompts_for_iteration(dataset, cfg.seed, v, cfg.trainer.prompts_per_iteration):
            prompt = render_prompt(p.prompt, cfg.data) if loop is None else loop.start_row(loop.framed(p.id, p.prompt, p.answer)).messages
            rows.append({"prompt": prompt, "problem": p.prompt, "answer": p.answer, "prompt_id": p.id, "iteration": v})
    return rows


def completion_text(completion) -> str:
    """TRL hands reward functions the decoded text, or for chat prompts the completion's messages (one
    assistant message, or with tools the whole trajectory): the final answer (`final_text`)."""
    if isinstance(completion, list):
        return final_text(completion)
    return completion


def trl_reward_functions(cfg: TidalConfig, on_batch=None) -> list:
    """Each of Tidal's reward functions as a TRL reward function; TRL applies the weights
    (`reward_weights`) and sums. As in Tidal's scorer, a function that raises or returns a non-number
    scores 0. `on_batch(kwargs)`, if given, sees every batch's dataset columns first (the prompt check)."""
    from tidal.rewards import checked_reward, resolve

    funcs = []
    for i, spec in enumerate(cfg.reward.functions):
        fn = resolve(spec.name)

        def reward(prompts, completions, answer, _fn=fn, _first=i == 0, **kwargs) -> list[float]:
            if _first and on_batch is not None:
                on_batch(kwargs, completions)
            if "final_message" in kwargs:  # the gradient check: the final turn as TRL's parser reads it
                completions = [[m] for m in kwargs["final_message"]]
            out = []
            for completion, ans in zip(completions, answer):
                try:
                    out.append(checked_reward(_fn(completion_text(completion), ans)))
                except Exception:
                    out.append(0.0)
            return out

        reward.__name__ = f"tidal_{spec.name.replace(':', '_').replace('.', '_')}"
        funcs.append(reward)
    return funcs


def build_trl_trainer(
    cfg: TidalConfig,
    base_model: str,
    rows: list[dict],
    steps: int,
    output_dir: str,
    micro_batches: int = 1,
    on_batch=None,
    settings_override: dict | None = None,
    agent_tools: bool = True,
    **extra,
):
    """TRL's GRPOTrainer on the warm-started model, with the settings `trl_settings` maps, Tidal's
    AdamW and warm-up schedule, and `rows` as its dataset. `extra` goes to GRPOTrainer (callbacks,
    rollout_func); `settings_override` replaces mapped settings (tests: a wrong mapping must be caught).
    With rollout.agent, TRL gets the run's tools (`trl_tools`) and the tokenizer `prepare_tokenizer`
    makes, unless `agent_tools` is false (the gradient check hands TRL finished trajectories)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tidal.devices import resolve_device
    from tidal.model.loading import load_model_and_tokenizer
    from tidal.trainer.learner import warmup_then_constant

    kwargs = {**check_settings(cfg, micro_batches), **(settings_override or {})}
    device = resolve_device(cfg.trainer.device)
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        use_cpu=device == "cpu",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **kwargs,
    )
    model, tokenizer = load_model_and_tokenizer(base_model, cfg.model.dtype)
    tokenizer = prepare_tokenizer(cfg, tokenizer)
    if cfg.rollout.agent is not None and agent_tools:
        extra["tools"] = trl_tools(cfg, tokenizer)
    t = cfg.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_constant(t.warmup_steps))
    return GRPOTrainer(
        model=model,
        reward_funcs=trl_reward_functions(cfg, on_batch),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
        **extra,
    )


def check_prompt_tokens(trainer, cfg: TidalConfig, tokenizer, rows: list[dict]) -> None:
    """TRL must see the token ids Tidal's workers encode, or the two would not train on the same prompts."""
    from tidal.data import prompt_encoder
    from tidal.protocol import WorkItem

    if cfg.rollout.agent is not None:  # the environment's first messages with the tools, as Tidal's loop renders them
        loop = agent_loop(cfg, tokenizer)
        encode = lambda row: loop.first_prompt(WorkItem(0, row["prompt_id"], row["problem"], row["answer"]))  # noqa: E731
    else:
        encode_problem = prompt_encoder(tokenizer, cfg.data)
        encode = lambda row: encode_problem(row["problem"])  # noqa: E731
    sample = rows[: min(len(rows), 16)]
    trl_ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in sample])
    for row, ids in zip(sample, trl_ids):
        tidal_ids = list(encode(row))
        if list(ids) != tidal_ids:
            raise SystemExit(
                f"tidal bench trl: TRL tokenizes prompt {row['prompt_id']} as {list(ids)[:12]}..., Tidal as {tidal_ids[:12]}...: "
                "the tokenizer adds special tokens differently (check data.chat_template and the tokenizer's BOS handling)"
            )


# --- equal updates on equal completions --------------------------------------------------------


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() if p.grad is not None else None for n, p in model.named_parameters()}


def relative_differences(ours: dict, theirs: dict) -> dict[str, float]:
    """Per parameter: ||ours - theirs|| / ||theirs|| (0 when both are zero), over the parameters both have."""
    import torch

    out = {}
    for name, g in theirs.items():
        a = ours.get(name)
        a = torch.zeros_like(g) if a is None and g is not None else a
        g = torch.zeros_like(a) if g is None and a is not None else g
        if g is None:
            continue
        norm = float(g.float().norm())
        diff = float((a.float() - g.float()).norm())
        out[name] = 0.0 if diff == 0 else diff / max(norm, 1e-30)
    return out


def gradient_check(cfg: TidalConfig, base_model: str, dataset, workdir: Path, micro_batches: int = 1, settings_override: dict | None = None) -> dict:
    """One batch of completions (iteration 0's prompts, sampled once by Tidal's engine) through Tidal's
    learner and through TRL's scoring and loss, from the same weights; returns the gradient differences.

    TRL's side is TRL's own code end to end after generation: a rollout function hands
    `_generate_and_score_completions` these completions (prompt ids, completion ids), TRL decodes
    them, scores them with the wrapped reward functions, computes its advantages, and `compute_loss`
    gives the loss whose gradient is compared. A second pass feeds TRL's loss Tidal's advantages,
    isolating the loss and its aggregation from the advantage's epsilon.

    With rollout.agent the completions are whole trajectories (Tidal's environment loop, its tool
    process and the HF engine): TRL gets each trajectory's tokens after the prompt with Tidal's loss
    mask as `env_mask` (TRL's `tool_mask`, which its loss multiplies in), and the final turn as TRL's
    own `parse_response` reads it (with the response template of `prepare_tokenizer`) for the reward
    functions. What the check does not cover is TRL's generation loop itself: which calls it makes and
    what it inserts (`tool_divergences` counts where the timed TRL run departs from Tidal's loop)."""
    import numpy as np
    import torch

    from tidal.algo import compute_advantages
    from tidal.data import prompts_for_iteration
    from tidal.model.loading import load_model_and_tokenizer
    from tidal.protocol import WorkItem
    from tidal.rewards import RewardScorer
    from tidal.rollout.agent import AgentLoop
    from tidal.rollout.engine import HFEngine
    from tidal.rollout.generator import generate_groups
    from tidal.trainer.learner import Learner

    torch.manual_seed(cfg.seed)
    G = cfg.rollout.group_size
    problems = prompts_for_iteration(dataset, cfg.seed, 0, cfg.trainer.prompts_per_iteration)
    items = [WorkItem(0, p.id, p.prompt, p.answer) for p in problems]

    # Tidal: generate once, then the learner's accumulated gradient scaled by 1/units, as its step does (before clipping)
    model, tokenizer = load_model_and_tokenizer(base_model, cfg.model.dtype)
    engine = HFEngine.for_rollout(model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    agent = AgentLoop.from_config(cfg, tokenizer) if cfg.rollout.agent is not None else None
    try:
        groups = generate_groups(
            engine,
            tokenizer,
            RewardScorer.from_config(cfg.reward),
            items,
            cfg,
            version=0,
            worker_id="gradient-check",
            max_groups_per_call=len(items),
            agent=agent,
        )
    finally:
        if agent is not None:
            agent.close()
    learner = Learner(cfg.trainer, model, tokenizer.pad_token_id, cfg.rollout.temperature, cfg.reward, cfg.rollout.max_new_tokens)
    learner.begin_iteration(0)
    learner.train_on_groups(groups)
    learner.strategy.scale_gradients(learner.model, 1.0 / max(1.0, learner.units))
    tidal_grads = _grads(learner.model)
    tidal_adv = torch.cat(
        [compute_advantages(cfg.trainer.advantage, torch.tensor(g.rewards, dtype=torch.float32), cfg.trainer.std_normalize) for g in groups]
    )

    # TRL: the same completions through its rollout-function path
    by_prompt = {g.prompt_id: g for g in groups}
    served = {"calls": 0}

    def rollout_func(prompts, trainer):
        served["calls"] += 1
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for i in range(0, len(prompts), G):
            g = by_prompt[batch_rows[i]["prompt_id"]]
            for s in g.samples:
                out["prompt_ids"].append(g.prompt_ids.tolist())
                out["completion_ids"].append(s.token_ids.tolist())
                out["logprobs"].append(np.asarray(s.logprobs, dtype=np.float64).tolist())
                if multi_turn:
                    out.setdefault("env_mask", []).append(s.loss_mask.astype(int).tolist())
                    out.setdefault("final_message", []).append(final_turn_message(trainer, g.prompt_ids, s.token_ids, s.loss_mask, tools))
        served["final_message"] = out.get("final_message")
        return out

    multi_turn = cfg.rollout.agent is not None
    loop = agent_loop(cfg, tokenizer) if multi_turn else None
    tools = [t.schema for t in loop.factory.tools] if multi_turn else None
    rows = prompt_rows(cfg, dataset, 1, loop)
    batch_rows = [row for row in rows for _ in range(G)]  # what TRL's RepeatSampler hands one generation batch
    trainer = build_trl_trainer(
        cfg,
        base_model,
        rows,
        1,
        str(workdir / "trl-check"),
        micro_batches,
        settings_override=settings_override,
        agent_tools=False,  # finished trajectories: TRL must not run its tool loop on them
        rollout_func=rollout_func,
    )
    if not multi_turn:  # a multi-turn prompt is rendered with the tools: checked in the timed TRL run, which has them
        check_prompt_tokens(trainer, cfg, tokenizer, rows)
    trl_model = trainer.model
    trl_model.train()
    scored = trainer._generate_and_score_completions([dict(r) for r in batch_rows])
    if served["calls"] != 1:
        raise RuntimeError("TRL did not take the completions from the rollout function")
    trl_adv = scored["advantages"].detach().float().cpu()
    # the weighted rewards TRL's reward functions give these completions (the final turn as TRL parses it)
    if multi_turn:
        finals = [[m] for m in served["final_message"]]
    else:
        finals = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for g in groups for s in g.samples]
    answers = [row["answer"] for row in batch_rows]
    weights = [f.weight for f in cfg.reward.functions]
    per_function = [fn([""] * len(finals), finals, answers) for fn in trl_reward_functions(cfg)]
    scored_rewards = {"rewards": [sum(w * r[i] for w, r in zip(weights, per_function)) for i in range(len(finals))]}

    def trl_gradient(inputs: dict) -> dict:
        trl_model.zero_grad(set_to_none=True)
        steps = trainer.args.steps_per_generation
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by Trainer's loop
        for part in _split(inputs, steps):
            trainer.compute_loss(trl_model, part).backward()
        return _grads(trl_model)

    trl_grads = trl_gradient(scored)
    end_to_end = relative_differences(tidal_grads, trl_grads)
    fed = dict(scored)
    fed["advantages"] = tidal_adv.to(scored["advantages"].device, scored["advantages"].dtype)
    loss_only = relative_differences(tidal_grads, trl_gradient(fed))
    tokens = int(sum(int(s.loss_mask.sum()) if s.loss_mask is not None else len(s.token_ids) for g in groups for s in g.samples))
    trajectory_tokens = int(sum(len(s.token_ids) for g in groups for s in g.samples))
    tidal_rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    trl_rewards = torch.tensor(scored_rewards["rewards"], dtype=torch.float32)
    zero_groups = sum(1 for g in groups if len(set(g.rewards)) == 1)
    if zero_groups == len(groups):
        raise SystemExit(
            "tidal bench trl: gradient check: every group of iteration 0 has equal rewards, so both gradients are zero and the "
            "comparison shows nothing; use a config whose model earns varied rewards (a longer warm start, other reward functions)"
        )
    return {
        "samples": len(groups) * G,
        "tokens": tokens,  # trained on (loss mask 1)
        "trajectory_tokens": trajectory_tokens,  # with the inserted tool results (multi-turn)
        "multi_turn": multi_turn,
        "tool_calls": int(sum(g.env_stats.get("tool_calls", 0) for g in groups)) if multi_turn else 0,
        "reward_mismatches": int((tidal_rewards - trl_rewards).abs().gt(1e-6).sum()),
        "groups_without_signal": zero_groups,
        "max_relative_grad_diff": max(end_to_end.values()),
        "global_relative_grad_diff": _global(tidal_grads, trl_grads),
        "max_relative_grad_diff_loss_only": max(loss_only.values()),
        "advantage_max_abs_diff": float((tidal_adv - trl_adv).abs().max()),
        "worst_parameter": max(end_to_end, key=end_to_end.get),
        "trl_version": _trl_version(),
    }


def final_turn_message(trainer, prompt_ids, token_ids, loss_mask, tools) -> dict:
    """A trajectory's last assistant turn (its last run of loss-mask-1 tokens) as TRL's tool loop
    parses a turn: `trl.chat_template_utils.parse_response` with everything before it as the prefix."""
    from trl.chat_template_utils import parse_response

    ids, mask = [int(t) for t in token_ids], [int(m) for m in loss_mask]
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    prefix = [int(t) for t in prompt_ids] + ids[:start]
    return parse_response(trainer.processing_class, ids[start:end], prefix=prefix, tools=tools)


def _split(inputs: dict, parts: int) -> list[dict]:
    if parts == 1:
        return [inputs]
    from trl.trainer.utils import split_tensor_dict

    return split_tensor_dict(inputs, parts)


def _global(ours: dict, theirs: dict) -> float:
    import torch

    names = [n for n, g in theirs.items() if g is not None and ours.get(n) is not None]
    a = torch.cat([ours[n].flatten().float() for n in names])
    b = torch.cat([theirs[n].flatten().float() for n in names])
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _trl_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


# --- the timed runs, each in its own process ---------------------------------------------------


def run_tidal(system: str, config_path: Path, steps: int, workdir: Path, tracking: dict) -> dict:
    run_dir = workdir / system
    overrides = [
        f"mode={TIDAL_MODES[system]}",
        f"trainer.iterations={steps}",
        "eval.enabled=false",
        f"tracking.uri={tracking['uri']}",
        f"tracking.experiment={tracking['experiment']}",
        f"tracking.run_name={system}-rep{tracking['rep']}",
    ]
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(config_path), "--run-dir", str(run_dir), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tidal bench trl: the Tidal {system} run failed:\n{proc.stderr[-3000:]}")
    from tidal.tracking import set_tags

    info = RunDir(run_dir).info()
    set_tags(info.tracking_uri, info.mlflow_run_id, {"system": system, "bench": "trl", "bench.invocation": tracking["invocation"]})
    return {**tidal_raw(RunDir(run_dir).metrics.read()), "mlflow_run_id": info.mlflow_run_id}


def tidal_raw(metrics: list[dict]) -> dict:
    """A Tidal run's per-step lists (as the TRL child writes its own), from its metrics.jsonl lines."""
    return {
        "step_seconds": iteration_wall_seconds(metrics),
        "generate_seconds": [float(m["generate_seconds"]) for m in metrics],
        "train_seconds": [float(m["train_seconds"]) for m in metrics],
        "reward_mean": [float(m["reward_mean"]) for m in metrics],
        "samples": [float(m["samples"]) for m in metrics],
        **(
            {"tool_calls_per_trajectory": [float(m["agent_tool_calls_mean"]) for m in metrics]}
            if all("agent_tool_calls_mean" in m for m in metrics)
            else {}
        ),
    }


def run_child(kind: str, config_path: Path, out: Path, args: list[str]) -> dict:
    """`kind` ("trl" or "check") in a fresh process with every core; its JSON result."""
    cmd = [sys.executable, "-m", "tidal.bench.versus_trl", f"_{kind}", str(config_path), str(out), *args]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        err = proc.stderr or proc.stdout
        if "tidal bench trl:" in err:  # the child's own message (a refusal or a failed check): pass it on as is
            raise SystemExit(err[err.rindex("tidal bench trl:") :].strip())
        raise SystemExit(f"tidal bench trl: the {kind} process failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def child_threads(cfg, cores: int) -> int:
    """A child's torch threads: trainer.threads when it is a number (`--set trainer.threads=1`: TRL gets the
    threads Tidal's sync trainer gets, a comparison that holds on a loaded machine), else every core."""
    return cfg.trainer.threads if isinstance(cfg.trainer.threads, int) else cores


def _child_setup(config_path: str):
    import logging
    import warnings

    from tidal.data import load_dataset
    from tidal.demo.warm_start import prepare_base_model
    from tidal.logs import setup_logging
    from tidal.threads import set_threads

    setup_logging()
    logging.getLogger("tidal").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    cfg = load_config(config_path)
    set_threads(child_threads(cfg, os.cpu_count() or 1))
    dataset = load_dataset(cfg.data, cfg.seed)
    return cfg, dataset, str(prepare_base_model(cfg, dataset))


def check_child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench trl (gradient check)")
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--micro-batches", type=int, default=1)
    args = ap.parse_args(argv)
    cfg, dataset, base = _child_setup(args.config)
    with tempfile.TemporaryDirectory(prefix="tidal-bench-trl-check-") as tmp:
        result = gradient_check(cfg, base, dataset, Path(tmp), args.micro_batches)
    Path(args.out).write_text(json.dumps(result))


def trl_child(argv: list[str]) -> None:
    """TRL's GRPOTrainer for `--steps` steps: per-step wall seconds, generate seconds and reward, and
    an MLflow run (one batched call per step, as Tidal's trainer makes) tagged system=trl."""
    ap = argparse.ArgumentParser(prog="tidal bench trl (TRL run)")
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--tracking", required=True, help="JSON: uri, experiment, invocation, rep")
    args = ap.parse_args(argv)
    cfg, dataset, base = _child_setup(args.config)
    from transformers import TrainerCallback

    from tidal.config import flatten
    from tidal.tracking import Tracker, create_run, log_params

    tracking = json.loads(args.tracking)
    _, run_id = create_run(
        tracking["uri"],
        tracking["experiment"],
        f"trl-rep{tracking['rep']}",
        {"system": "trl", "mode": "trl", "bench": "trl", "bench.invocation": tracking["invocation"], "trl.version": _trl_version()},
        {},
    )
    tracker = Tracker(tracking["uri"], run_id)
    from tidal.model.loading import load_tokenizer

    multi_turn = cfg.rollout.agent is not None
    rows = prompt_rows(cfg, dataset, args.steps, agent_loop(cfg, load_tokenizer(base)) if multi_turn else None)
    P = cfg.trainer.prompts_per_iteration
    clock = {"last": None, "steps": [], "generate": [], "generating": 0.0, "rewards": [], "generations": [], "step_generations": []}
    divergences: dict[str, int] = {}
    tool_calls = []

    def same_prompts(columns: dict, completions: list) -> None:
        """TRL's step i must train on Tidal's prompts of iteration i: checked on every batch. With
        tools, the trajectories' departures from Tidal's loop are counted (`tool_divergences`)."""
        step = columns["trainer_state"].global_step
        expected = {r["prompt_id"] for r in rows[step * P : (step + 1) * P]}
        if set(columns["iteration"]) != {step} or set(columns["prompt_id"]) != expected:
            raise RuntimeError(f"TRL step {step} got prompts of iterations {sorted(set(columns['iteration']))}, not Tidal's iteration {step}")
        if multi_turn:
            for k, n in tool_divergences(completions, cfg).items():
                divergences[k] = divergences.get(k, 0) + n
            tool_calls.append(sum(m.get("role") == "tool" for c in completions for m in c) / len(completions))

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["last"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            clock["steps"].append(now - clock["last"])
            clock["generate"].append(clock["generating"])
            clock["step_generations"].append(clock["generations"])
            clock["last"], clock["generating"], clock["generations"] = now, 0.0, []

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            if "reward" in logs:  # a step's log (the last one at train end is the run's summary)
                clock["rewards"].append(float(logs["reward"]))
                logs.update(step_seconds=clock["steps"][-1], generate_seconds=clock["generate"][-1])
            tracker.log({k: v for k, v in logs.items() if isinstance(v, (int, float))}, step=state.global_step - 1)

    with tempfile.TemporaryDirectory(prefix="tidal-bench-trl-") as tmp:
        trainer = build_trl_trainer(cfg, base, rows, args.steps, tmp, args.micro_batches, on_batch=same_prompts, callbacks=[StepClock()])
        generate = trainer._generate_single_turn

        def timed_generate(prompt_ids, *a, **k):
            t0 = time.perf_counter()
            try:
                return generate(prompt_ids, *a, **k)
            finally:
                clock["generating"] += time.perf_counter() - t0
                clock["generations"].append(len(prompt_ids))

        trainer._generate_single_turn = timed_generate
        check_prompt_tokens(trainer, cfg, load_tokenizer(base), rows)
        params = {**flatten(cfg), **{f"trl.{k}": str(v) for k, v in trl_settings(cfg, args.micro_batches)[0].items()}}
        log_params(tracking["uri"], run_id, params)
        try:
            trainer.train()
        except BaseException:
            tracker.finish("FAILED")
            raise
    tracker.finish()
    samples = P * cfg.rollout.group_size
    # one HF generate call of every completion of the step (with tools: the first turn's, then one per
    # round of tool results for the trajectories that called), and one optimizer step, per step
    calls = clock["step_generations"]
    if (
        trainer.state.global_step != args.steps
        or [c[:1] for c in calls] != [[samples]] * args.steps
        or (not multi_turn and any(len(c) != 1 for c in calls))
        or (multi_turn and any(len(c) > cfg.rollout.agent.max_turns for c in calls))
    ):
        raise RuntimeError(
            f"TRL took {trainer.state.global_step} optimizer steps and generated {calls} sequences per call; "
            f"expected {args.steps} steps whose first generation has all {samples} sequences"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "step_seconds": clock["steps"],
                "generate_seconds": clock["generate"],
                "reward_mean": clock["rewards"],
                "samples": [float(samples)] * len(clock["steps"]),
                "generate_calls": calls,
                "tool_calls_per_trajectory": tool_calls,
                "tool_divergences": divergences,
                "mlflow_run_id": run_id,
            }
        )
    )


# --- the benchmark -----------------------------------------------------------------------------


def summarize_run(raw: dict, warmup: int, samples_per_step: int) -> dict:
    """A run's figures from its per-step lists: `steady_timing`, as `tidal bench modes` reports them."""
    if any(n != samples_per_step for n in raw["samples"]):
        raise SystemExit(f"tidal bench trl: a step trained {raw['samples']} samples, not {samples_per_step}")
    kept = [r for r in raw["reward_mean"][warmup:] if not math.isnan(r)]
    return {
        **raw,  # the per-step lists
        **steady_timing(raw["step_seconds"], raw["samples"], warmup),
        "generate_seconds_mean": statistics.fmean(raw["generate_seconds"][warmup:]),
        "reward_mean_measured": statistics.fmean(kept) if kept else None,
    }


def agent_figures(res: dict, warmup: int) -> str:
    """Tool calls per trajectory after the warm-up steps and, for TRL, its departures from Tidal's loop."""
    calls = res.get("tool_calls_per_trajectory") or []
    out = f", tool calls/trajectory {statistics.fmean(calls[warmup:]):.2f}" if calls[warmup:] else ""
    if res.get("tool_divergences"):
        out += ", departures from Tidal's loop: " + ", ".join(f"{k} {v}" for k, v in res["tool_divergences"].items())
    return out


def rep_orders(systems: list[str], reps: int) -> list[list[str]]:
    """Rep 1 in the given order, rep 2 reversed, rep 3 as rep 1, ...: no system always runs first."""
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(reps)]


def ratio_table(reps: list[dict], systems: list[str]) -> dict[str, dict]:
    """Per system: seconds per step per rep, their median, samples/s, samples/s over TRL's (per rep and
    overall) and, with sync among the systems, over sync's (per rep: `speedup`, as `tidal bench modes`)."""
    out = {}

    def median(name: str) -> float:
        return float(statistics.median(rep["results"][name]["seconds_per_iteration"] for rep in reps))

    for name in systems:
        per_rep = [rep["results"][name]["seconds_per_iteration"] for rep in reps]
        row = {
            "seconds_per_step_per_rep": per_rep,
            "seconds_per_step_median": median(name),
            "samples_per_s": reps[0]["samples_per_step"] / median(name),
        }
        for base in ("trl", "sync"):
            if base in systems:
                row[f"vs_{base}_per_rep"] = [speedup(rep["results"][base], rep["results"][name]) for rep in reps]
                row[f"vs_{base}"] = median(base) / median(name)
        out[name] = row
    return out


def format_table(summary: dict[str, dict], reps: int) -> str:
    head = ["system", *[f"rep {r + 1} s/step" for r in range(reps)], "median s/step", "samples/s", "samples/s vs TRL (per rep)", "vs sync (per rep)"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, row in summary.items():
        vs = " / ".join(f"{x:.2f}" for x in row.get("vs_trl_per_rep", []))
        cells = [name, *[f"{s:.3f}" for s in row["seconds_per_step_per_rep"]], f"{row['seconds_per_step_median']:.3f}", f"{row['samples_per_s']:.0f}"]
        cells.append(f"{row['vs_trl']:.2f} ({vs})" if "vs_trl" in row else "n/a")
        vs_sync = " / ".join(f"{x:.2f}" for x in row.get("vs_sync_per_rep", []))
        cells.append(f"{row['vs_sync']:.2f} ({vs_sync})" if "vs_sync" in row else "n/a")
        lines.append(" | ".join(cells))
    return "\n".join(f"| {line} |" for line in lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_trl", "_check"):
        return (trl_child if argv[0] == "_trl" else check_child)(argv[1:])
    ap = argparse.ArgumentParser(prog="tidal bench trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None, help="the config (default examples/arithmetic.yaml)")
    ap.add_argument("--config", dest="config_option", default=None, help="the same, as an option")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (= iterations) per system and repetition")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the timings (at least 1)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the order of the systems alternates")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {list(SYSTEMS)}")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override, for every system")
    ap.add_argument("--trl-micro-batches", type=int, default=1, help="TRL gradient-accumulation micro-batches per step (memory; still one step)")
    ap.add_argument("--grad-tolerance", type=float, default=1e-2, help="largest relative gradient difference accepted, end to end")
    ap.add_argument("--loss-tolerance", type=float, default=1e-4, help="the same with Tidal's advantages fed to TRL's loss")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI, else runs/bench-trl/mlflow.db)")
    ap.add_argument("--experiment", default="tidal-bench-trl", help="MLflow experiment every run lands in, tagged `system`")
    args = ap.parse_args(argv)
    if args.config and args.config_option and args.config != args.config_option:
        raise SystemExit("tidal bench trl: give the config once (positional or --config)")
    args.config = args.config or args.config_option or "examples/arithmetic.yaml"
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise SystemExit(f"--systems: choose from {list(SYSTEMS)}, got {systems}")
    if args.warmup < 1 or args.steps <= args.warmup or args.reps < 1:
        raise SystemExit("need --warmup >= 1 (the first step includes start-up), --steps > --warmup and --reps >= 1")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        raise SystemExit(f"tidal bench trl: {err}") from None
    kwargs = check_settings(cfg, args.trl_micro_batches, args.config)
    version = _trl_version()
    if version == "missing":
        require_trl()
    if version != TRL_VERSION:
        print(f"warning: TRL {version} is installed; the mapping was written for {TRL_VERSION} (the gradient check still guards it)", flush=True)
    samples_per_step = cfg.trainer.prompts_per_iteration * cfg.rollout.group_size
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        store = Path("runs/bench-trl").resolve()
        store.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{store / 'mlflow.db'}"
    invocation = time.strftime("%Y%m%d-%H%M%S")
    print(
        f"tidal bench trl: {args.config}, {args.steps} steps per run (means after {args.warmup} warm-up), "
        f"{cfg.trainer.prompts_per_iteration} prompts x G {cfg.rollout.group_size} = {samples_per_step} samples per step, {args.reps} repetition(s); "
        f"TRL {version}: loss_type {kwargs['loss_type']}, scale_rewards {kwargs['scale_rewards']}, importance_sampling_level "
        f"{kwargs['importance_sampling_level']}, beta 0, epsilon {kwargs['epsilon']}/{kwargs['epsilon_high']}, lr {kwargs['learning_rate']}, "
        f"max_completion_length {kwargs['max_completion_length']}, temperature {kwargs['temperature']}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tidal-bench-trl-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.yaml"
        config_path.write_text(dump_config(cfg))  # every system reads the same resolved config
        micro = ["--micro-batches", str(args.trl_micro_batches)]
        check = run_child("check", config_path, workdir / "check.json", micro)
        ok = (
            check["max_relative_grad_diff"] <= args.grad_tolerance
            and check["max_relative_grad_diff_loss_only"] <= args.loss_tolerance
            and check["reward_mismatches"] == 0
        )
        what = (
            f"{check['samples']} trajectories, {check['tokens']} trained tokens of {check['trajectory_tokens']}, {check['tool_calls']} tool calls"
            if check["multi_turn"]
            else f"{check['samples']} completions, {check['tokens']} tokens"
        )
        print(
            f"gradient check ({what}, {check['groups_without_signal']} groups without signal, {check['reward_mismatches']} rewards differing): "
            f"max relative difference {check['max_relative_grad_diff']:.2e} (tolerance {args.grad_tolerance:g}; TRL's std epsilon is 1e-4, Tidal's 1e-6), "
            f"{check['max_relative_grad_diff_loss_only']:.2e} with Tidal's advantages fed to TRL's loss (tolerance {args.loss_tolerance:g}); "
            f"advantages differ by at most {check['advantage_max_abs_diff']:.1e}",
            flush=True,
        )
        if not ok:
            raise SystemExit("tidal bench trl: Tidal and TRL do not make the same update on the same completions: the comparison would be unfair")
        reps = []
        for r, order in enumerate(rep_orders(systems, args.reps)):
            tracking = {"uri": uri, "experiment": args.experiment, "invocation": invocation, "rep": r + 1}
            results = {}
            for name in order:
                if name == "trl":
                    raw = run_child(
                        "trl", config_path, workdir / f"trl-{r}.json", ["--steps", str(args.steps), "--tracking", json.dumps(tracking), *micro]
                    )
                else:
                    raw = run_tidal(name, config_path, args.steps, workdir / f"rep{r}", tracking)
                results[name] = summarize_run(raw, args.warmup, samples_per_step)
                res = results[name]
                print(
                    f"rep {r + 1} {name:8s} {res['seconds_per_iteration']:.3f} s/step (median {res['seconds_per_iteration_median']:.3f}, "
                    f"generate {res['generate_seconds_mean']:.3f}), "
                    f"{res['samples_per_s']:.0f} samples/s, mean reward {res['reward_mean_measured']:.3f}{agent_figures(res, args.warmup)}",
                    flush=True,
                )
            reps.append({"order": order, "results": results, "samples_per_step": samples_per_step})
    summary = ratio_table(reps, systems)
    print(format_table(summary, args.reps), flush=True)
    print(f"MLflow: the runs side by side: tidal ui --tracking-uri {uri} --experiment {args.experiment}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "config": args.config,
                    "overrides": args.overrides,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "reps": args.reps,
                    "samples_per_step": samples_per_step,
                    "cpu_count": os.cpu_count(),
                    "trl_version": version,
                    "trl_settings": kwargs,
                    "gradient_check": check,
                    "summary": summary,
                    "repetitions": reps,
                    "tracking_uri": uri,
                    "experiment": args.experiment,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

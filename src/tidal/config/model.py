"""The `model` and `data` blocks: what is trained, and on which problems."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from tidal.config.base import Strict

Dtype = Literal["float32", "bfloat16", "float16"]


class TinyModelConfig(Strict):
    """Architecture of the built-in tiny model (used when `model.name_or_path` is unset)."""

    arch: Literal["qwen2", "llama", "qwen2_vl"] = Field(
        "qwen2",
        description="Transformers architecture of the tiny model; `qwen2_vl`: a vision-language model (Qwen2-VL, its vision tower "
        "sized by the `vision_*` fields) with the character tokenizer, Qwen2-VL's vision tokens and its image processor, for a "
        "task with images (`data.task: count_squares`).",
    )
    hidden_size: int = Field(128, gt=0, description="The tiny model's `hidden_size` (as in a transformers config).")
    intermediate_size: int = Field(384, gt=0, description="The tiny model's MLP width.")
    num_layers: int = Field(4, gt=0, description="The tiny model's decoder layers.")
    num_heads: int = Field(4, gt=0, description="The tiny model's attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="The tiny model's key/value heads (grouped-query attention when fewer than `num_heads`).")
    max_position_embeddings: int = Field(128, gt=0, description="Longest sequence (prompt and response) the tiny model takes.")
    vision_depth: int = Field(2, gt=0, description="qwen2_vl: the vision tower's transformer blocks.")
    vision_embed_dim: int = Field(32, gt=0, description="qwen2_vl: the vision tower's width (per 14x14 patch).")
    vision_heads: int = Field(2, gt=0, description="qwen2_vl: the vision tower's attention heads.")


class LengthTailConfig(Strict):
    """A scratch pad of log-normal length before each answer of the warm-start data (tidal.demo.length_tail), so
    the warm-started policy's responses have long-tailed lengths: this median and this ratio of the 99th
    percentile to the median (sigma = ln(ratio) / 2.326)."""

    p50_tokens: int = Field(gt=0, description="The pad's median length, in tokens (characters, for the tiny model).")
    p99_over_p50: float = Field(10.0, ge=1, description="The 99th percentile over the median: how heavy the tail is.")


class WarmStartConfig(Strict):
    """Short supervised warm start on the task so RL starts with signal."""

    enabled: bool = Field(True, description="Warm-start the tiny model with a short SFT on the task (cached under `cache_dir`, reused).")
    steps: int = Field(800, ge=0, description="SFT steps (the most it runs when `stop_at_accuracy` is set).")
    batch_size: int = Field(64, gt=0, description="SFT batch size.")
    lr: float = Field(3e-3, gt=0, description="SFT learning rate.")
    examples: int = Field(20000, gt=0, description="Training problems the SFT draws from.")
    stop_at_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Early stop: end the SFT once greedy accuracy on `probe_prompts` training prompts reaches this "
        "(checked every `probe_every` steps; `steps` is then the most it runs). RL learns most from a model that is "
        "sometimes right: pass@k well above pass@1. Stopping at an accuracy rather than a step count gives every seed "
        "the same starting point, where the learning curve is steep.",
    )
    probe_every: int = Field(50, gt=0, description="Steps between accuracy probes (see `stop_at_accuracy`).")
    probe_prompts: int = Field(256, gt=0, description="Training prompts each probe scores (see `stop_at_accuracy`).")
    tool_use: float = Field(
        0.4,
        ge=0,
        le=1,
        description="With `rollout.agent` (environment `tools`) and `calc` or `python` in `rollout.agent.tools` (the first "
        "of them named): the share of the synthetic warm-start trajectories that call the tool (the rest answer in the head).",
    )
    tool_mistakes: float = Field(
        0.3,
        ge=0,
        le=1,
        description="The share of those tool calls made wrongly (a mistyped operand; an argument `calc` does not take, or a "
        "`python` program that never prints), so RL has better and worse calls to tell apart.",
    )
    length_tail: LengthTailConfig | None = Field(
        None,
        description="A scratch pad of heavy-tailed length before each answer of the warm-start data (with `rollout.agent`: "
        "before the first turn), so responses have long-tailed lengths (benchmarks: long responses); each pad is cut to fit "
        "`rollout.max_new_tokens` with its answer. Unset: none.",
    )
    cache_dir: str | None = Field(None, description="Where warm starts are cached; unset: `$TIDAL_CACHE`, else `~/.cache/tidal`.")
    seed: int | None = Field(None, description="Unset: the run's seed; a number: runs of any seed share this warm start.")


class LoraConfig(Strict):
    """LoRA through peft: only the adapter (and `modules_to_save`) trains and holds optimizer state; the
    reference policy is the base with the adapter disabled; each weight-store version holds the adapter
    alone (peft's `adapter_model.safetensors` + `adapter_config.json`) on top of the run's base model."""

    r: PositiveInt = Field(8, description="The adapter's rank (vLLM serves it at the smallest max rank it accepts above: 1, 8, 16, 32, ... 512).")
    alpha: float = Field(16.0, gt=0, description="Scaling: the update is (alpha / r) * B A.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="On the adapter's input while training (0: the trainer's and the engine's log-probs agree exactly)."
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], description="Module names peft wraps."
    )
    modules_to_save: list[str] | None = Field(
        None, description="Whole modules trained and stored beside the adapter (e.g. `lm_head`); HF engine only."
    )


class ModelConfig(Strict):
    name_or_path: str | None = Field(None, description="HF directory or hub id; unset: the built-in tiny model.")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="The built-in tiny model's architecture (when `name_or_path` is unset).")
    warm_start: WarmStartConfig = Field(WarmStartConfig(), description="The tiny model's short supervised warm start before RL.")
    dtype: Dtype = Field("float32", description="The dtype the model is loaded and trained in.")
    lora: LoraConfig | None = Field(None, description="Unset: every weight trains; a block (even `lora: {}`): LoRA.")


class DataConfig(Strict):
    task: Literal["arithmetic", "jsonl", "count_squares"] = Field(
        "arithmetic",
        description="`arithmetic`: synthetic problems made from `seed`; `jsonl`: rows from `data.path`; `count_squares`: "
        'synthetic 56x56 images of coloured squares made from `seed`, "how many red squares?" (needs a vision-language model: '
        "`model.tiny.arch: qwen2_vl` or one in `model.name_or_path`).",
    )
    path: str | None = Field(None, description="jsonl: rows with `question` and `answer`.")
    eval_path: str | None = Field(None, description="jsonl: held-out rows; unset: the last tenth of the rows read from `data.path` is held out.")
    num_train: int = Field(
        5000,
        gt=0,
        description="Training problems (arithmetic: generated; jsonl: the most rows read from `data.path`, the rest of a longer file unused).",
    )
    num_eval: int = Field(200, gt=0, description="Held-out problems (jsonl: the most rows used of `data.eval_path` or the held-out tenth).")
    max_digits: int = Field(2, gt=0, le=9, description="arithmetic: digits per operand.")
    operations: list[Literal["+", "-", "*"]] = Field(["+", "-"], description="arithmetic: the operators drawn from.")
    max_count: int = Field(4, ge=1, le=16, description="count_squares: the most red squares in an image (answers 0..max_count).")
    max_distractors: int = Field(
        2, ge=0, le=16, description="count_squares: the most blue or green squares in an image (each image draws 0..this many)."
    )
    prompt_template: str = Field(
        "{prompt}",
        description="What the model sees: `prompt_template` around each problem's text (`{prompt}`; write literal braces as "
        "{{ }}), then, with `chat_template`, the tokenizer's chat template as one user turn (instruct models), after "
        "`system_prompt` if set.",
    )
    chat_template: bool = Field(False, description="Apply the tokenizer's chat template (see `prompt_template`).")
    system_prompt: str | None = Field(None, description="A system turn before each question (needs `chat_template`).")

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> DataConfig:
        if self.task == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.task is 'jsonl'")
        return self

    @model_validator(mode="after")
    def _prompt_template_has_one_prompt_field(self) -> DataConfig:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None]
        except ValueError as err:
            raise ValueError(f"data.prompt_template is not a valid template ({err}); write literal braces as {{{{ }}}}") from None
        if fields != ["prompt"]:
            raise ValueError(f"data.prompt_template must contain {{prompt}} exactly once and no other field, found {fields}")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("data.system_prompt needs data.chat_template: true (it is a chat turn)")
        return self

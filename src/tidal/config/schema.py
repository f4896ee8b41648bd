"""The config schema: one strict pydantic model per block, validated with errors that name the key."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Strict):
    """Architecture of the built-in tiny model (used when `model.name_or_path` is unset)."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(128, gt=0)


class WarmStartConfig(_Strict):
    """Short supervised warm start on the task so RL starts with signal."""

    enabled: bool = True
    steps: int = Field(800, ge=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(3e-3, gt=0)
    examples: int = Field(20000, gt=0)
    # Early stop: end the SFT once greedy accuracy on `probe_prompts` training prompts reaches this
    # (checked every `probe_every` steps; `steps` is then the most it runs). RL learns most from a
    # model that is sometimes right: pass@k well above pass@1. Stopping at an accuracy rather than a
    # step count gives every seed the same starting point, where the learning curve is steep.
    stop_at_accuracy: float | None = Field(None, gt=0, le=1)
    probe_every: int = Field(50, gt=0)
    probe_prompts: int = Field(256, gt=0)
    tool_use: float = Field(0.4, ge=0, le=1)
    tool_mistakes: float = Field(0.3, ge=0, le=1)
    cache_dir: str | None = None  # default: $TIDAL_CACHE or ~/.cache/tidal
    seed: int | None = None  # None: the run's seed; a number: runs of any seed share this warm start


class LoraConfig(_Strict):
    """LoRA through peft: only the adapter (and `modules_to_save`) trains and holds optimizer state; the
    reference policy is the base with the adapter disabled; each weight-store version holds the adapter
    alone (peft's `adapter_model.safetensors` + `adapter_config.json`) on top of the run's base model."""

    r: PositiveInt = 8  # the adapter's rank (vLLM serves it at the smallest max rank it accepts above: 1, 8, 16, 32, ... 512)
    alpha: float = Field(16.0, gt=0)  # scaling: the update is (alpha / r) * B A
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input while training (0: the trainer's and the engine's log-probs agree exactly)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # module names peft wraps
    modules_to_save: list[str] | None = None  # whole modules trained and stored beside the adapter (e.g. lm_head); HF engine only


class ModelConfig(_Strict):
    name_or_path: str | None = None  # HF directory or hub id; None = the built-in tiny model
    tiny: TinyModelConfig = TinyModelConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None  # None: every weight trains; a block (even `lora: {}`): LoRA


class DataConfig(_Strict):
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    path: str | None = None  # jsonl: rows with `question` and `answer`
    eval_path: str | None = None
    num_train: int = Field(5000, gt=0)
    num_eval: int = Field(200, gt=0)
    max_digits: int = Field(2, gt=0, le=9)
    operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    # What the model sees: `prompt_template` around each problem's text (`{prompt}`; write literal
    # braces as {{ }}), then, with `chat_template`, the tokenizer's chat template as one user turn
    # (instruct models), after `system_prompt` if set.
    prompt_template: str = "{prompt}"
    chat_template: bool = False
    system_prompt: str | None = None

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> DataConfig:
        if self.task == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.task is 'jsonl'")
        return self

    @model_validator(mode="after")
    def _prompt_template_has_one_prompt_field(self) -> DataConfig:
        import string

        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None]
        except ValueError as err:
            raise ValueError(f"data.prompt_template is not a valid template ({err}); write literal braces as {{{{ }}}}") from None
        if fields != ["prompt"]:
            raise ValueError(f"data.prompt_template must contain {{prompt}} exactly once and no other field, found {fields}")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("data.system_prompt needs data.chat_template: true (it is a chat turn)")
        return self


class ServeRewardModelConfig(_Strict):
    """`tidal run` starts a reward server (`tidal serve-reward`) for this entry, beside nats-server,
    and stops it with the run; the entry's url is then the server's."""

    # a Hugging Face directory of an AutoModelForSequenceClassification; None: the built-in tiny reward
    # model of the arithmetic task (trained from the warm start on right vs wrong answers, cached)
    model: str | None = None
    port: int | None = Field(None, gt=0, lt=65536)  # the server's port on 127.0.0.1; None: a free one
    batch_size: int = Field(64, gt=0)  # rows per forward pass on the server
    # the reward: the model's first logit, its sigmoid, or binary: 1 when the logit is positive (the
    # classifier's verdict; a policy cannot climb the score's small differences), else 0
    output: Literal["logit", "sigmoid", "binary"] = "logit"
    # torch threads of the server on CPU: it shares the cores with the run's roles, and a small model's
    # forward pass gains nothing from threads that wait on each other
    threads: int = Field(1, gt=0)


DEFAULT_JUDGE_TEMPLATE = (
    "You grade an answer to a problem.\n\nProblem:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\nIs the answer to grade correct? Reply with yes or no only."
)
SERVED_KEYS = (
    "url",
    "model",
    "protocol",
    "batch_size",
    "concurrency",
    "timeout_seconds",
    "retries",
    "backoff",
    "api_key_env",
    "max_error_rate",
    "error_window",
    "serve",
)
JUDGE_KEYS = ("prompt_template", "score", "score_field", "samples", "temperature", "max_tokens")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RewardFunctionConfig(_Strict):
    """One reward: an in-process function (`type: function`), a reward model behind HTTP
    (`reward_model`) or an LLM judge behind an OpenAI-compatible endpoint (`judge`)."""

    type: Literal["function", "reward_model", "judge"] = "function"
    # function: registry name or `module:function`; reward_model / judge: the reward's name in
    # reward_parts and the logs (default: the type)
    name: str | None = None
    weight: float = 1.0
    # reward_model: the endpoint (openrlhf: the POST url; vllm_classify: the server's base url, /classify
    # is added); judge: the base url of an OpenAI-compatible API (/chat/completions is added)
    url: str | None = None
    model: str | None = None  # vllm_classify and judge: the served model's name, sent with each request
    # reward_model: openrlhf ({"query", "prompts", "labels"} -> {"rewards"}) or vllm_classify (vLLM's /classify)
    protocol: Literal["openrlhf", "vllm_classify"] = "openrlhf"
    batch_size: int = Field(32, gt=0)  # samples per request (reward_model; a judge request is one sample); across groups
    concurrency: int = Field(4, gt=0)  # requests in flight at once per worker
    timeout_seconds: float = Field(60.0, gt=0)  # one request
    retries: int = Field(3, ge=0)  # after a timeout, 5xx/429, a refused or dropped connection, or an unusable answer
    backoff: float = Field(0.5, ge=0)  # seconds before the first retry, doubled for each next one
    api_key_env: str | None = None  # the NAME of an environment variable holding the API key (sent as a Bearer token)
    # the run stops, naming the endpoint, when more than this share of the last `error_window` requests
    # failed after their retries (a failed request scores its samples 0, counted in reward_errors)
    max_error_rate: float = Field(0.2, ge=0, le=1)
    error_window: int = Field(20, gt=0)  # requests the error rate is measured over (the latest ones)
    serve: ServeRewardModelConfig | None = None  # reward_model only: `tidal run` serves `serve.model` itself
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE  # judge: the rubric, with {prompt} {completion} {answer}; literal braces as {{ }}
    # judge: how a reply becomes a score: number (the last number in it), yes_no (yes 1, no 0),
    # json (the field `score_field` of the JSON object in it; true/false count as 1/0)
    score: Literal["number", "yes_no", "json"] = "yes_no"
    score_field: str = "score"  # judge, score json: the verdict's field
    samples: int = Field(1, gt=0)  # judge: replies per sample (the request's n), averaged
    temperature: float = Field(0.0, ge=0)  # judge: sampling temperature; with rollout.deterministic 0, and the request carries the run's seed
    max_tokens: int = Field(256, gt=0)  # judge: the longest reply

    @model_validator(mode="after")
    def _keys_fit_the_type(self) -> RewardFunctionConfig:
        label = self.name or self.type
        fields = type(self).model_fields
        set_keys = {k for k in self.model_fields_set if getattr(self, k) != fields[k].default}  # a resolved config repeats defaults
        if self.type == "function":
            if not self.name:
                raise _error("reward.functions: an entry of type 'function' needs a name (a registered reward or module:function)")
            stray = sorted(k for k in set_keys & set(SERVED_KEYS + JUDGE_KEYS))
            if stray:
                raise _error(f"reward.functions[{label}]: {', '.join(stray)} only for type 'reward_model' or 'judge'")
            return self
        if self.type == "reward_model":
            stray = sorted(set_keys & set(JUDGE_KEYS))
            if stray:
                raise _error(f"reward.functions[{label}]: {', '.join(stray)} only for type 'judge'")
            if (self.url is None) == (self.serve is None):
                raise _error(
                    f"reward.functions[{label}]: a reward_model needs exactly one of url (a running server) and serve (tidal run starts one)"
                )
            if self.protocol == "vllm_classify" and not self.model:
                raise _error(f"reward.functions[{label}]: protocol 'vllm_classify' needs model (the served model's name)")
        if self.type == "judge":
            if self.serve is not None or "protocol" in set_keys:
                raise _error(f"reward.functions[{label}]: serve and protocol are for type 'reward_model'; a judge speaks /v1/chat/completions")
            if not self.url or not self.model:
                raise _error(f"reward.functions[{label}]: a judge needs url (an OpenAI-compatible API's base url) and model")
            _check_judge_template(self.prompt_template, label)
        if self.api_key_env is not None and not _ENV_NAME.match(self.api_key_env):
            raise _error(f"reward.functions[{label}].api_key_env must be the NAME of an environment variable, not {self.api_key_env[:4]!r}...")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise _error(f"reward.functions[{label}].url must start with http:// or https://, got {self.url!r}")
        return self

    @property
    def label(self) -> str:
        """The reward's name in reward_parts, metrics and errors."""
        return self.name or self.type

    @model_serializer(mode="wrap")
    def _only_the_type_keys(self, handler) -> dict:
        """A written config (config.yaml) holds the keys of the entry's type only."""
        data = handler(self)
        unused = {"function": SERVED_KEYS + JUDGE_KEYS, "reward_model": JUDGE_KEYS, "judge": ("serve", "protocol")}[self.type]
        return {k: v for k, v in data.items() if k not in unused}


def _check_judge_template(template: str, label: str) -> None:
    import string

    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise _error(f"reward.functions[{label}].prompt_template is not a valid template ({err}); write literal braces as {{{{ }}}}") from None
    unknown = sorted(fields - {"prompt", "completion", "answer"})
    if unknown or "completion" not in fields:
        raise _error(
            f"reward.functions[{label}].prompt_template may use {{prompt}} {{completion}} {{answer}} and must use {{completion}}; found {unknown}"
        )


class RewardConfig(_Strict):
    functions: list[RewardFunctionConfig] = [RewardFunctionConfig(name="exact_match")]
    overlong_buffer: int = Field(0, ge=0)  # DAPO soft overlong penalty over the last N tokens; 0: off
    overlong_penalty: float = Field(1.0, ge=0)
    # user functions (module:function) run in a process of the worker's own: a call that takes longer
    # scores 0, is counted in reward_errors, and the process is replaced
    timeout_seconds: float = Field(10.0, gt=0)
    # a function (`type: function`) that fails (raises, returns no finite number, times out or kills its
    # process) scores 0 and is counted; the run stops, naming it, when more than this share of its last
    # `error_window` calls failed (once it has made that many): a broken function would otherwise train on
    # zeros to the end, while one that fails now and then, by design or early in training, trains on. 1: never
    max_error_rate: float = Field(0.99, ge=0, le=1)
    error_window: int = Field(200, gt=0)  # a function's calls the error rate is measured over (the latest ones)
    # user functions' process, and all it starts (sandbox): memory together (a control group where the machine
    # gives one, else resident memory measured), and each call's CPU time (RLIMIT_CPU); None: no limit
    memory_mb: int | None = Field(4096, gt=0)
    cpu_seconds: int | None = Field(60, gt=0)

    @model_validator(mode="after")
    def _labels_differ(self) -> RewardConfig:
        labels = [f.label for f in self.functions]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise _error(f"reward.functions: {repeated} named more than once (give served rewards distinct names)")
        return self


class VLLMConfig(_Strict):
    """vLLM engine settings (rollout.engine: vllm); None leaves vLLM's own default."""

    tensor_parallel_size: int = Field(1, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_gib: float | None = Field(None, gt=0)  # KV-cache size; on CPU the way to bound memory
    max_model_len: int | None = Field(None, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enforce_eager: bool = False
    seed: int | None = None  # None: the run's seed
    platform: Literal["auto", "cpu", "cuda", "ascend"] = "auto"  # ascend: vllm-ascend's image (images/ascend)
    weight_sync: Literal["store", "nccl"] = "store"  # nccl: GPU only, falls back to the store
    # local runs (`tidal run`): "auto" gives the trainer the first GPU/NPU and each worker its own
    # tensor_parallel_size devices when there are enough; "shared": every role sees every device
    placement: Literal["auto", "shared"] = "auto"
    # nccl: how long the trainer waits for every engine to be ready (the first wait spans engine
    # start-up), and for one broadcast, before it turns NCCL off for the run
    nccl_timeout_seconds: float = Field(600.0, gt=0)


# vLLM's max_lora_rank choices (vllm.config.lora.MaxLoRARanks; tests/test_vllm_lora.py keeps them equal): an engine
# serves adapters up to its max rank, so a run's adapter gets the smallest that holds model.lora.r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `r`."""
    return next(rank for rank in VLLM_LORA_RANKS if rank >= r)


# what tidal.envs registers itself (tests/test_envs.py keeps these equal): names that need no import
BUILT_IN_ENVIRONMENTS = ("tools",)
BUILT_IN_TOOLS = ("calc", "python")
BUILT_IN_TOOL_PARSERS = ("hermes",)
AGENT_KEYS = (
    "tools",
    "tool_parser",
    "max_turns",
    "max_tool_calls",
    "max_env_tokens_per_turn",
    "trajectory_timeout_seconds",
    "tool_timeout_seconds",
    "tool_cpu_seconds",
    "tool_memory_mb",
    "tool_output_bytes",
    "tool_processes",
    "tool_latency",
    "python_timeout_seconds",
    "env_timeout_seconds",
    "env_cpu_seconds",
    "env_memory_mb",
    "env_processes",
)
_MODULE_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _error(reason: str) -> PydanticCustomError:
    """A validation error whose text is `reason` alone (a plain ValueError gets pydantic's "Value error, " prefix)."""
    return PydanticCustomError("tidal_config", "{reason}", {"reason": reason})


class ToolLatencyConfig(_Strict):
    """A latency added to every call of rollout.tools (tidal.envs.latency): log-normal with this median
    and this ratio of its 99th percentile to its median (sigma = ln(ratio) / 2.326)."""

    distribution: Literal["lognormal"] = "lognormal"
    p50_seconds: float = Field(gt=0)
    p99_over_p50: float = Field(10.0, ge=1)


class WorkerRange(_Strict):
    """An elastic rollout pool: `tidal run` starts `start` workers and `tidal scale` moves the count
    anywhere in [min, max] while the run goes on (workers join and leave at any moment)."""

    min: PositiveInt = 1  # the fewest workers `tidal scale` may leave running
    max: PositiveInt  # the most workers `tidal scale` may start (tidal plan recommends both)
    # workers at start: unset, `min`; auto, the capacity planner's count (tidal plan) clipped to [min, max]
    start: PositiveInt | Literal["auto"] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise _error(f"min ({self.min}) is above max ({self.max})")
        if isinstance(self.start, int) and not self.min <= self.start <= self.max:
            raise _error(f"start ({self.start}) is outside [min {self.min}, max {self.max}]")
        return self


class RolloutConfig(_Strict):
    engine: Literal["hf", "vllm"] = "hf"
    workers: PositiveInt | Literal["auto"] | WorkerRange = Field(
        1,
        description="rollout workers: a number; `auto`, the capacity planner's split (tidal plan); or a range `{min: 1, max: 4}` "
        "(optionally `start: N` or `start: auto`): an elastic pool `tidal scale` moves within [min, max] (see [Modes](modes.md#an-elastic-rollout-pool)). "
        "A number can be changed by `tidal scale` to any count of at least 1. "
        "The older `rollout.max_workers: M` reads as `{min: 1, max: M, start: <rollout.workers>}`.",
    )
    group_size: int = Field(8, gt=1)
    max_new_tokens: int = Field(12, gt=0)
    temperature: float = Field(1.0, gt=0)
    # HF engine: one generate call holds whole groups up to this many tokens (rows x (prompt + max_new_tokens));
    # on CPU a decode step costs about the same up to a few thousand tokens, and more beyond (docs/benchmarks.md)
    generation_token_budget: int = Field(4096, gt=0)
    groups_per_batch: int | None = Field(None, gt=0)  # cap on groups a worker pulls at once; None: the token budget decides
    # periodic/bounded: the first engine call after new weights holds at most this many groups, so the
    # trainer starts on its first groups sooner; None: as many as the token budget allows
    first_call_groups: int | None = Field(None, gt=0)
    sync_groups_per_call: int | None = Field(None, gt=0)  # sync mode: cap on groups per engine call
    deterministic: bool = False
    threads: PositiveInt | Literal["auto"] | None = None  # None: an even split of the cores; auto: tidal plan's
    max_inflight_groups: int = Field(32, gt=0)  # vllm: groups (n=G requests) in flight per worker
    # mode bounded: work of iterations v+1..v+k is released while the trainer is on v, so a group
    # may come from a policy up to k versions old; 0 is exactly periodic
    max_staleness: int = Field(1, ge=0)
    vllm: VLLMConfig = VLLMConfig()
    # Multi-turn (agentic) rollouts: the environment that answers each assistant turn, `module:Class` (a
    # subclass of tidal.envs.Environment) or the built-in `tools` (tool calls until a turn makes none);
    # unset: one response per prompt. The keys below it apply only with an environment.
    env: str | None = None
    tools: list[str] = []  # tools every trajectory may call: built-in names (calc, python) or `module:function`
    tool_parser: str = "hermes"  # reads a turn's tool calls: a registered parser's name or `module:function`
    max_turns: int = Field(4, gt=0)  # assistant turns per trajectory (each at most max_new_tokens)
    max_tool_calls: int = Field(8, ge=0)  # per trajectory; a call past it gets an error observation
    max_env_tokens_per_turn: int = Field(256, gt=0)  # tokens the environment and template insert after a turn; more are cut
    trajectory_timeout_seconds: float = Field(120.0, gt=0)  # a trajectory still running then ends (finish reason timeout)
    # rollout.tools run in a process of the worker's own (docs/agents.md): a call past this wall-clock
    # time, or past the limits below, is an error the model reads, counted, and the process is replaced
    tool_timeout_seconds: float = Field(30.0, gt=0)
    tool_cpu_seconds: int | None = Field(60, gt=0)  # one tool call's CPU time (RLIMIT_CPU, all its threads); None: no limit
    # the tool process's address space (RLIMIT_AS), its imports included, and the memory of its whole tree
    # together (sandbox); a tool that loads torch or CUDA maps far more than it uses and needs more, or None
    tool_memory_mb: int | None = Field(4096, gt=0)
    tool_output_bytes: int = Field(65536, gt=0)  # a tool's text past this many bytes (UTF-8) is cut, counted
    tool_processes: int = Field(4, gt=0)  # tool calls at once (processes), for engines that step trajectories concurrently
    # a heavy-tailed latency on every call of rollout.tools, in their process (benchmarks: slow tools); None: none
    tool_latency: ToolLatencyConfig | None = None
    # the built-in python tool: one program's wall-clock time, after which its whole process group is
    # killed; it also runs under tool_cpu_seconds, tool_memory_mb and tool_output_bytes (docs/agents.md)
    python_timeout_seconds: float = Field(10.0, gt=0)
    # a user's environment class (rollout.env: module:Class) lives in sandboxed processes of the worker's own
    # (docs/agents.md): one call of its reset, step or reward past this wall-clock time (its own, not its
    # rollout.tools calls'), or past the limits below, ends its trajectory, counted; the process is replaced
    env_timeout_seconds: float = Field(60.0, gt=0)
    env_cpu_seconds: int | None = Field(60, gt=0)  # one call's CPU time (RLIMIT_CPU, all its threads); None: no limit
    env_memory_mb: int | None = Field(4096, gt=0)  # as tool_memory_mb, for an environment process and its whole tree
    env_processes: int = Field(4, gt=0)  # environment processes; each trajectory's instance lives in one, its calls one at a time

    @field_validator("env", "tool_parser")
    @classmethod
    def _named_object(cls, name: str | None, info: ValidationInfo) -> str | None:
        built_in = BUILT_IN_ENVIRONMENTS if info.field_name == "env" else BUILT_IN_TOOL_PARSERS
        if name is None or name in built_in or _MODULE_NAME.match(name):
            return name
        raise _error(f"{name!r} is neither a built-in ({', '.join(built_in)}) nor module:name")

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if n not in BUILT_IN_TOOLS and not _MODULE_NAME.match(n)]
        if bad:
            raise _error(f"{bad}: neither built-in tools ({', '.join(BUILT_IN_TOOLS)}) nor module:function")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise _error(f"{repeated} listed more than once")
        return names

    @field_validator("workers", mode="before")
    @classmethod
    def _one_form_of_workers(cls, value: Any) -> Any:
        """One clear error per form (pydantic would list why every form of the union failed)."""
        if isinstance(value, dict):
            try:
                return WorkerRange.model_validate(value)
            except ValidationError as err:
                raise _error("; ".join((f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"] for e in err.errors())) from None
        if value == "auto" or isinstance(value, WorkerRange) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        raise _error(f"a number of at least 1, 'auto' or a range {{min: 1, max: 4}}, not {value!r}")

    @model_validator(mode="before")
    @classmethod
    def _max_workers_is_a_range(cls, data: Any) -> Any:
        """rollout.max_workers (before the range form): `workers: N, max_workers: M` is `workers: {min: 1, max: M, start: N}`."""
        if not isinstance(data, dict) or data.get("max_workers") is None:
            return data
        data = dict(data)
        bound, workers = data.pop("max_workers"), data.get("workers", 1)
        if isinstance(workers, dict) or isinstance(workers, WorkerRange):
            raise _error("rollout.max_workers and a range in rollout.workers: write the bound once, as rollout.workers: {min: 1, max: M}")
        if isinstance(workers, int) and isinstance(bound, int) and workers > bound:
            raise _error(f"rollout.workers ({workers}) is above rollout.max_workers ({bound})")
        data["workers"] = {"min": 1, "max": bound, "start": workers}
        return data

    @property
    def worker_bounds(self) -> tuple[int, int | None]:
        """(fewest, most) rollout workers `tidal scale` may set; most None: no bound."""
        if isinstance(self.workers, WorkerRange):
            return self.workers.min, self.workers.max
        return 1, None

    @property
    def initial_workers(self) -> int:
        """Workers a run starts with (`auto` not yet resolved by `tidal run`: 1, or the range's min)."""
        if isinstance(self.workers, WorkerRange):
            return self.workers.start if isinstance(self.workers.start, int) else self.workers.min
        return self.workers if isinstance(self.workers, int) else 1

    @property
    def most_workers(self) -> int:
        """The most workers that may run at once as far as the config says (a range's max, else the start)."""
        return self.worker_bounds[1] or self.initial_workers

    @property
    def workers_planned(self) -> bool:
        """Whether `tidal run` asks the capacity planner for the worker count (`auto`, or a range's `start: auto`)."""
        return self.workers == "auto" or (isinstance(self.workers, WorkerRange) and self.workers.start == "auto")

    @model_validator(mode="after")
    def _python_ends_before_its_process(self) -> RolloutConfig:
        # past tool_timeout_seconds the tool's process is killed, and the program's other processes
        # (its own process group) would outlive it: the program's own deadline must come first
        if "python" in self.tools and self.python_timeout_seconds >= self.tool_timeout_seconds:
            raise _error(
                f"rollout.python_timeout_seconds ({self.python_timeout_seconds:g}) must be under rollout.tool_timeout_seconds ({self.tool_timeout_seconds:g})"
            )
        return self

    @model_validator(mode="after")
    def _agent_keys_need_an_env(self) -> RolloutConfig:
        if self.env is None:
            stray = sorted(f"rollout.{k}" for k in self.model_fields_set & set(AGENT_KEYS) if getattr(self, k) != type(self).model_fields[k].default)
            if stray:
                raise _error(f"{', '.join(stray)}: only for multi-turn rollouts; set rollout.env (e.g. 'tools') or leave them out")
        return self


# what tidal.algo registers itself (tests/test_algo_registry.py keeps the two equal)
BUILT_IN_ALGORITHMS = {"advantage": ("dr_grpo", "grpo", "rloo"), "policy_loss": ("gspo", "ppo_clip")}


class TrainerConfig(_Strict):
    iterations: int = Field(30, gt=0)
    prompts_per_iteration: int = Field(16, gt=0)
    updates_per_iteration: int = Field(1, gt=0)  # >1: PPO-style mini-batch steps against the old policy
    lr: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(3, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    advantage: str = "grpo"  # a name registered with tidal.algo.register_advantage
    std_normalize: bool = True  # grpo only
    policy_loss: str = "ppo_clip"  # a name registered with tidal.algo.register_policy_loss
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0)  # DAPO clip-higher; None: same as clip_eps
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    aggregation_constant: float | None = Field(None, gt=0)  # seq_mean_token_sum_norm; None: rollout.max_new_tokens
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # True: KL is a reward penalty instead of a loss term
    reference_device: str | None = None  # e.g. "cpu" to offload the reference; None: with the policy
    tis_cap: float | None = Field(None, gt=0)  # truncated importance sampling vs the engine's log-probs
    # mode bounded: cap of the decoupled-PPO weight pi_proximal / pi_behaviour on stale samples
    # (AReaL's behaviour importance-weight cap); tis_cap, when set, caps every sample instead
    behaviour_weight_cap: float = Field(5.0, gt=0)
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups, replace with new prompts
    max_replacements: int | None = Field(None, ge=0)  # per iteration; None: 4 x prompts_per_iteration
    # shared-prompt kernel; auto: flex on CUDA, else segmented; flex trains on CUDA only
    attention: Literal["auto", "sdpa", "segmented", "flex", "naive"] = "auto"
    token_budget: int = Field(16384, gt=0)  # tokens per packed micro-batch
    device: str = "auto"  # auto: CUDA, else an Ascend NPU, else CPU
    # Several trainer ranks (torchrun): `strategy` auto is single at one rank, fsdp2 above;
    # `ranks` is how many `tidal run` starts on this machine (the PyTorchJob sets its own world size)
    strategy: Literal["auto", "single", "fsdp2", "deepspeed"] = "auto"
    # deepspeed (the `deepspeed` extra): DeepSpeed ZeRO at `zero_stage`; `deepspeed` is a DeepSpeed config
    # passed through (Tidal sets micro-batch, accumulation, optimizer, clipping, stage, dtype: a contradiction is an error)
    zero_stage: Literal[2, 3] = 2
    deepspeed: dict[str, Any] | None = None
    ranks: int = Field(1, gt=0)
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # fsdp2 mixed precision; None: the model's dtype
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # fsdp2 gradient reduction dtype
    cpu_offload: bool = False  # fsdp2: parameters, gradients and optimizer state on the CPU
    activation_checkpointing: bool = False
    threads: PositiveInt | Literal["auto"] | None = None  # None: an even split of the cores; auto: tidal plan's
    # periodic mode: once every group of an iteration is in, the workers wait for the next weights, so the
    # trainer may use their cores for the rest of the iteration. auto: in `tidal run`, its own threads and
    # its workers' together; a number: that many; None: trainer.threads throughout (e.g. a pod)
    tail_threads: PositiveInt | Literal["auto"] | None = "auto"
    group_timeout_seconds: float = Field(600.0, gt=0)
    # optimizer steps a run may skip for a non-finite loss or gradient norm (weights kept) before it fails
    max_skipped_steps: int = Field(3, ge=0)

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _registered_name(cls, name: str, info: ValidationInfo) -> str:
        if name in BUILT_IN_ALGORITHMS[info.field_name]:  # reading a config should not wait for torch
            return name
        from tidal.algo import advantage_fn, policy_loss_fn  # lazy: tidal.algo imports torch

        try:
            (advantage_fn if info.field_name == "advantage" else policy_loss_fn)(name)
        except ValueError as err:  # a custom error keeps the message free of pydantic's "Value error, " prefix
            raise PydanticCustomError("unregistered_name", "{reason}", {"reason": str(err)}) from None
        return name

    @model_validator(mode="after")
    def _deepspeed_passthrough(self) -> TrainerConfig:
        if self.deepspeed is not None and self.strategy != "deepspeed":
            reason = f"trainer.deepspeed is set but trainer.strategy is {self.strategy!r}: it applies to strategy 'deepspeed' only"
            raise PydanticCustomError("deepspeed_config", "{reason}", {"reason": reason})
        if self.strategy == "deepspeed":
            from tidal.trainer.deepspeed_config import check_user_config

            try:
                check_user_config(self)
            except ValueError as err:
                raise PydanticCustomError("deepspeed_config", "{reason}", {"reason": str(err)}) from None
        return self


class EvalConfig(_Strict):
    enabled: bool = True
    num_prompts: int | None = Field(None, gt=0)  # None: the whole held-out split
    max_new_tokens: int | None = Field(None, gt=0)
    batch_size: int = Field(64, gt=0)
    engine: Literal["rollout", "hf", "vllm"] = "rollout"  # rollout: the engine rollout.engine names
    samples_per_prompt: int = Field(4, ge=0)  # sampled accuracy at the rollout temperature; 0: greedy only
    k: list[int] = [1, 4]  # pass@k (unbiased estimator) and maj@k over the samples; each k <= samples_per_prompt
    # evaluate every N-th version while training continues (a separate eval process), so MLflow shows
    # a held-out learning curve (eval/*); None: only before and after the run
    every: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        too_many = [k for k in self.k if k < 1 or k > self.samples_per_prompt] if self.samples_per_prompt else []
        if too_many:
            raise ValueError(f"eval.k {too_many} must each be between 1 and eval.samples_per_prompt ({self.samples_per_prompt})")
        return self


class TrackingConfig(_Strict):
    uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite in the run directory
    experiment: str = "tidal"
    run_name: str | None = None


class TransportConfig(_Strict):
    nats_url: str | None = None  # None: start an embedded nats-server in the run directory
    max_payload_mb: int = Field(8, gt=0, le=64)
    # A worker's in-progress acks (every ack_wait / 3) keep its items; a dead or stopped worker's items go
    # to another worker after this long. Short, so a failure costs seconds, not a minute.
    ack_wait_seconds: float = Field(6.0, gt=0)
    max_deliver: int = Field(5, gt=0)
    # JetStream limits of each of the run's streams (WORK, ROLLOUTS); None: no limit of its own. ROLLOUTS
    # drops its oldest (long acked) groups at a limit; WORK refuses new work there, an error the trainer raises.
    # On Kubernetes the pipeline's finalize step deletes the streams and the KV bucket (tidal.transport.delete_run).
    stream_max_age_hours: float | None = Field(168.0, gt=0)
    stream_max_mb: int | None = Field(4096, gt=0)

    @model_validator(mode="after")
    def _stream_holds_a_message(self) -> TransportConfig:
        if self.stream_max_mb is not None and self.stream_max_mb < 4 * self.max_payload_mb:
            raise ValueError(f"transport.stream_max_mb ({self.stream_max_mb}) must be at least 4 x transport.max_payload_mb ({self.max_payload_mb})")
        return self


class WeightsConfig(_Strict):
    """Retention of weight snapshots (weights/vNNNNNN), and the check that each arrived. Never deleted, whatever
    these say: the current and the previous published version (a worker may still be loading it; in bounded mode
    the whole staleness window), the version the latest checkpoint resumes from, and the version an eval.every
    follower evaluates next."""

    keep_last: int | None = Field(5, ge=1)  # the newest N snapshots; None: keep every snapshot
    keep_every: int | None = Field(None, ge=1)  # also keep every version divisible by N (milestones)
    # The arrival check: the trainer publishes each version with its log-probs of a fixed probe (eight random prompts, each
    # with tokens the base model samples after it; with several ranks every rank runs the probe, rank 0 writes); a rollout
    # worker that loads the version computes the same log-probs with its engine and stops the run, naming the version,
    # when they differ from the trainer's by more than `arrival_tolerance` per token on average. None: 1e-3 where both
    # sides compute in float32 or the HF engine runs the trainer's code; where a side computes in half precision, the
    # larger of 0.02 (float16) / 0.15 (bfloat16) and 6x the engine's own difference on the base model, measured before
    # its first version (docs/vllm.md#the-arrival-check).
    # 0 turns the check off.
    arrival_tolerance: float | None = Field(None, ge=0)


class SandboxConfig(_Strict):
    """What rollout.tools and user reward functions (`module:function`) may do: they run in processes of the
    worker's own, confined by Linux (docs/agents.md#what-user-code-can-do). Whatever is set here, they never
    get the run's secrets or tokens, never read the run directory and never write into it."""

    enabled: bool = True  # false: they run with the worker's environment and rights (a trusted setup); the limits still hold
    env: list[str] = []  # environment variables passed to them by name (an API key a tool needs); nothing else is
    read_paths: list[str] = []  # also readable (a model cache, a data folder), beside the interpreter, the import paths and /usr, /etc, ...
    write_paths: list[str] = []  # also writable, beside their own directory (removed with their process)
    network: bool = False  # true: TCP out (a tool that calls a web API); the run's NATS and MLflow still need credentials they lack
    processes: int = Field(64, gt=0)  # processes at once in one tool or reward process's tree; past it the tree is killed

    @field_validator("env")
    @classmethod
    def _no_run_secrets(cls, names: list[str]) -> list[str]:
        from tidal.sandbox import is_run_secret

        secret = [n for n in names if is_run_secret(n)]
        if secret:
            raise ValueError(f"sandbox.env may not pass the run's own variables to user code: {secret}")
        return names


class TidalConfig(_Strict):
    mode: Literal["sync", "periodic", "bounded"] = "periodic"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    transport: TransportConfig = TransportConfig()
    weights: WeightsConfig = WeightsConfig()
    sandbox: SandboxConfig = SandboxConfig()

    @model_validator(mode="after")
    def _planner_measures_the_hf_engine(self) -> TidalConfig:
        auto = [
            k
            for k, v in (
                ("rollout.workers", "auto" if self.rollout.workers_planned else None),
                ("rollout.threads", self.rollout.threads),
                ("trainer.threads", self.trainer.threads),
            )
            if v == "auto"
        ]
        if auto and self.rollout.engine != "hf":
            raise ValueError(
                f"{', '.join(auto)} 'auto': the capacity planner measures the HF engine on CPU threads; with rollout.engine 'vllm' set a number"
            )
        return self

    @model_validator(mode="after")
    def _agent_runs_fit_their_parts(self) -> TidalConfig:
        ws = self.model.warm_start
        if self.rollout.env is not None and self.model.name_or_path is None and ws.enabled and ws.steps:
            if ws.stop_at_accuracy is not None:
                raise _error("model.warm_start.stop_at_accuracy probes single answers; with rollout.env leave it out (the traces run ws.steps)")
        eval_engine = self.rollout.engine if self.eval.engine == "rollout" else self.eval.engine
        if self.rollout.env is not None and self.eval.enabled and eval_engine != "hf":
            raise _error("eval.engine: held-out evaluation through rollout.env runs on the HF engine; set eval.engine: hf")
        if self.rollout.env is not None and self.reward.overlong_buffer:
            raise _error(
                "reward.overlong_buffer measures one response against rollout.max_new_tokens: with rollout.env "
                "(a trajectory of several turns and observations) set it to 0"
            )
        return self

    def _lora_fits_vllm(self) -> None:
        """model.lora on a vLLM engine (rollout or held-out eval): the adapter must be one vLLM can serve."""
        lora = self.model.lora
        engines = [
            key for key, kind in (("rollout.engine", self.rollout.engine), ("eval.engine", self.eval.engine)) if kind == "vllm"
        ]  # eval follows rollout
        if not engines:
            return
        if lora.r > VLLM_LORA_RANKS[-1]:
            raise _error(f"model.lora.r {lora.r} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); lower it or use the HF engine")
        if lora.modules_to_save:
            raise _error(
                f"model.lora.modules_to_save {lora.modules_to_save}: vLLM serves adapters without whole modules (only classifier heads); "
                f"leave it out or set {' and '.join(engines)} to 'hf'"
            )

    @model_validator(mode="after")
    def _nccl_needs_vllm_workers(self) -> TidalConfig:
        if self.rollout.vllm.weight_sync == "nccl" and (self.rollout.engine != "vllm" or self.mode != "periodic"):
            raise ValueError(
                "rollout.vllm.weight_sync 'nccl' sends weights from the trainer to vLLM rollout workers: "
                "it needs rollout.engine 'vllm' and mode 'periodic' (sync mode's engine loads from the weight store; bounded mode's workers load at their own boundaries)"
            )
        if self.model.lora is not None:
            self._lora_fits_vllm()
        if self.trainer.ranks > 1 and self.mode == "sync":
            raise ValueError("trainer.ranks > 1 needs mode 'periodic' or 'bounded' (sync mode trains in the launcher's one process)")
        if self.trainer.ranks > 1 and self.trainer.strategy == "single":
            raise ValueError("trainer.strategy 'single' is one process: use 'fsdp2' (or 'auto') with trainer.ranks > 1")
        if self.rollout.vllm.weight_sync == "nccl" and self.rollout.vllm.platform in ("ascend", "cpu"):
            raise ValueError(
                f"rollout.vllm.weight_sync 'nccl' needs CUDA GPUs but rollout.vllm.platform is "
                f"{self.rollout.vllm.platform!r}: use weight_sync 'store' (vllm-ascend's HCCL transfer is not wired in)"
            )
        return self

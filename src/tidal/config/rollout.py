"""The `rollout` block: how groups are generated (engine, sampling, workers), and `rollout.agent`, the
multi-turn block (environment, tools and their limits; unset: one response per prompt)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator

from tidal.config.base import Strict, built_in, built_in_or_module, config_error

# vLLM's max_lora_rank choices (vllm.config.lora.MaxLoRARanks; tests/test_vllm_lora.py keeps them equal): an engine
# serves adapters up to its max rank, so a run's adapter gets the smallest that holds model.lora.r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `r`."""
    return next(rank for rank in VLLM_LORA_RANKS if rank >= r)


class VLLMConfig(Strict):
    """vLLM engine settings (rollout.engine: vllm); unset leaves vLLM's own default."""

    tensor_parallel_size: int = Field(1, gt=0, description="Devices per vLLM engine.")
    max_num_seqs: int | None = Field(None, gt=0, description="vLLM's `max_num_seqs`.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of device memory vLLM may take; lower it where the trainer shares the GPU."
    )
    kv_cache_memory_gib: float | None = Field(None, gt=0, description="KV-cache size; on CPU the way to bound memory.")
    max_model_len: int | None = Field(None, gt=0, description="vLLM's `max_model_len`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The dtype vLLM serves in; `auto`: on CPU the trainer's `model.dtype`, on a GPU vLLM's own choice "
        "(bfloat16). See [vLLM](vllm.md#the-serving-dtype).",
    )
    enforce_eager: bool = Field(False, description="vLLM's `enforce_eager` (no CUDA graphs).")
    seed: int | None = Field(None, description="Unset: the run's seed.")
    platform: Literal["auto", "cpu", "cuda", "ascend"] = Field("auto", description="ascend: vllm-ascend's image (images/ascend).")
    weight_sync: Literal["store", "nccl"] = Field("store", description="nccl: GPU only, falls back to the store.")
    placement: Literal["auto", "shared"] = Field(
        "auto",
        description='Local runs (`tidal run`): "auto" gives the trainer the first GPU/NPU and each worker its own '
        'tensor_parallel_size devices when there are enough; "shared": every role sees every device.',
    )
    nccl_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="nccl: how long the trainer waits for every engine to be ready (the first wait spans engine start-up), "
        "and for one broadcast, before it turns NCCL off for the run.",
    )


class ToolLatencyConfig(Strict):
    """A latency added to every call of rollout.agent.tools (tidal.envs.latency): log-normal with this median
    and this ratio of its 99th percentile to its median (sigma = ln(ratio) / 2.326)."""

    distribution: Literal["lognormal"] = Field("lognormal", description="The latency's distribution.")
    p50_seconds: float = Field(gt=0, description="The median latency, in seconds.")
    p99_over_p50: float = Field(10.0, ge=1, description="The 99th percentile over the median: how heavy the tail is.")


# apply_chat_template's own arguments: Tidal sets them for every rendering
_RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
    }
)


class AgentConfig(Strict):
    """Multi-turn (agentic) rollouts: an environment answers each assistant turn, until it says done or a limit
    ends the trajectory. Unset (`rollout.agent` absent): one response per prompt."""

    env: str = Field(
        description="The environment: `module:Class` (a subclass of tidal.envs.Environment) or a built-in (`tools`: tool calls "
        "until a turn makes none).",
        json_schema_extra=built_in("environment"),
    )
    tools: list[str] = Field(
        [], description="Tools every trajectory may call: built-in names or `module:function`.", json_schema_extra=built_in("tool")
    )
    tool_parser: str = Field(
        "hermes",
        description="Reads a turn's tool calls: a registered parser's name or `module:function`.",
        json_schema_extra=built_in("tool-call parser"),
    )
    max_turns: int = Field(4, gt=0, description="Assistant turns per trajectory (each at most rollout.max_new_tokens).")
    max_tool_calls: int = Field(8, ge=0, description="Tool calls per trajectory; a call past it gets an error observation.")
    max_env_tokens_per_turn: int = Field(256, gt=0, description="Tokens the environment and template insert after a turn; more are cut.")
    chat_template_kwargs: dict[str, str | int | float | bool] = Field(
        {},
        description="Extra variables for the model's chat template, passed to every rendering of the prompt and of the "
        "inserted tokens, e.g. `{enable_thinking: false}` for Qwen3's template (its generation prompt then closes an empty "
        "reasoning block); empty: the template's defaults ([agents](agents.md#thinking-models)).",
    )
    trajectory_timeout_seconds: float = Field(120.0, gt=0, description="A trajectory still running then ends (finish reason timeout).")
    tool_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="The tools run in a process of the worker's own ([agents](agents.md)): a call past this wall-clock time, "
        "or past the limits below, is an error the model reads, counted, and the process is replaced.",
    )
    tool_cpu_seconds: int | None = Field(60, gt=0, description="One tool call's CPU time (RLIMIT_CPU, all its threads); unset: no limit.")
    tool_memory_mb: int | None = Field(
        4096,
        gt=0,
        description="The tool process's address space (RLIMIT_AS), its imports included, and the memory of its whole tree "
        "together (sandbox); a tool that loads torch or CUDA maps far more than it uses and needs more, or unset.",
    )
    tool_output_bytes: int = Field(65536, gt=0, description="A tool's text past this many bytes (UTF-8) is cut, counted.")
    tool_processes: int = Field(4, gt=0, description="Tool calls at once (processes), for engines that step trajectories concurrently.")
    tool_latency: ToolLatencyConfig | None = Field(
        None, description="A heavy-tailed latency on every tool call, in their process (benchmarks: slow tools); unset: none."
    )
    python_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="The built-in python tool: one program's wall-clock time, after which its whole process group is killed; "
        "it also runs under tool_cpu_seconds, tool_memory_mb and tool_output_bytes ([agents](agents.md)).",
    )
    env_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="A user's environment class (`env: module:Class`) lives in sandboxed processes of the worker's own "
        "([agents](agents.md)): one call of its reset, step or reward past this wall-clock time (its own, not its tools' calls), "
        "or past the limits below, ends its trajectory, counted; the process is replaced.",
    )
    env_cpu_seconds: int | None = Field(60, gt=0, description="One environment call's CPU time (RLIMIT_CPU, all its threads); unset: no limit.")
    env_memory_mb: int | None = Field(4096, gt=0, description="As tool_memory_mb, for an environment process and its whole tree.")
    env_processes: int = Field(4, gt=0, description="Environment processes; each trajectory's instance lives in one, its calls one at a time.")

    @field_validator("env")
    @classmethod
    def _environment(cls, name: str) -> str:
        return built_in_or_module("environment", name)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict) -> dict:
        taken = sorted(set(kwargs) & _RENDER_ARGUMENTS)
        if taken:
            raise config_error(f"{taken} are set by Tidal's own rendering, not template variables")
        return kwargs

    @field_validator("tool_parser")
    @classmethod
    def _parser(cls, name: str) -> str:
        return built_in_or_module("tool-call parser", name)

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, names: list[str]) -> list[str]:
        for name in names:
            built_in_or_module("tool", name)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise config_error(f"{repeated} listed more than once")
        return names

    @model_validator(mode="after")
    def _python_ends_before_its_process(self) -> AgentConfig:
        # past tool_timeout_seconds the tool's process is killed, and the program's other processes
        # (its own process group) would outlive it: the program's own deadline must come first
        if "python" in self.tools and self.python_timeout_seconds >= self.tool_timeout_seconds:
            raise config_error(
                f"rollout.agent.python_timeout_seconds ({self.python_timeout_seconds:g}) must be under "
                f"rollout.agent.tool_timeout_seconds ({self.tool_timeout_seconds:g})"
            )
        return self


class WorkerRange(Strict):
    """An elastic rollout pool: `tidal run` starts `start` workers and `tidal scale` moves the count
    anywhere in [min, max] while the run goes on (workers join and leave at any moment)."""

    min: PositiveInt = Field(1, description="The fewest workers `tidal scale` may leave running.")
    max: PositiveInt = Field(description="The most workers `tidal scale` may start (tidal plan recommends both).")
    start: PositiveInt | Literal["auto"] | None = Field(
        None, description="Workers at start: unset, `min`; auto, the capacity planner's count (tidal plan) clipped to [min, max]."
    )

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise config_error(f"min ({self.min}) is above max ({self.max})")
        if isinstance(self.start, int) and not self.min <= self.start <= self.max:
            raise config_error(f"start ({self.start}) is outside [min {self.min}, max {self.max}]")
        return self


class RolloutConfig(Strict):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="`hf`: transformers generation in the worker; `vllm`: vLLM's AsyncLLM. See [vLLM](vllm.md)."
    )
    workers: PositiveInt | Literal["auto"] | WorkerRange = Field(
        1,
        description="Rollout workers: a number; `auto`, the capacity planner's split (tidal plan); or a range `{min: 1, max: 4}` "
        "(optionally `start: N` or `start: auto`): an elastic pool `tidal scale` moves within [min, max] (see [Modes](modes.md#an-elastic-rollout-pool)). "
        "A number can be changed by `tidal scale` to any count of at least 1. "
        "The older `rollout.max_workers: M` reads as `{min: 1, max: M, start: <rollout.workers>}`.",
    )
    group_size: int = Field(8, gt=1, description="G: samples per prompt (one group).")
    max_new_tokens: int = Field(12, gt=0, description="Longest response (with rollout.agent: longest turn), in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (no top-p or top-k).")
    generation_token_budget: int = Field(
        4096,
        gt=0,
        description="HF engine: one generate call holds whole groups up to this many tokens (rows x (prompt + max_new_tokens)); "
        "on CPU a decode step costs about the same up to a few thousand tokens, and more beyond ([benchmarks](benchmarks.md)).",
    )
    groups_per_batch: int | None = Field(None, gt=0, description="Cap on groups a worker pulls at once; unset: the token budget decides.")
    first_call_groups: int | None = Field(
        None,
        gt=0,
        description="periodic/bounded: the first engine call after new weights holds at most this many groups, so the trainer "
        "starts on its first groups sooner (with rollout.agent on the HF engine the pull's other groups join that call as its "
        "groups end); unset: as many as the token budget allows.",
    )
    sync_groups_per_call: int | None = Field(None, gt=0, description="Sync mode: cap on groups per engine call.")
    deterministic: bool = Field(
        False,
        description="Every group a function of (seed, iteration, prompt id) alone: sync, periodic and bounded with "
        "`max_staleness` 0 then train the same weights.",
    )
    threads: PositiveInt | Literal["auto"] | None = Field(
        None,
        description="Torch threads per rollout worker. Unset: an even split of the cores; auto: tidal plan's. Sync mode (HF engine): "
        "the threads it generates with, the trainer's in between; unset: one for multi-turn calls on CPU (their decode steps hop "
        "between threads, where a second thread costs more than it gains: [benchmarks](benchmarks.md)), else the trainer's.",
    )
    max_inflight_groups: int = Field(32, gt=0, description="vllm: groups (n=G requests) in flight per worker.")
    max_staleness: int = Field(
        1,
        ge=0,
        description="Mode bounded: work of iterations v+1..v+k is released while the trainer is on v, so a group may come from "
        "a policy up to k versions old; 0 is exactly periodic.",
    )
    partial: bool = Field(
        False,
        description="Mode bounded: when a newer version is published while a group is being generated, the worker stops it (HF: "
        "between decode steps; vLLM: aborts the requests), loads the version and continues the same responses (with rollout.agent, "
        "the same trajectories: no turn or tool call again) with it; every sampled token carries the version that "
        "sampled it. See [Modes](modes.md#partial-rollouts).",
    )
    vllm: VLLMConfig = Field(VLLMConfig(), description="vLLM engine settings (`engine: vllm`).")
    agent: AgentConfig | None = Field(
        None, description="Multi-turn (agentic) rollouts: the environment, its tools and their limits; unset: one response per prompt."
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _one_form_of_workers(cls, value: Any) -> Any:
        """One clear error per form (pydantic would list why every form of the union failed)."""
        if isinstance(value, dict):
            try:
                return WorkerRange.model_validate(value)
            except ValidationError as err:
                raise config_error("; ".join((f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"] for e in err.errors())) from None
        if value == "auto" or isinstance(value, WorkerRange) or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        raise config_error(f"a number of at least 1, 'auto' or a range {{min: 1, max: 4}}, not {value!r}")

    @model_validator(mode="before")
    @classmethod
    def _max_workers_is_a_range(cls, data: Any) -> Any:
        """rollout.max_workers (before the range form): `workers: N, max_workers: M` is `workers: {min: 1, max: M, start: N}`."""
        if not isinstance(data, dict) or data.get("max_workers") is None:
            return data
        data = dict(data)
        bound, workers = data.pop("max_workers"), data.get("workers", 1)
        if isinstance(workers, dict) or isinstance(workers, WorkerRange):
            raise config_error("rollout.max_workers and a range in rollout.workers: write the bound once, as rollout.workers: {min: 1, max: M}")
        if isinstance(workers, int) and isinstance(bound, int) and workers > bound:
            raise config_error(f"rollout.workers ({workers}) is above rollout.max_workers ({bound})")
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

"""The `reward` block: `reward.functions` entries are one of three kinds, told apart by `type` (a discriminated
union: each kind is its own model with only its keys, so a key of another kind is refused), and the limits of
user reward functions."""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from tidal.config.base import ENV_NAME, Strict, built_in, built_in_or_module, config_error

RewardOutput = Literal["logit", "sigmoid", "binary"]  # what a served reward model's score is (tidal serve-reward --output too)
DEFAULT_JUDGE_TEMPLATE = (
    "You grade an answer to a problem.\n\nProblem:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\nIs the answer to grade correct? Reply with yes or no only."
)


class ServeRewardModelConfig(Strict):
    """`tidal run` starts a reward server (`tidal serve-reward`) for this entry, beside nats-server,
    and stops it with the run; the entry's url is then the server's."""

    model: str | None = Field(
        None,
        description="A Hugging Face directory of an AutoModelForSequenceClassification; unset: the built-in tiny reward model "
        "of the arithmetic task (trained from the warm start on right vs wrong answers, cached).",
    )
    port: int | None = Field(None, gt=0, lt=65536, description="The server's port on 127.0.0.1; unset: a free one.")
    batch_size: int = Field(64, gt=0, description="Rows per forward pass on the server.")
    output: RewardOutput = Field(
        "logit",
        description="The reward: the model's first logit, its sigmoid, or binary: 1 when the logit is positive (the classifier's "
        "verdict; a policy cannot climb the score's small differences), else 0.",
    )
    threads: int = Field(
        1,
        gt=0,
        description="Torch threads of the server on CPU: it shares the cores with the run's roles, and a small model's forward "
        "pass gains nothing from threads that wait on each other.",
    )


class _Entry(Strict):
    type: str
    name: str | None = Field(None, description="The reward's name in reward_parts and the logs; unset: its type.")
    weight: float = Field(1.0, description="This reward's weight in the summed reward.")

    @property
    def label(self) -> str:
        """The reward's name in reward_parts, metrics and errors."""
        return self.name or self.type


class FunctionRewardConfig(_Entry):
    """`type: function` (the default): a reward function run by the rollout worker, `fn(completion, answer) -> float`."""

    type: Literal["function"] = Field("function", description="`function`: `name` is a built-in reward or `module:function`.")
    name: str = Field(
        description="A built-in reward function or `module:function` (run in a sandboxed process of the worker's own).",
        json_schema_extra=built_in("reward function"),
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        return built_in_or_module("reward function", name)


class _ServedEntry(_Entry):
    """The keys of a reward behind HTTP."""

    url: str | None = None
    model: str | None = None
    concurrency: int = Field(4, gt=0, description="Requests in flight at once per worker.")
    timeout_seconds: float = Field(60.0, gt=0, description="One request's time limit.")
    retries: int = Field(3, ge=0, description="Retries after a timeout, 5xx/429, a refused or dropped connection, or an unusable answer.")
    backoff: float = Field(0.5, ge=0, description="Seconds before the first retry, doubled for each next one.")
    api_key_env: str | None = Field(None, description="The NAME of an environment variable holding the API key (sent as a Bearer token).")
    max_error_rate: float = Field(
        0.2,
        ge=0,
        le=1,
        description="The run stops, naming the endpoint, when more than this share of the last `error_window` requests failed "
        "after their retries (a failed request scores its samples 0, counted in reward_errors).",
    )
    error_window: int = Field(20, gt=0, description="Requests the error rate is measured over (the latest ones).")

    @model_validator(mode="after")
    def _a_variable_name(self) -> _ServedEntry:
        # a check of the entry, not of the key: its error never shows the value (which may be the key itself)
        if self.api_key_env is not None and not ENV_NAME.match(self.api_key_env):
            raise config_error(f"api_key_env must be the NAME of an environment variable, not {self.api_key_env[:4]!r}...")
        return self

    @field_validator("url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise config_error("must start with http:// or https://")
        return url


class RewardModelConfig(_ServedEntry):
    """`type: reward_model`: a reward model behind HTTP, at `url` or served by `tidal run` itself (`serve`)."""

    type: Literal["reward_model"] = Field(
        "reward_model", description="`reward_model`: a model behind HTTP (see [Rewards from served models](served-rewards.md))."
    )
    url: str | None = Field(None, description="The endpoint (openrlhf: the POST url; vllm_classify: the server's base url, `/classify` is added).")
    model: str | None = Field(None, description="vllm_classify: the served model's name, sent with each request.")
    protocol: Literal["openrlhf", "vllm_classify"] = Field(
        "openrlhf", description="openrlhf (`{query, prompts, labels}` -> `{rewards}`) or vllm_classify (vLLM's `/classify`)."
    )
    batch_size: int = Field(32, gt=0, description="Samples per request, across groups.")
    serve: ServeRewardModelConfig | None = Field(None, description="`tidal run` serves `serve.model` itself (instead of `url`).")

    @model_validator(mode="after")
    def _one_endpoint(self) -> RewardModelConfig:
        if (self.url is None) == (self.serve is None):
            raise config_error("a reward_model needs exactly one of url (a running server) and serve (tidal run starts one)")
        if self.protocol == "vllm_classify" and not self.model:
            raise config_error("protocol 'vllm_classify' needs model (the served model's name)")
        return self


class JudgeRewardConfig(_ServedEntry):
    """`type: judge`: an LLM judge behind an OpenAI-compatible API (one sample per request, `/chat/completions`)."""

    type: Literal["judge"] = Field("judge", description="`judge`: an LLM behind an OpenAI-compatible API grades each sample.")
    url: str = Field(description="The base url of an OpenAI-compatible API (`/chat/completions` is added).")
    model: str = Field(description="The served model's name, sent with each request.")
    prompt_template: str = Field(DEFAULT_JUDGE_TEMPLATE, description="The rubric, with {prompt} {completion} {answer}; literal braces as {{ }}.")
    score: Literal["number", "yes_no", "json"] = Field(
        "yes_no",
        description="How a reply becomes a score: number (the last number in it), yes_no (yes 1, no 0), json (the field "
        "`score_field` of the JSON object in it; true/false count as 1/0).",
    )
    score_field: str = Field("score", description="score json: the verdict's field.")
    samples: int = Field(1, gt=0, description="Replies per sample (the request's n), averaged.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; with rollout.deterministic 0, and the request carries the run's seed.")
    max_tokens: int = Field(256, gt=0, description="The longest reply.")

    @field_validator("prompt_template")
    @classmethod
    def _judge_template(cls, template: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as err:
            raise config_error(f"not a valid template ({err}); write literal braces as {{{{ }}}}") from None
        unknown = sorted(fields - {"prompt", "completion", "answer"})
        if unknown or "completion" not in fields:
            raise config_error(f"may use {{prompt}} {{completion}} {{answer}} and must use {{completion}}; found {unknown}")
        return template


REWARD_TYPES = {"function": FunctionRewardConfig, "reward_model": RewardModelConfig, "judge": JudgeRewardConfig}


def _entry_type(entry: Any) -> str | None:
    """The tag of an entry: its `type`, `function` when it has none."""
    return entry.get("type", "function") if isinstance(entry, dict) else getattr(entry, "type", None)


RewardFunctionConfig = Annotated[
    Annotated[FunctionRewardConfig, Tag("function")] | Annotated[RewardModelConfig, Tag("reward_model")] | Annotated[JudgeRewardConfig, Tag("judge")],
    Discriminator(
        _entry_type,
        custom_error_type="reward_type",
        custom_error_message="type must be 'function', 'reward_model' or 'judge'",
    ),
]
ServedRewardConfig = RewardModelConfig | JudgeRewardConfig


class RewardConfig(Strict):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [FunctionRewardConfig(name="exact_match")],
        description="The rewards, summed with their weights: functions, reward models and judges (`type`).",
    )
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty over the last N tokens; 0: off.")
    overlong_penalty: float = Field(
        1.0, ge=0, description="The penalty at the length limit; it grows linearly over the last `overlong_buffer` tokens."
    )
    timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="User functions (module:function) run in a process of the worker's own: a call that takes longer scores 0, "
        "is counted in reward_errors, and the process is replaced.",
    )
    max_error_rate: float = Field(
        0.99,
        ge=0,
        le=1,
        description="A function (`type: function`) that fails (raises, returns no finite number, times out or kills its process) "
        "scores 0 and is counted; the run stops, naming it, when more than this share of its last `error_window` calls failed "
        "(once it has made that many): a broken function would otherwise train on zeros to the end, while one that fails now "
        "and then, by design or early in training, trains on. 1: never.",
    )
    error_window: int = Field(200, gt=0, description="A function's calls the error rate is measured over (the latest ones).")
    memory_mb: int | None = Field(
        4096,
        gt=0,
        description="User functions' process, and all it starts (sandbox): memory together (a control group where the machine "
        "gives one, else resident memory measured); unset: no limit.",
    )
    cpu_seconds: int | None = Field(60, gt=0, description="Each call's CPU time (RLIMIT_CPU) of a user function; unset: no limit.")

    @model_validator(mode="after")
    def _labels_differ(self) -> RewardConfig:
        labels = [f.label for f in self.functions]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise config_error(f"reward.functions: {repeated} named more than once (give served rewards distinct names)")
        return self

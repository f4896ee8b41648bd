"""The config schema: one strict pydantic model per block, validated with errors that name the key. The big
blocks have modules of their own (model, reward, rollout, trainer); this one holds the top level, the small
blocks, and the rules that involve several blocks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from tidal.config.base import ConfigError, Strict, config_error  # noqa: F401
from tidal.config.model import DataConfig, LoraConfig, ModelConfig, TinyModelConfig, WarmStartConfig  # noqa: F401
from tidal.config.reward import (  # noqa: F401
    FunctionRewardConfig,
    JudgeRewardConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    ServedRewardConfig,
    ServeRewardModelConfig,
)
from tidal.config.rollout import (  # noqa: F401
    VLLM_LORA_RANKS,
    AgentConfig,
    RolloutConfig,
    ToolLatencyConfig,
    VLLMConfig,
    WorkerRange,
    vllm_max_lora_rank,
)
from tidal.config.trainer import TrainerConfig


class EvalConfig(Strict):
    enabled: bool = Field(True, description="Held-out evaluation before and after the run.")
    num_prompts: int | None = Field(None, gt=0, description="Held-out prompts evaluated; unset: the whole held-out split.")
    max_new_tokens: int | None = Field(None, gt=0, description="Longest held-out response; unset: `rollout.max_new_tokens`.")
    batch_size: int = Field(64, gt=0, description="Held-out prompts per generate call.")
    engine: Literal["rollout", "hf", "vllm"] = Field("rollout", description="rollout: the engine rollout.engine names.")
    samples_per_prompt: int = Field(4, ge=0, description="Sampled accuracy at the rollout temperature; 0: greedy only.")
    k: list[int] = Field([1, 4], description="pass@k (unbiased estimator) and maj@k over the samples; each k <= samples_per_prompt.")
    every: int | None = Field(
        None,
        gt=0,
        description="Evaluate every N-th version while training continues (a separate eval process), so MLflow shows a "
        "held-out learning curve (eval/*); unset: only before and after the run.",
    )
    threads: PositiveInt | None = Field(
        None,
        description="Torch threads of the eval.every process; unset: torch's default. `tidal run` sets it in the run's "
        "config.yaml: the cores over the rollout workers plus two.",
    )

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        too_many = [k for k in self.k if k < 1 or k > self.samples_per_prompt] if self.samples_per_prompt else []
        if too_many:
            raise ValueError(f"eval.k {too_many} must each be between 1 and eval.samples_per_prompt ({self.samples_per_prompt})")
        return self


class TrackingConfig(Strict):
    uri: str | None = Field(None, description="The MLflow tracking URI; unset: `$MLFLOW_TRACKING_URI`, else sqlite in the run directory.")
    experiment: str = Field("tidal", description="MLflow experiment.")
    run_name: str | None = Field(None, description="MLflow run name; unset: the run directory's name.")


class TransportConfig(Strict):
    nats_url: str | None = Field(None, description="Unset: start an embedded nats-server in the run directory.")
    max_payload_mb: int = Field(8, gt=0, le=64, description="Largest message (a group), in MB; also the embedded nats-server's `max_payload`.")
    ack_wait_seconds: float = Field(
        6.0,
        gt=0,
        description="A worker's in-progress acks (every ack_wait / 3) keep its items; a dead or stopped worker's items go to "
        "another worker after this long. Short, so a failure costs seconds, not a minute.",
    )
    max_deliver: int = Field(
        5, gt=0, description="Times JetStream hands out one work item; a work item that reaches it fails the run, naming the item."
    )
    stream_max_age_hours: float | None = Field(
        168.0,
        gt=0,
        description="JetStream limits of each of the run's streams (WORK, ROLLOUTS); unset: no limit of its own. ROLLOUTS drops "
        "its oldest (long acked) groups at a limit; WORK refuses new work there, an error the trainer raises. On Kubernetes "
        "the pipeline's finalize step deletes the streams and the KV bucket (tidal.transport.delete_run).",
    )
    stream_max_mb: int | None = Field(4096, gt=0, description="Size cap of each of the run's streams, in MB (see `stream_max_age_hours`).")

    @model_validator(mode="after")
    def _stream_holds_a_message(self) -> TransportConfig:
        if self.stream_max_mb is not None and self.stream_max_mb < 4 * self.max_payload_mb:
            raise ValueError(f"transport.stream_max_mb ({self.stream_max_mb}) must be at least 4 x transport.max_payload_mb ({self.max_payload_mb})")
        return self


class WeightsConfig(Strict):
    """Retention of weight snapshots (weights/vNNNNNN), and the check that each arrived. Never deleted, whatever
    these say: the current and the previous published version (a worker may still be loading it; in bounded mode
    the whole staleness window), the version the latest checkpoint resumes from, and the version an eval.every
    follower evaluates next."""

    keep_last: int | None = Field(5, ge=1, description="The newest N snapshots; unset: keep every snapshot.")
    keep_every: int | None = Field(None, ge=1, description="Also keep every version divisible by N (milestones).")
    arrival_tolerance: float | None = Field(
        None,
        ge=0,
        description="The arrival check: the trainer publishes each version with its log-probs of a fixed probe (eight random "
        "prompts, each with tokens the base model samples after it; with several ranks every rank runs the probe, rank 0 "
        "writes); a rollout worker that loads the version computes the same log-probs with its engine and stops the run, "
        "naming the version, when they differ from the trainer's by more than `arrival_tolerance` per token on average. "
        "Unset: 1e-3 where both sides compute in float32 or the HF engine runs the trainer's code; where a side computes in "
        "half precision, the larger of 0.02 (float16) / 0.15 (bfloat16) and 6x the engine's own difference on the base "
        "model, measured before its first version ([vLLM](vllm.md#the-arrival-check)). 0 turns the check off. Sync mode on "
        "the HF engine publishes no probe: its engine generates with the trainer's own weights and loads no version.",
    )
    public_key_file: str | None = Field(
        None,
        description="The file holding the public key that every role checks each snapshot's signature with; unset: the run "
        "directory's weights-public-key, which `tidal run` writes on the run's first launch. The pipeline sets it to the "
        "ConfigMap mounted into its pods.",
    )
    signing_key_file: str | None = Field(
        None,
        description="The file holding the trainer's private key, which signs each snapshot (read by trainer processes alone); "
        "unset: the run directory's weights-signing-key. The pipeline sets it to the Secret mounted into trainer pods alone.",
    )


class SandboxConfig(Strict):
    """What rollout.agent.tools and user reward functions (`module:function`) may do: they run in processes of the
    worker's own, confined by Linux (docs/agents.md#what-user-code-can-do). Whatever is set here, they never
    get the run's secrets or tokens, never read the run directory and never write into it."""

    enabled: bool = Field(True, description="false: they run with the worker's environment and rights (a trusted setup); the limits still hold.")
    env: list[str] = Field([], description="Environment variables passed to them by name (an API key a tool needs); nothing else is.")
    read_paths: list[str] = Field(
        [], description="Also readable (a model cache, a data folder), beside the interpreter, the import paths and /usr, /etc, ..."
    )
    write_paths: list[str] = Field([], description="Also writable, beside their own directory (removed with their process).")
    network: bool = Field(
        False, description="true: TCP out (a tool that calls a web API); the run's NATS and MLflow still need credentials they lack."
    )
    processes: int = Field(64, gt=0, description="Processes at once in one tool or reward process's tree; past it the tree is killed.")

    @field_validator("env")
    @classmethod
    def _no_run_secrets(cls, names: list[str]) -> list[str]:
        from tidal.sandbox import is_run_secret

        secret = [n for n in names if is_run_secret(n)]
        if secret:
            raise ValueError(f"sandbox.env may not pass the run's own variables to user code: {secret}")
        return names


class TidalConfig(Strict):
    mode: Literal["sync", "periodic", "bounded"] = Field(
        "periodic",
        description="How groups reach the trainer: `sync` generates and trains in turn in one process; `periodic` streams "
        "groups from rollout workers over NATS, weights change only at iteration boundaries (staleness 0); `bounded` lets "
        "workers run up to `rollout.max_staleness` versions ahead. See [Modes](modes.md).",
    )
    seed: int = Field(0, description="Seeds the prompt order of every iteration, sampling, the synthetic data and the tiny model's warm start.")
    model: ModelConfig = Field(ModelConfig(), description="The policy model: a directory or hub id, or the built-in tiny model; dtype; LoRA.")
    data: DataConfig = Field(DataConfig(), description="The problems: synthetic arithmetic or jsonl rows, and the prompt the model sees.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The rewards and the limits of user reward functions.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Generation: engine, sampling, rollout workers, and multi-turn `agent`.")
    trainer: TrainerConfig = Field(TrainerConfig(), description="The algorithm, its optimizer, and how the trainer runs.")
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow tracking.")
    transport: TransportConfig = Field(TransportConfig(), description="NATS JetStream between the trainer and the rollout workers.")
    weights: WeightsConfig = Field(WeightsConfig(), description="Retention of weight snapshots, and the check that each arrived.")
    sandbox: SandboxConfig = Field(SandboxConfig(), description="What tools and user reward functions may do.")

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
    def _images_need_a_vision_model(self) -> TidalConfig:
        if self.data.task == "count_squares" and self.model.name_or_path is None and self.model.tiny.arch != "qwen2_vl":
            raise config_error(
                "data.task 'count_squares' has images: set model.tiny.arch: qwen2_vl (the tiny vision-language model) "
                "or a vision-language model in model.name_or_path"
            )
        return self

    @model_validator(mode="after")
    def _agent_runs_fit_their_parts(self) -> TidalConfig:
        if self.rollout.agent is None:
            return self
        ws = self.model.warm_start
        if self.model.name_or_path is None and ws.enabled and ws.steps and ws.stop_at_accuracy is not None:
            raise config_error("model.warm_start.stop_at_accuracy probes single answers; with rollout.agent leave it out (the traces run ws.steps)")
        eval_engine = self.rollout.engine if self.eval.engine == "rollout" else self.eval.engine
        if self.eval.enabled and eval_engine != "hf":
            raise config_error("eval.engine: held-out evaluation through rollout.agent runs on the HF engine; set eval.engine: hf")
        if self.reward.overlong_buffer:
            raise config_error(
                "reward.overlong_buffer measures one response against rollout.max_new_tokens: with rollout.agent "
                "(a trajectory of several turns and observations) set it to 0"
            )
        return self

    @model_validator(mode="after")
    def _length_tail_on_the_text_warm_starts(self) -> TidalConfig:
        if self.model.warm_start.length_tail is None or self.model.name_or_path is not None:
            return self
        if self.model.tiny.arch == "qwen2_vl":
            raise config_error(
                "model.warm_start.length_tail pads the tiny text model's answers; the tiny vision-language model's warm start has none"
            )
        return self

    @model_validator(mode="after")
    def _partial_rollouts_in_bounded_mode(self) -> TidalConfig:
        if not self.rollout.partial:
            return self
        if self.mode != "bounded":
            raise config_error(f"rollout.partial needs mode 'bounded' (mode {self.mode!r} trains each iteration on its own weights alone)")
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
            raise config_error(f"model.lora.r {lora.r} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); lower it or use the HF engine")
        if lora.modules_to_save:
            raise config_error(
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

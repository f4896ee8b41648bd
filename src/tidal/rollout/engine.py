"""The engine interface and the HF transformers engine (batched decoding with a KV cache)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tidal.blocking import run_blocking
from tidal.images import ImageInputs
from tidal.rollout.hf_rows import INTERRUPTED, HFRows, gumbel_sample, returned_cache, turn_seed
from tidal.rollout.refresh import Refresh
from tidal.rollout.trajectory import Responder, RowDone, RowFeed, TrajectoryTokens, play_rows

__all__ = ["INTERRUPTED", "gumbel_sample", "returned_cache", "turn_seed"]  # their home is hf_rows; callers import them from here


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # per token, under the processed (temperature-scaled) distribution
    finish_reason: str  # "stop" (EOS) or "length"; INTERRUPTED: stopped between tokens for new weights (rollout.partial)
    versions: list[int] | None = None  # per token, the policy version that sampled it (rollout.partial); None: the call's


Interrupt = Callable[[], bool]  # asked between decode steps: True stops the unfinished rows there (tidal.rollout.partial)


@dataclass
class GroupRequest:
    prompt_ids: list[int]
    n: int
    generator: torch.Generator | None = None  # per-group RNG (HF engine): deterministic, batch-independent samples
    seed: int | None = None  # the same for vLLM (a per-request seed); None: the engine's own RNG
    images: ImageInputs | None = None  # the prompt's processed images (HF engine): encoded once, in the group's shared prefill
    image_files: list[bytes] | None = None  # the same images' files (vLLM processes them itself, once for the n=G request)


class RolloutEngine(Protocol):
    """What a rollout worker drives, async; both engines declare it (HFEngine runs its blocking calls on
    a thread, VLLMEngine is async at heart). Callers never ask which engine they hold."""

    kind: str  # "hf" or "vllm": the arrival check's default tolerance depends on it
    # `play` takes `feed` (trajectory.RowFeed): groups join a running call (the HF engine's; vLLM schedules its requests itself)
    joins_running_calls: bool = False

    @property
    def context_length(self) -> int | None:
        """The longest sequence (prompt and generated tokens) the engine's model takes, when known."""

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        """The dtypes the engine computes in besides the trainer's (the arrival check's tolerance)."""

    async def complete(
        self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None, tag: str = "b"
    ) -> list[list[Completion]]:
        """One response per row, G rows per request, grouped by request."""

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
        """One multi-turn trajectory per row (G per request, in order): see tidal.rollout.trajectory.
        `on_done(row, tokens)` is told of each trajectory as it ends (on the engine's event loop).
        `refresh` (rollout.partial): the rows go on with newer weights published meanwhile."""

    async def probe(self, sequences: list[dict]) -> list[list[float]]:
        """The arrival check's probe: each response token's log-prob given what precedes it (temperature 1)."""

    async def load_weights(self, path: str) -> dict:
        """Loads weight-store snapshot `path` (checksums verified). {"loaded": n, "probe": the manifest's
        probe record or None}, or {"error": why, "partial": whether tensors were loaded before it failed}."""

    def shutdown(self) -> None: ...


class BlockingEngine(RolloutEngine, Protocol):
    """An engine that also answers without an event loop (HFEngine, BlockingVLLMEngine): held-out eval."""

    def generate(self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None) -> list[list[Completion]]: ...

    def load_snapshot(self, path, version: int | None = None) -> None: ...


def group_seed(seed: int, iteration: int, prompt_id: int) -> int:
    """Deterministic mode: a group's samples depend on (seed, iteration, prompt id) alone."""
    return ((seed * 1_000_003 + iteration) * 1_000_003 + prompt_id) % (2**63)


def group_generator(seed: int, iteration: int, prompt_id: int) -> torch.Generator:
    """The RNG of one group, seeded by `group_seed`."""
    return torch.Generator().manual_seed(group_seed(seed, iteration, prompt_id))


def cache_argument_name(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.20+); vLLM 0.32 environments pin 5.19."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFEngine:
    """Generates G samples per prompt with a hand-written decode loop over a stock HF causal LM. Its
    calls block; RolloutEngine's async ones run them on a thread."""

    kind = "hf"
    compute_dtypes: tuple[str, ...] = ()  # the model's, which is the trainer's
    joins_running_calls = True  # `play` takes a feed: groups join its decode batch while it runs

    def __init__(self, model, eos_token_id: int, pad_token_id: int, max_new_tokens: int, temperature: float = 1.0):
        self.model = model.eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.cache_kwarg = cache_argument_name(model)
        self.version: int | None = None  # the weight-store version loaded by load_snapshot
        self.processor = None  # a vision-language model's (tidal.model.vision.VisionProcessor): prompts with images
        # Single-turn generation on the calling thread instead of a worker thread: set where the caller is the
        # trainer's compute thread (sync mode), whose OpenMP team then does both phases; a second team (asyncio's
        # pool, a new thread per iteration) made generation slower on two threads than on one.
        self.generate_inline = False

    @classmethod
    def for_rollout(cls, model, tokenizer, max_new_tokens: int, temperature: float) -> HFEngine:
        """The engine of rollout.max_new_tokens and rollout.temperature, over `model` (shared, not copied)."""
        engine = cls(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_new_tokens, temperature)
        from tidal.model.vision import is_vision_model, load_processor

        if is_vision_model(getattr(model, "config", None)):
            engine.processor = load_processor(model.config._name_or_path)
        return engine

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Full weights, or under LoRA (a peft model) the adapter's tensors, set in place on the base loaded once."""
        from tidal.model.loading import load_state_dict_tied
        from tidal.model.lora import is_lora, load_adapter_state_dict

        if is_lora(self.model):
            load_adapter_state_dict(self.model, state_dict)
        else:
            load_state_dict_tied(self.model, state_dict)

    def probe_logprobs(self, probe: list[dict]) -> list[list[float]]:
        """This engine's log-probs of the arrival check's probe (temperature 1, as the trainer's)."""
        from tidal.model.probe import probe_logprobs

        return probe_logprobs(self.model, probe)

    def load_snapshot(self, path, version: int | None = None) -> None:
        """Loads a weight-store snapshot after verifying its checksums."""
        from tidal.weights import load_verified

        self.load_state_dict(load_verified(path))
        self.version = version

    def shutdown(self) -> None:
        pass

    @property
    def context_length(self) -> int | None:
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    async def complete(
        self,
        requests: list[GroupRequest],
        greedy: bool = False,
        max_new_tokens: int | None = None,
        tag: str = "b",
        interrupt: Interrupt | None = None,
    ) -> list[list[Completion]]:
        if self.generate_inline:
            return self.generate(requests, greedy, max_new_tokens, interrupt)
        return await asyncio.to_thread(self.generate, requests, greedy, max_new_tokens, interrupt)

    def play_blocking(
        self, requests: list[GroupRequest], responder: Responder, max_turns: int, max_new_tokens: int | None = None, greedy: bool = False
    ) -> list[TrajectoryTokens]:
        """`play` where no event loop runs."""
        return run_blocking(self.play(requests, responder, max_turns, max_new_tokens, greedy))

    async def play(
        self,
        requests: list[GroupRequest],
        responder: Responder,
        max_turns: int,
        max_new_tokens: int | None = None,
        greedy: bool = False,
        on_done: RowDone | None = None,
        refresh: Refresh | None = None,
        feed: RowFeed | None = None,
    ) -> list[TrajectoryTokens]:
        """The rows of `requests` over one decode batch that each row leaves when its turn ends and joins
        again when its environment has answered (trajectory.play_rows): a slow step holds only its row.
        With `refresh` (rollout.partial) the rows go on with newer weights loaded between decode steps;
        with `feed`, more groups join the batch while it runs (continuous batching)."""
        rows = await asyncio.to_thread(self.start, requests, max_turns)
        return await play_rows(rows, responder, max_turns, max_new_tokens or self.max_new_tokens, greedy, refresh, on_done, feed)

    async def probe(self, sequences: list[dict]) -> list[list[float]]:
        return await asyncio.to_thread(self.probe_logprobs, sequences)

    async def load_weights(self, path: str) -> dict:
        """A refused snapshot (checksums, or tensors that do not fit) leaves the loaded version as it was."""
        from tidal.weights import CorruptSnapshotError, load_verified_with_manifest

        try:
            state, manifest = await asyncio.to_thread(load_verified_with_manifest, path)
            await asyncio.to_thread(self.load_state_dict, state)
        except (CorruptSnapshotError, ValueError) as err:
            return {"error": str(err), "partial": False}
        return {"loaded": len(state), "probe": manifest.get("probe")}

    def start(self, requests: list[GroupRequest], max_turns: int = 1) -> HFRows:
        """Prefills the prompts; the rows (G per request, in request order) then `decode`, and `join`
        again with the tokens the environment inserts (tidal.rollout.hf_rows)."""
        return HFRows(self, requests, max_turns)

    @torch.no_grad()
    def generate(
        self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None, interrupt: Interrupt | None = None
    ) -> list[list[Completion]]:
        """One response per row: a trajectory of one turn. Each prompt is prefilled once and its KV
        cache copied to its G rows; a row that has emitted EOS leaves the batch (its group's rows draw
        their noise together each step, so a group's samples do not depend on when the others finish).
        `interrupt`: asked after every decode step; True ends the unfinished rows there (finish reason
        INTERRUPTED)."""
        rows, turns = self.start(requests), {}
        while rows.decoding:
            turns.update(rows.decode(max_new_tokens or self.max_new_tokens, greedy, interrupt=interrupt))
        samples = [Completion(t.token_ids, t.logprobs, t.finish_reason) for _, t in sorted(turns.items())]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

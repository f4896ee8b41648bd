"""The engine interface and the HF transformers engine (batched decoding with a KV cache)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tidal.images import ImageInputs
from tidal.rollout.trajectory import Responder, TrajectoryTokens, Turn, play_batch


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # per token, under the processed (temperature-scaled) distribution
    finish_reason: str  # "stop" (EOS) or "length"; INTERRUPTED: stopped between tokens for new weights (rollout.partial)
    versions: list[int] | None = None  # per token, the policy version that sampled it (rollout.partial); None: the call's


INTERRUPTED = "interrupted"
Interrupt = Callable[[], bool]  # asked between decode steps: True stops the unfinished rows there (tidal.rollout.partial)


@dataclass
class GroupRequest:
    prompt_ids: list[int]
    n: int
    generator: torch.Generator | None = None  # per-group RNG (HF engine): deterministic, batch-independent samples
    seed: int | None = None  # the same for vLLM (a per-request seed); None: the engine's own RNG
    images: ImageInputs | None = None  # the prompt's processed images (HF engine): encoded once, in the group's shared prefill


class RolloutEngine(Protocol):
    """What a rollout worker drives, async; both engines declare it (HFEngine runs its blocking calls on
    a thread, VLLMEngine is async at heart). Callers never ask which engine they hold."""

    kind: str  # "hf" or "vllm": the arrival check's default tolerance depends on it

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
        self, requests: list[GroupRequest], responder: Responder, max_turns: int, max_new_tokens: int | None = None, greedy: bool = False
    ) -> list[TrajectoryTokens]:
        """One multi-turn trajectory per row (G per request, in order): see tidal.rollout.trajectory."""

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


def turn_seed(group: int, row: int, turn: int) -> int:
    """Deterministic mode, one request per turn (vLLM): the seed of row `row`'s turn `turn` in the group seeded `group`."""
    return ((group * 1_000_003 + row) * 1_000_003 + turn) % (2**63)


def group_generator(seed: int, iteration: int, prompt_id: int) -> torch.Generator:
    """The RNG of one group, seeded by `group_seed`."""
    return torch.Generator().manual_seed(group_seed(seed, iteration, prompt_id))


def gumbel_sample(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """argmax(logp + Gumbel noise) samples from softmax(logp) given uniform noise."""
    gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
    return torch.argmax(logprobs + gumbel, dim=-1)


def cache_argument_name(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.20+); vLLM 0.32 environments pin 5.19."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


class HFEngine:
    """Generates G samples per prompt with a hand-written decode loop over a stock HF causal LM. Its
    calls block; RolloutEngine's async ones run them on a thread."""

    kind = "hf"
    compute_dtypes: tuple[str, ...] = ()  # the model's, which is the trainer's

    def __init__(self, model, eos_token_id: int, pad_token_id: int, max_new_tokens: int, temperature: float = 1.0):
        self.model = model.eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.cache_kwarg = cache_argument_name(model)
        self.version: int | None = None  # the weight-store version loaded by load_snapshot
        self.processor = None  # a vision-language model's (tidal.model.vision.VisionProcessor): prompts with images

    @classmethod
    def for_rollout(cls, model, tokenizer, rollout_cfg) -> HFEngine:
        """The engine `rollout.*` describes, over `model` (shared, not copied)."""
        engine = cls(model, tokenizer.eos_token_id, tokenizer.pad_token_id, rollout_cfg.max_new_tokens, rollout_cfg.temperature)
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
        return await asyncio.to_thread(self.generate, requests, greedy, max_new_tokens, interrupt)

    def play_blocking(
        self, requests: list[GroupRequest], responder: Responder, max_turns: int, max_new_tokens: int | None = None, greedy: bool = False
    ) -> list[TrajectoryTokens]:
        """The rows of `requests` as one batch over one KV cache, turn after turn (trajectory.play_batch)."""
        return play_batch(self.start(requests), responder, max_turns, max_new_tokens or self.max_new_tokens, greedy)

    async def play(
        self, requests: list[GroupRequest], responder: Responder, max_turns: int, max_new_tokens: int | None = None, greedy: bool = False
    ) -> list[TrajectoryTokens]:
        return await asyncio.to_thread(self.play_blocking, requests, responder, max_turns, max_new_tokens, greedy)

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

    def _noise(self, requests: list[GroupRequest], vocab: int) -> torch.Tensor:
        parts = [torch.rand(r.n, vocab, generator=r.generator) for r in requests]
        return torch.cat(parts)

    def start(self, requests: list[GroupRequest]) -> HFTrajectories:
        """Prefills the prompts; the rows (G per request, in request order) then take turns:
        `sample_turn`, and `extend` with the tokens the environment inserts."""
        return HFTrajectories(self, requests)

    @torch.no_grad()
    def generate(
        self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None, interrupt: Interrupt | None = None
    ) -> list[list[Completion]]:
        """One response per row: a trajectory of one turn. Each prompt is prefilled once and its KV
        cache copied to its G rows; a row that has emitted EOS leaves the batch (every row still draws
        its noise each step, so a group's samples do not depend on when the others finish). `interrupt`:
        asked after every decode step; True ends the unfinished rows there (finish reason INTERRUPTED)."""
        turns = self.start(requests).sample_turn(max_new_tokens or self.max_new_tokens, greedy, final=True, interrupt=interrupt)
        samples = [Completion(t.token_ids, t.logprobs, t.finish_reason) for t in turns.values()]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped


def _prefill_with_images(model, requests: list[GroupRequest], ids: torch.Tensor, mask: torch.Tensor):
    """The prompts' prefill with their images (each request's once) at M-RoPE positions, computed by the model
    for each prompt alone and left-padded; returns the output and [rows, W] positions whose last column + 1
    is where each row's generated text goes (one past its prompt's largest position, in all three rows)."""
    from tidal.model.vision import image_token_id, prompt_positions, rope_owner  # the trainer's rule too

    owner, image_token = rope_owner(model), image_token_id(model)
    width = ids.shape[1]
    rope = torch.zeros(3, len(requests), width, dtype=torch.long, device=ids.device)
    for i, r in enumerate(requests):
        rope[:, i, width - len(r.prompt_ids) :] = prompt_positions(owner, ids[i, width - len(r.prompt_ids) :], r.images, image_token)
    with_images = [r.images for r in requests if r.images is not None]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=rope,
        pixel_values=torch.cat([torch.tensor(i.pixel_values) for i in with_images]).to(ids.device),
        image_grid_thw=torch.cat([torch.tensor(i.image_grid_thw) for i in with_images]).to(ids.device),
        use_cache=True,
    )
    return out, rope.max(dim=0).values


class HFTrajectories:
    """The rows of one engine call, generated turn by turn over one KV cache.

    A turn decodes every live row until each has emitted EOS or `max_new_tokens`; `extend` then
    appends, to the rows that go on, the tokens the environment and the chat template insert, and
    ends the others. Nothing is computed twice: the inserted tokens are prefilled on top of the
    cache (with the last sampled token, which no forward has seen yet), and the next turn samples
    from there. The cache may hold slots of no token (a row waiting while others finish their turn,
    right-padding of inserted tokens of unequal length): the attention mask hides them, and each
    row's position ids count only its real tokens, so every sampled token's log-prob is the one a
    forward pass over prompt + trajectory gives (the trainer's)."""

    def __init__(self, engine: HFEngine, requests: list[GroupRequest]):
        self.engine, self.requests = engine, requests
        model = engine.model
        self.device = device = next(model.parameters()).device  # the trainer's, when the model is shared with it
        prompts = [r.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[engine.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            if any(r.images is not None for r in requests):
                out, positions = _prefill_with_images(model, requests, ids, mask)
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        row_prompt = torch.repeat_interleave(torch.arange(len(requests), device=device), torch.tensor([r.n for r in requests], device=device))
        self.cache = returned_cache(out)
        self.cache.batch_select_indices(row_prompt)
        self.logits, self.mask, self.next_pos = out.logits[row_prompt, -1, :], mask[row_prompt], positions[row_prompt, -1:] + 1
        self.live = torch.arange(len(row_prompt), device=device)  # the original row of each row still in the batch
        self.pending: dict[int, int] = {}  # row -> its last sampled token, not yet through a forward pass

    @property
    def rows(self) -> list[int]:
        """The original indices of the rows still going."""
        return self.live.tolist()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        engine = self.engine
        out = engine.model(input_ids=input_ids, attention_mask=self.mask, position_ids=positions, use_cache=True, **{engine.cache_kwarg: self.cache})
        self.cache = returned_cache(out)
        return out.logits

    def _keep(self, keep: torch.Tensor) -> None:
        """Only the rows at batch indices `keep` stay in the batch."""
        self.cache.batch_select_indices(keep)
        self.live, self.logits, self.mask, self.next_pos = self.live[keep], self.logits[keep], self.mask[keep], self.next_pos[keep]

    @torch.no_grad()
    def sample_turn(self, max_new_tokens: int, greedy: bool = False, final: bool = False, interrupt: Interrupt | None = None) -> dict[int, Turn]:
        """One turn of every live row: row -> its turn, in row order. `final`: no row goes on after it, so a row that
        has emitted EOS leaves the batch at once; otherwise it waits (masked) for the others. `interrupt` (final
        turns only): asked after each step; True ends the rows still sampling there, finish reason INTERRUPTED."""
        engine = self.engine
        rows = self.live.tolist()
        tokens: dict[int, list[int]] = {r: [] for r in rows}
        logps: dict[int, list[float]] = {r: [] for r in rows}
        reasons = dict.fromkeys(rows, "length")
        going = torch.ones(len(rows), dtype=torch.bool, device=self.device)
        for step in range(max_new_tokens):
            lp = torch.log_softmax(self.logits.float() / engine.temperature, dim=-1)
            if greedy:
                nxt = lp.argmax(-1)
            else:
                # noise from each group's seeded CPU generator: the same samples on any device
                nxt = gumbel_sample(lp, engine._noise(self.requests, lp.shape[-1]).to(self.device)[self.live])
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            step_tokens, step_logps, sampling = nxt.tolist(), chosen.tolist(), going.tolist()  # one device sync per step, not per row
            for i, row in enumerate(self.live.tolist()):
                if not sampling[i]:
                    continue
                tokens[row].append(step_tokens[i])
                logps[row].append(step_logps[i])
                if step_tokens[i] == engine.eos:
                    reasons[row] = "stop"
            still = going & (nxt != engine.eos)
            stopped = final and interrupt is not None and step + 1 < max_new_tokens and bool(still.any()) and interrupt()
            if stopped:
                reasons.update((row, INTERRUPTED) for i, row in enumerate(self.live.tolist()) if bool(still[i]))
            if stopped or not bool(still.any()) or step + 1 == max_new_tokens:  # no forward whose logits nobody reads
                self.pending.update((row, step_tokens[i]) for i, row in enumerate(self.live.tolist()) if sampling[i])
                break
            if final:
                if not bool(still.all()):
                    keep = torch.nonzero(still).flatten()
                    self._keep(keep)
                    nxt, still = nxt[keep], still[keep]
                feed = torch.ones_like(still)
            else:
                feed = going  # a row whose turn is over waits: a hidden slot in its cache, its position unchanged
            self.mask = torch.cat([self.mask, feed.long()[:, None]], dim=1)
            logits = self._forward(torch.where(feed, nxt, torch.full_like(nxt, engine.pad))[:, None], self.next_pos)[:, -1, :]
            # a row that fed its EOS keeps the logits after it: they predict what follows if nothing is inserted
            self.logits = torch.where(feed[:, None], logits, self.logits)
            self.next_pos = self.next_pos + feed.long()[:, None]
            going = still
        return {r: Turn(tokens[r], logps[r], reasons[r]) for r in rows}

    @torch.no_grad()
    def extend(self, inserted: dict[int, list[int]]) -> None:
        """Appends `inserted[row]` (the environment's and the template's tokens, as token ids) to each
        row that goes on; every other row's trajectory is over and leaves the batch. The next turn
        samples after them."""
        keep = [i for i, row in enumerate(self.live.tolist()) if row in inserted]
        if len(keep) < len(self.live):
            self._keep(torch.tensor(keep, dtype=torch.long, device=self.device))
        if not keep:
            return
        rows = self.live.tolist()
        # a turn's last token has not been through a forward pass when the turn ended at its length
        # limit, or at the step that ended the whole turn: it goes first
        chunks = [([self.pending.pop(row)] if row in self.pending else []) + list(inserted[row]) for row in rows]
        width = max(len(c) for c in chunks)
        if width == 0:
            return
        ids = torch.tensor([c + [self.engine.pad] * (width - len(c)) for c in chunks], device=self.device)
        real = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in chunks], device=self.device)
        self.mask = torch.cat([self.mask, real], dim=1)
        # a padded slot gets any position: nothing ever attends to it
        logits = self._forward(ids, self.next_pos + torch.arange(width, device=self.device)[None, :])
        lengths = real.sum(-1)
        last = logits[torch.arange(len(rows), device=self.device), (lengths - 1).clamp(min=0)]
        self.logits = torch.where(lengths[:, None] > 0, last, self.logits)
        self.next_pos = self.next_pos + lengths[:, None]

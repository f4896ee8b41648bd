"""The engine interface and the HF transformers engine (batched decoding with a KV cache)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # per token, under the processed (temperature-scaled) distribution
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class GroupRequest:
    prompt_ids: list[int]
    n: int
    generator: torch.Generator | None = None  # per-group RNG (HF engine): deterministic, batch-independent samples
    seed: int | None = None  # the same for vLLM (a per-request seed); None: the engine's own RNG


class RolloutEngine(Protocol):
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def generate(self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None) -> list[list[Completion]]: ...

    def load_snapshot(self, path, version: int | None = None) -> None: ...

    def shutdown(self) -> None: ...


def group_seed(seed: int, iteration: int, prompt_id: int) -> int:
    """Deterministic mode: a group's samples depend on (seed, iteration, prompt id) alone."""
    return ((seed * 1_000_003 + iteration) * 1_000_003 + prompt_id) % (2**63)


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
    """Generates G samples per prompt with a hand-written decode loop over a stock HF causal LM."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int, max_new_tokens: int, temperature: float = 1.0):
        self.model = model.eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.cache_kwarg = cache_argument_name(model)
        self.version: int | None = None  # the weight-store version loaded by load_snapshot

    @classmethod
    def for_rollout(cls, model, tokenizer, rollout_cfg) -> HFEngine:
        """The engine `rollout.*` describes, over `model` (shared, not copied)."""
        return cls(model, tokenizer.eos_token_id, tokenizer.pad_token_id, rollout_cfg.max_new_tokens, rollout_cfg.temperature)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        from tidal.model.loading import load_state_dict_tied

        load_state_dict_tied(self.model, state_dict)

    def load_snapshot(self, path, version: int | None = None) -> None:
        """Loads a weight-store snapshot after verifying its checksums."""
        from tidal.weights import load_verified

        self.load_state_dict(load_verified(path))
        self.version = version

    def shutdown(self) -> None:
        pass

    def _noise(self, requests: list[GroupRequest], vocab: int) -> torch.Tensor:
        parts = [torch.rand(r.n, vocab, generator=r.generator) for r in requests]
        return torch.cat(parts)

    @torch.no_grad()
    def generate(self, requests: list[GroupRequest], greedy: bool = False, max_new_tokens: int | None = None) -> list[list[Completion]]:
        """Each prompt is prefilled once and its KV cache copied to its G rows; a row that has emitted
        EOS leaves the batch (every row still draws its noise each step, so a group's samples do not
        depend on when the others finish)."""
        device = next(self.model.parameters()).device  # the trainer's, when the model is shared with it
        prompts = [r.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        row_prompt = torch.repeat_interleave(torch.arange(len(requests), device=device), torch.tensor([r.n for r in requests], device=device))
        cache = returned_cache(out)
        cache.batch_select_indices(row_prompt)
        logits, mask, next_pos = out.logits[row_prompt, -1, :], mask[row_prompt], positions[row_prompt, -1:] + 1
        rows = len(row_prompt)
        tokens = [[] for _ in range(rows)]
        logps = [[] for _ in range(rows)]
        reasons = ["length"] * rows
        live = torch.arange(rows, device=device)  # the original row of each row still in the batch
        limit = max_new_tokens or self.max_new_tokens
        for step in range(limit):
            lp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            if greedy:
                nxt = lp.argmax(-1)
            else:
                # noise from each group's seeded CPU generator: the same samples on any device
                nxt = gumbel_sample(lp, self._noise(requests, lp.shape[-1]).to(device)[live])
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            step_tokens, step_logps = nxt.tolist(), chosen.tolist()  # one device sync per step, not per row
            for i, row in enumerate(live.tolist()):
                tokens[row].append(step_tokens[i])
                logps[row].append(step_logps[i])
                if step_tokens[i] == self.eos:
                    reasons[row] = "stop"
            going = nxt != self.eos
            if not bool(going.any()) or step + 1 == limit:  # no forward whose logits nobody reads
                break
            if not bool(going.all()):
                keep = torch.nonzero(going).flatten()
                cache.batch_select_indices(keep)
                live, nxt, mask, next_pos = live[keep], nxt[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True, **{self.cache_kwarg: cache})
            cache, logits = returned_cache(out), out.logits[:, -1, :]
            next_pos = next_pos + 1
        samples = [Completion(t, l, r) for t, l, r in zip(tokens, logps, reasons)]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

"""The arrival check's probe: a few token sequences fixed per run, whose per-token log-probs the trainer
publishes with each weight version and a rollout engine recomputes after loading it. Equal log-probs
(within a tolerance) show that the engine computes with the weights the trainer trained. They are read
at temperature 1, the model's own distribution: what vLLM's prompt log-probs give (it applies no
temperature to a prompt), and the weights are what is checked."""

from __future__ import annotations

import torch

PROBE_SEQUENCES = 3
PROBE_PROMPT_TOKENS = 6
PROBE_RESPONSE_TOKENS = 6
FIRST_ORDINARY_TOKEN = 4  # the tiny tokenizer's special tokens come first; any model's low ids are as good
HF_TOLERANCE = 1e-3  # trainer and HF engine: the same code on the same weights
# vLLM is another implementation of the model: in float32 it agrees with the trainer to ~1e-6; in half precision
# the logits alone are rounded to 8 (bfloat16) or 11 (float16) significant bits, so a logit near 30 moves by up to
# 0.06 (bfloat16) before any error builds up through the layers
VLLM_TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}


def make_probe(seed: int, vocab_size: int) -> list[dict]:
    """[{"prompt_ids", "response_ids"}], a function of (seed, vocab size) alone."""
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    low = min(FIRST_ORDINARY_TOKEN, vocab_size - 1)

    def tokens(n: int) -> list[int]:
        return torch.randint(low, vocab_size, (n,), generator=gen).tolist()

    return [{"prompt_ids": tokens(PROBE_PROMPT_TOKENS), "response_ids": tokens(PROBE_RESPONSE_TOKENS)} for _ in range(PROBE_SEQUENCES)]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, probe: list[dict]) -> list[list[float]]:
    """Log-prob of each response token given what precedes it: one plain forward per sequence."""
    device = next(model.parameters()).device
    out = []
    for seq in probe:
        prompt, response = seq["prompt_ids"], seq["response_ids"]
        ids = torch.tensor([prompt + response], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response, device=device)[:, None])[:, 0]
        out.append(logp.cpu().tolist())
    return out


def probe_difference(expected: list[list[float]], actual: list[list[float]]) -> float:
    """The largest per-token |difference|; inf when the shapes differ."""
    if [len(r) for r in expected] != [len(r) for r in actual]:
        return float("inf")
    return max((abs(a - b) for e, x in zip(expected, actual) for a, b in zip(e, x)), default=0.0)


def arrival_tolerance(configured: float | None, engine: str, *dtypes: str) -> float:
    """weights.arrival_tolerance as set, or when None the engine's default: `engine` "hf" or "vllm"; on vLLM
    the coarsest of `dtypes` (the engine's and the trainer's, torch's names without "torch.") decides."""
    if configured is not None:
        return configured
    if engine == "hf":
        return HF_TOLERANCE
    return max(VLLM_TOLERANCE.get(dtype, max(VLLM_TOLERANCE.values())) for dtype in dtypes or ("float32",))

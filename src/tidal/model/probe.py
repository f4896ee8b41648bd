"""The arrival check's probe: a few token sequences fixed when the trainer starts, whose per-token log-probs the
trainer publishes with each weight version and a rollout engine recomputes after loading it. Equal log-probs
(within a tolerance) show that the engine computes with the weights the trainer trained. They are read at
temperature 1, the model's own distribution: what vLLM's prompt log-probs give (it applies no temperature to a
prompt), and the weights are what is checked.

Prompts are random tokens; responses are the model's own samples from them (sample_responses). Uniformly
random responses are tokens of probability ~1/vocab, whose log-probs half precision moves the most: on the
examples the noise of a right version in bfloat16 was 5x larger with them, for 2x more signal of a wrong one."""

from __future__ import annotations

import torch

PROBE_SEQUENCES = 8
PROBE_PROMPT_TOKENS = 6
PROBE_RESPONSE_TOKENS = 8
FIRST_ORDINARY_TOKEN = 4  # the tiny tokenizer's special tokens come first; any model's low ids are as good
# The check compares the MEAN per-token |difference| with a tolerance (docs/vllm.md#the-arrival-check has the measured
# table; benchmarks/arrival_separation.py measures it). Not the largest difference: half precision moves a few tokens'
# log-probs far more than the rest, so a maximum stops right versions before it can tell wrong ones.
HF_TOLERANCE = 1e-3  # trainer and HF engine: the same code on the same weights in the same dtype
# Per dtype, the coarsest either side computes in: float32's is far under one update; half precision's is about 3x the
# largest mean measured on a right version of the examples, where its rounding is as large as a few updates.
DTYPE_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.15}
# Half precision's error grows with the model's depth and differs by hardware: an engine also measures its own
# difference on the base model before its first version, and a version may differ by this many times that (right
# versions measured up to 4x their base's, a LoRA adapter in bfloat16 on both sides) ...
CALIBRATION_FACTOR = 6
# ... while a base further off than this is not the trainer's model at all
BASE_BOUND = {"float16": 0.1, "bfloat16": 0.3}


def make_probe(seed: int, vocab_size: int) -> list[dict]:
    """[{"prompt_ids", "response_ids"}], a function of (seed, vocab size) alone."""
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    low = min(FIRST_ORDINARY_TOKEN, vocab_size - 1)

    def tokens(n: int) -> list[int]:
        return torch.randint(low, vocab_size, (n,), generator=gen).tolist()

    return [{"prompt_ids": tokens(PROBE_PROMPT_TOKENS), "response_ids": tokens(PROBE_RESPONSE_TOKENS)} for _ in range(PROBE_SEQUENCES)]


@torch.no_grad()
def sample_responses(model: torch.nn.Module, probe: list[dict], seed: int) -> list[dict]:
    """`probe` with each response replaced by as many tokens sampled from `model` at temperature 1 after its prompt
    (a seeded CPU generator: every trainer rank draws the same tokens from the same logits). One batched forward
    per token, the same on every rank (a collective under fsdp2 and ZeRO-3)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed * 7919 + 29)
    prompts = {len(seq["prompt_ids"]) for seq in probe}
    assert len(prompts) == 1, "probe prompts of one length"
    ids = torch.tensor([seq["prompt_ids"] for seq in probe], device=device)
    for _ in range(max(len(seq["response_ids"]) for seq in probe)):
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].float().cpu(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen).to(device)], dim=1)
    (length,) = prompts
    return [
        {"prompt_ids": seq["prompt_ids"], "response_ids": ids[i, length : length + len(seq["response_ids"])].tolist()} for i, seq in enumerate(probe)
    ]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, probe: list[dict]) -> list[list[float]]:
    """Log-prob of each response token given what precedes it: one plain forward (no padding, no mask) per shape
    of sequence, i.e. one for the whole probe, whose sequences share one shape (every rank alike: a collective
    under fsdp2 and ZeRO-3). Both sides of every weight load run it, between one iteration's training and the
    next one's generation, where a forward per sequence paid a forward's fixed cost eight times."""
    device = next(model.parameters()).device
    out: list[list[float]] = [[] for _ in probe]
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, seq in enumerate(probe):
        shapes.setdefault((len(seq["prompt_ids"]), len(seq["response_ids"])), []).append(i)
    for (prompt, _), members in shapes.items():
        ids = torch.tensor([probe[i]["prompt_ids"] + probe[i]["response_ids"] for i in members], device=device)
        logits = model(input_ids=ids).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt:, None])[..., 0]
        for i, row in zip(members, logp.cpu().tolist(), strict=True):
            out[i] = row
    return out


def token_differences(expected: list[list[float]], actual: list[list[float]]) -> list[float] | None:
    """|difference| per token, flattened; None when the shapes differ."""
    if [len(r) for r in expected] != [len(r) for r in actual]:
        return None
    return [abs(a - b) for e, x in zip(expected, actual) for a, b in zip(e, x)]


def probe_difference(expected: list[list[float]], actual: list[list[float]]) -> float:
    """The arrival check's statistic: the mean per-token |difference| of log-probs; inf when the shapes differ."""
    differences = token_differences(expected, actual)
    if differences is None:
        return float("inf")
    return sum(differences) / len(differences) if differences else 0.0


def largest_difference(expected: list[list[float]], actual: list[list[float]]) -> float:
    """The largest per-token |difference| (reported beside the mean, not compared); inf when the shapes differ."""
    differences = token_differences(expected, actual)
    return float("inf") if differences is None else max(differences, default=0.0)


def arrival_tolerance(configured: float | None, engine: str, *dtypes: str) -> float:
    """weights.arrival_tolerance as set, or when None the default for `engine` ("hf" or "vllm") and `dtypes`, the
    dtypes the two sides compute in (the engine's, model.dtype, trainer.param_dtype; torch's names without
    "torch."). The HF engine computing in the trainer's one dtype runs the trainer's code: HF_TOLERANCE. Otherwise
    the coarsest dtype decides (DTYPE_TOLERANCE)."""
    if configured is not None:
        return configured
    dtypes = dtypes or ("float32",)
    if engine == "hf" and len(set(dtypes)) == 1:
        return HF_TOLERANCE
    return DTYPE_TOLERANCE.get(coarsest_dtype(*dtypes), max(DTYPE_TOLERANCE.values()))


def coarsest_dtype(*dtypes: str) -> str:
    """The dtype of `dtypes` with the widest tolerance (an unknown one counts as the coarsest)."""
    return max(dtypes, key=lambda dtype: DTYPE_TOLERANCE.get(dtype, float("inf")))


def trainer_compute_dtypes(model_dtype: str, param_dtype: str | None) -> tuple[str, ...]:
    """The dtypes the trainer's probe forward computes in: model.dtype, and trainer.param_dtype when fsdp2's or
    DeepSpeed's mixed precision casts the weights for the forward."""
    return (model_dtype, param_dtype or model_dtype)

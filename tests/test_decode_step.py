"""The HF engine's own decode step (tidal.rollout.decode_step): the logits and the cache the transformers
forward gives for the same step, on every family it covers, plain and under a LoRA adapter, and the
transformers forward kept for what it does not cover."""

import copy
import random

import pytest
import torch
import transformers

from tests.tiny_models import tiny_causal_lm
from tidal.rollout import decode_step
from tidal.rollout.decode_step import DecodeStep, unsupported
from tidal.rollout.engine import GroupRequest, HFEngine, cache_argument_name, group_generator, returned_cache
from tidal.rollout.kv_slots import with_spare_slots

VOCAB, EOS, PAD = 64, 1, 0


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A LoRA adapter on every projection, its B matrices random: the adapter changes every logit."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
    torch.manual_seed(1)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    return peft.eval()


def model_of(family: str) -> torch.nn.Module:
    """The tiny model of `family` ("qwen2", "qwen3", ...), with "+lora" under an adapter, with "+bfloat16" in bfloat16."""
    model = tiny_causal_lm(family.split("+")[0], VOCAB)
    if family.endswith("+lora"):
        model = with_lora(model)
    return model.to(torch.bfloat16) if family.endswith("+bfloat16") else model


def left_padded_prefill(model, prompts: list[list[int]]):
    """The prompts' prefill as the engine makes it: left padding, positions counting real tokens only."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return with_spare_slots(returned_cache(out)), mask, positions[:, -1:] + 1


def transformers_step(model, cache, ids, mask, positions) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_argument_name(model): cache}).logits[
            :, -1, :
        ]


@pytest.mark.parametrize("family", ["qwen2", "qwen2-mha", "qwen3", "llama", "qwen2+lora", "qwen2+bfloat16", "qwen2+unfused"])
def test_decode_steps_give_the_transformers_forwards_logits_and_cache(family, monkeypatch):
    """float32 (the default dtype) within float32 rounding; bfloat16 (torch's fused attention, as transformers')
    within bfloat16's. `unfused`: a plain model too large for fused copies of its projections (the limit set to 0)."""
    if family.endswith("+unfused"):
        monkeypatch.setattr(decode_step, "FUSED_COPY_BYTES", 0)
    model, bf16 = model_of(family), family.endswith("+bfloat16")
    assert unsupported(model) is None
    step = DecodeStep.of(model)
    assert step.fusable is not family.endswith(("+lora", "+unfused"))  # a small plain model's projections fused
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 9, 6, 1)]  # unequal: left padding
    theirs, mask, positions = left_padded_prefill(model, prompts)
    ours = copy.deepcopy(theirs)
    for _ in range(12):
        ids = torch.tensor([[rng.randrange(2, VOCAB)] for _ in prompts])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        expected = transformers_step(model, theirs, ids, mask, positions)
        with torch.no_grad():
            got = step.logits(ids, mask, positions, ours)
        torch.testing.assert_close(got, expected, atol=2e-2 if bf16 else 1e-5, rtol=2e-2 if bf16 else 1e-4)
        positions = positions + 1
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(mine.keys, reference.keys, atol=2e-2 if bf16 else 1e-6, rtol=2e-2 if bf16 else 1e-5)
        torch.testing.assert_close(mine.values, reference.values, atol=2e-2 if bf16 else 1e-6, rtol=2e-2 if bf16 else 1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen2+lora", "qwen2+bfloat16"])
def test_joins_give_the_transformers_forwards_logits_and_cache(family):
    """Rows joining the decode batch with several new tokens each (right-padded to the longest): the logits
    after each row's last new token, and the cache, equal the transformers forward's over the same tokens."""
    model, bf16 = model_of(family), family.endswith("+bfloat16")
    step = DecodeStep.of(model)
    rng = random.Random(2)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (5, 2, 8)]
    theirs, mask, positions = left_padded_prefill(model, prompts)
    ours = copy.deepcopy(theirs)
    chunks = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (4, 1, 7)]  # unequal: right padding
    span = max(map(len, chunks))
    ids = torch.tensor([c + [PAD] * (span - len(c)) for c in chunks])
    mask = torch.cat([mask, torch.tensor([[1] * len(c) + [0] * (span - len(c)) for c in chunks])], dim=1)
    positions = positions + torch.arange(span)[None, :]
    last = torch.tensor([len(c) - 1 for c in chunks])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_argument_name(model): theirs})
        expected = out.logits[torch.arange(len(chunks)), last]
        got = step.join_logits(ids, mask, positions, ours, last)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(got, expected, **tolerance)
    for mine, reference in zip(ours.layers, returned_cache(out).layers, strict=True):
        torch.testing.assert_close(mine.keys, reference.keys, **tolerance)
        torch.testing.assert_close(mine.values, reference.values, **tolerance)


def test_what_it_does_not_cover_keeps_the_transformers_forward():
    sliding = tiny_causal_lm("qwen2", VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding window" in unsupported(sliding)
    assert DecodeStep.of(sliding) is None
    hooked = tiny_causal_lm("qwen2", VOCAB)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)  # a hook the step would bypass
    assert "forward hooks" in unsupported(hooked)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    assert "GPT2LMHeadModel" in unsupported(gpt2)


def generate(engine: HFEngine, prompts: list[list[int]]):
    requests = [GroupRequest(p, 4, group_generator(0, 0, i)) for i, p in enumerate(prompts)]
    return [c for group in engine.generate(requests) for c in group]


def test_the_engine_samples_the_same_responses_with_its_step_as_with_the_transformers_forward(monkeypatch):
    """The default engine takes its own step (the qwen2 tiny model is covered); forcing the transformers
    forward samples the same tokens from the same noise, with log-probs within float32 rounding."""
    model = tiny_causal_lm("qwen2", VOCAB)
    engine = HFEngine(model, EOS, PAD, max_new_tokens=24)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (4, 7, 2, 5)]
    steps, logits = [], DecodeStep.logits
    monkeypatch.setattr(DecodeStep, "logits", lambda self, *a: steps.append(1) or logits(self, *a))
    own = generate(engine, prompts)
    assert steps, "the engine did not take its own decode step"
    monkeypatch.setattr(DecodeStep, "of", classmethod(lambda cls, m: None))
    reference = generate(engine, prompts)
    assert [c.token_ids for c in own] == [c.token_ids for c in reference]
    assert sum(len(c.token_ids) for c in own) > 4 * len(prompts)
    for a, b in zip(own, reference, strict=True):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < 1e-4

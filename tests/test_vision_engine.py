"""The HF engine generates groups whose prompt has an image: the image is encoded once per group (in the
shared prefill), and each sampled token's log-prob is the one the trainer's packed forward computes."""

from __future__ import annotations

import torch

from tests.test_vision_packing import EncoderCalls, model, processor, vision_groups  # noqa: F401 - fixtures
from tidal.rollout.engine import GroupRequest, HFEngine
from tidal.trainer.vision_packing import packed_vision_token_logprobs


def test_engine_samples_with_images_carry_the_trainers_logprobs(model, processor):  # noqa: F811
    tok = processor.tokenizer
    groups = vision_groups(processor, [8, 8], seed=5)
    text_prompt = tok("5+3=", add_special_tokens=False).input_ids
    requests = [GroupRequest(g[0], 8, torch.Generator().manual_seed(i), images=g[3]) for i, g in enumerate(groups)]
    requests.append(GroupRequest(text_prompt, 4, torch.Generator().manual_seed(9)))  # a text prompt in the same call
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=6)
    calls = EncoderCalls(model)
    try:
        completions = engine.generate(requests)
    finally:
        calls.close()
    assert calls.images == [2]  # the two images, once each, in the one prefill; none while decoding
    trained = [(r.prompt_ids, [c.token_ids for c in cs], [None] * len(cs), r.images) for r, cs in zip(requests, completions)]
    trained[-1] = trained[-1][:3]
    with torch.no_grad():
        logprobs = packed_vision_token_logprobs(model, trained, "cpu", kernel="sdpa")
    for out, cs in zip(logprobs, completions, strict=True):
        for i, c in enumerate(cs):
            assert len(c.token_ids) >= 1
            torch.testing.assert_close(out.logprobs[i, : len(c.token_ids)], torch.tensor(c.logprobs), atol=2e-5, rtol=1e-4)

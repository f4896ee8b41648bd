"""The HF engine generates groups whose prompt has an image: the image is encoded once per group (in the
shared prefill), and each sampled token's log-prob is the one the trainer's packed forward computes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.test_vision_packing import EncoderCalls, model, processor, vision_groups  # noqa: F401 - fixtures
from tidal.config import TrainerConfig, config_from_dict
from tidal.data import read_jsonl_problems
from tidal.demo.vision import write_count_task
from tidal.protocol import WorkItem, decode_group, pack
from tidal.rewards import RewardScorer
from tidal.rollout.engine import GroupRequest, HFEngine
from tidal.rollout.generator import generate_groups
from tidal.trainer.iteration_plan import work_items
from tidal.trainer.learner import Learner
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


@pytest.mark.parametrize("chat_template", [False, True])
def test_work_items_with_images_become_groups_that_carry_them_once(model, processor, tmp_path, chat_template):  # noqa: F811
    """Data rows with images -> work items -> groups (HF engine, real scoring) -> the wire -> the learner."""
    tok = processor.tokenizer
    cfg = config_from_dict(
        {
            "rollout": {"group_size": 4, "max_new_tokens": 4},
            "data": {"chat_template": chat_template},
            "trainer": {"prompts_per_iteration": 2},
            "eval": {"enabled": False},
        }
    )
    problems = read_jsonl_problems(write_count_task(tmp_path, rows=3, seed=1))
    items = work_items(0, problems[:2])
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=4)
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items, cfg, version=0, worker_id="w", processor=processor)
    received = [decode_group(pack(g)) for g in groups]
    for group, problem in zip(received, problems[:2], strict=True):
        expected = processor.process_images(list(problem.images))
        np.testing.assert_array_equal(group.images.pixel_values, expected.pixel_values)
        assert list(group.prompt_ids).count(processor.image_token_id) == expected.tokens(processor.merge_size) == 4
        assert "how many red squares?" in tok.decode(group.prompt_ids, skip_special_tokens=True)
        assert len(group.samples) == 4
    for group in received:  # rewards that differ, so that every group has a gradient (the random model scores 0)
        for sample, reward in zip(group.samples, [1.0, 0.0, 0.0, 1.0]):
            sample.reward = reward
    learner = Learner(TrainerConfig(), copy.deepcopy(model), tok.pad_token_id, device="cpu")
    calls = EncoderCalls(learner.model)
    try:
        trained = learner.train_on_groups(received)
    finally:
        calls.close()
    assert trained == sum(len(s.token_ids) for g in received for s in g.samples)
    assert calls.images == [2]  # one call of the vision tower, each group's image once


def test_a_work_item_with_images_needs_a_vision_processor(model, processor):  # noqa: F811
    tok = processor.tokenizer
    cfg = config_from_dict({"rollout": {"group_size": 2, "max_new_tokens": 2}, "eval": {"enabled": False}})
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=2)
    item = WorkItem(0, 0, "how many?", "1", images=[b"\x89PNG"])
    with pytest.raises(ValueError, match="work item w-0-0 has images: a vision-language model's processor"):
        generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), [item], cfg, version=0, worker_id="w")


def test_a_partial_rollout_with_images_continues_on_the_new_weights_with_its_images(model, processor):  # noqa: F811
    """rollout.partial on a vision-language model: rows stopped for newer weights are prefilled again with
    their prompt's images, so the tokens after the swap carry the new weights' log-probs of the whole prompt."""
    import asyncio

    from tests.test_partial_rollouts import StepRefresh, other_weights
    from tidal.rollout.partial import complete_partial

    tok = processor.tokenizer
    groups = vision_groups(processor, [8, 8], seed=6)
    requests = [GroupRequest(g[0], 4, torch.Generator().manual_seed(i), images=g[3]) for i, g in enumerate(groups)]
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=8)
    refresh = StepRefresh(engine, version=2, weights=other_weights(model), after=2)
    outputs = asyncio.run(complete_partial(engine, requests, 8, refresh))
    assert refresh.swaps == 1
    spanning = [(r, c) for r, cs in zip(requests, outputs) for c in cs if c.versions is not None]
    assert spanning and all(c.versions[:2] == [2, 2] and set(c.versions[2:]) == {3} for _, c in spanning)
    with torch.no_grad():  # the engine's model holds the new weights: the later tokens are theirs, images included
        after = packed_vision_token_logprobs(model, [(r.prompt_ids, [c.token_ids], [None], r.images) for r, c in spanning], "cpu", kernel="sdpa")
    for out, (_, c) in zip(after, spanning, strict=True):
        torch.testing.assert_close(out.logprobs[0, 2 : len(c.token_ids)], torch.tensor(c.logprobs[2:]), atol=2e-5, rtol=1e-4)

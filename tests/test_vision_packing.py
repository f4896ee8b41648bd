"""Shared-prompt packing with images (a tiny Qwen2-VL built from a config): the packed group forward, each
image encoded once, equals the per-sample forwards (each sample encoding its own copy), log-probs and
gradients, at group sizes 8 and 16; and the learner trains a group with images through it."""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch

from tidal.config import TrainerConfig
from tidal.demo.vision import build_processor, build_tiny_vlm, count_image
from tidal.protocol import Group, Sample
from tidal.trainer.learner import Learner
from tidal.trainer.vision_packing import naive_vision_token_logprobs, packed_vision_token_logprobs

ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def processor():
    return build_processor()


@pytest.fixture(scope="module")
def model(processor):
    torch.manual_seed(0)
    return build_tiny_vlm(processor.tokenizer).float()


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def vision_groups(processor, sizes: list[int], seed: int = 0) -> list[tuple]:
    """Groups of different prompts and images (and image sizes), random responses of different lengths."""
    rng = random.Random(seed)
    groups = []
    for g, size in enumerate(sizes):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"how many red squares? {g}"}]}]
        ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        side = 56 if g % 2 == 0 else 84
        prompt, images = processor.encode(list(ids), [png(count_image(rng, "red", rng.randint(0, 3), side=side, cell=14))])
        responses = [[rng.randrange(4, 100) for _ in range(rng.randint(1, 7))] for _ in range(size)]
        groups.append((prompt, responses, [None] * size, images))
    return groups


class EncoderCalls:
    """A forward hook on the vision tower: its calls and the images each call encoded."""

    def __init__(self, model):
        self.images: list[int] = []
        self.handle = model.model.visual.register_forward_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs, output):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images.append(int(grid.shape[0]))

    def close(self):
        self.handle.remove()


def grads_of(model, outputs) -> dict[str, torch.Tensor]:
    model.zero_grad()
    weights = torch.linspace(0.5, 1.5, 7)
    loss = sum((o.logprobs * weights[: o.logprobs.shape[1]]).sum() for o in outputs)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(packed, naive, packed_grads, naive_grads):
    for p, n in zip(packed, naive, strict=True):
        assert torch.equal(p.mask, n.mask)
        torch.testing.assert_close(p.logprobs, n.logprobs, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(p.entropy, n.entropy, atol=ATOL, rtol=RTOL)
    assert packed_grads.keys() == naive_grads.keys()
    assert any(name.startswith("model.visual") for name in naive_grads), "the vision tower gets a gradient"
    for name, grad in naive_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("group_size", [8, 16])
@pytest.mark.parametrize("kernel", ["segmented", "sdpa"])
def test_packed_group_with_images_matches_per_sample_forwards(model, processor, group_size, kernel):
    groups = vision_groups(processor, [group_size, group_size])
    calls = EncoderCalls(model)
    try:
        packed = packed_vision_token_logprobs(model, groups, "cpu", kernel=kernel, with_entropy=True)
        packed_grads = grads_of(model, packed)
        packed_images = list(calls.images)
        calls.images.clear()
        naive = naive_vision_token_logprobs(model, groups, with_entropy=True)
        naive_grads = grads_of(model, naive)
        naive_images = list(calls.images)
    finally:
        calls.close()
    assert_same(packed, naive, packed_grads, naive_grads)
    assert packed_images == [2]  # one call for the packed row, each group's image once
    assert naive_images == [group_size, group_size]  # per sample: every group's image G times


def test_an_image_token_a_response_samples_stays_text(model, processor):
    """A policy may sample the image token: it is a token like any other there (its plain embedding, text
    positions), in the packed forward as in the per-sample one and the engine's decoding."""
    groups = vision_groups(processor, [4])
    prompt, responses, masks, images = groups[0]
    responses = [r + [processor.image_token_id, 7] for r in responses]
    with torch.no_grad():
        packed = packed_vision_token_logprobs(model, [(prompt, responses, masks, images)], "cpu", kernel="segmented")
        naive = naive_vision_token_logprobs(model, [(prompt, responses, masks, images)])
    torch.testing.assert_close(packed[0].logprobs, naive[0].logprobs, atol=ATOL, rtol=RTOL)


def test_the_image_and_its_positions_matter(model, processor):
    """The equality above is not vacuous: another image changes the log-probs, and packing with plain text
    positions instead of M-RoPE's does not reproduce the per-sample forwards."""
    groups = vision_groups(processor, [4])
    with torch.no_grad():
        naive = naive_vision_token_logprobs(model, groups)[0].logprobs
        other = vision_groups(processor, [4], seed=1)[0][3]
        swapped = packed_vision_token_logprobs(model, [(*groups[0][:3], other)], "cpu", kernel="sdpa")[0].logprobs
        assert not torch.allclose(swapped, naive, atol=1e-4)
        from tidal.trainer import vision_packing

        real = vision_packing.packed_positions
        try:
            vision_packing.packed_positions = lambda model, packed, groups: packed.position_ids.expand(3, -1, -1)
            plain = packed_vision_token_logprobs(model, groups, "cpu", kernel="sdpa")[0].logprobs
        finally:
            vision_packing.packed_positions = real
    assert not torch.allclose(plain, naive, atol=1e-4)


def as_group(packing_group, rewards) -> Group:
    prompt, responses, _, images = packing_group
    samples = [Sample(np.array(r, dtype=np.int32), np.full(len(r), -1.0, dtype=np.float32), float(w)) for r, w in zip(responses, rewards)]
    return Group(0, 0, 0, "w", np.array(prompt, dtype=np.int32), samples, images=images)


def test_learner_trains_groups_with_images_packed_as_per_sample(model, processor):
    """The learner's packed path (one encoding per group) adds the gradient its naive path (per sample) adds."""
    groups = [as_group(g, [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0]) for g in vision_groups(processor, [8, 8], seed=2)]
    grads = {}
    for attention in ("segmented", "naive"):
        learner = Learner(TrainerConfig(attention=attention), copy.deepcopy(model), processor.tokenizer.pad_token_id, device="cpu")
        assert learner.train_on_groups(groups) == sum(len(s.token_ids) for g in groups for s in g.samples)
        grads[attention] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert any(g.abs().sum() > 0 for g in grads["naive"].values())
    for name, grad in grads["naive"].items():
        torch.testing.assert_close(grads["segmented"][name], grad, atol=ATOL, rtol=RTOL, msg=name)

"""Shared-prompt packing for vision-language models (Qwen2-VL's M-RoPE): one copy of each group's prompt and
image, the vision encoder run once for the whole packed row.

A vision group is a packing group (`tidal.trainer.packing.Group`) with its images as a fourth element
(`ImageInputs`: pixel patches and grid). The packed row is built as for text; what changes:

* the images of every group of the row are encoded in one call (each image once), and their features fill
  the prompts' image tokens in order;
* positions are M-RoPE's three rows (time, height, width). A prompt's come from the model's own
  `get_rope_index` on the prompt alone; response token j of every response sits at the prompt's largest
  position + 1 + j in all three rows, which is where an unpacked row ``prompt + response`` puts it (text
  after the last image continues one past the largest position so far);
* the attention implementation is switched on the language model's config only: the vision tower keeps its
  own (a composite config passes a top-level setting down to both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tidal.algo.logprobs import token_logprobs_from_logits
from tidal.images import ImageInputs
from tidal.model.vision import image_token_id, prompt_positions, rope_owner, text_config
from tidal.trainer.packing import (
    _HF_ATTENTION,
    _PAD_ID,
    GroupTokenLogprobs,
    PackedBatch,
    _attention_implementation,
    _attention_inputs,
    group_parts,
    pack_groups,
    packed_rows,
    resolve_kernel,
    split_per_group,
)


@dataclass(frozen=True)
class PackedImages:
    """The images of a packed row, each group's once, and the row's M-RoPE positions."""

    pixel_values: torch.Tensor  # [patches, D]
    image_grid_thw: torch.Tensor  # [images, 3]
    position_ids: torch.Tensor  # [3, 1, T]


def group_images(group: Sequence) -> ImageInputs | None:
    return group[3] if len(group) > 3 else None


def has_images(groups: Sequence[Sequence]) -> bool:
    return any(group_images(g) is not None for g in groups)


def packed_positions(model: torch.nn.Module, packed: PackedBatch, groups: Sequence[Sequence]) -> torch.Tensor:
    """[3, 1, T] positions of the packed row: each prompt's own, each response continuing one past its prompt's largest."""
    owner, image_token = rope_owner(model), image_token_id(model)
    ids = packed.input_ids[0]
    rows, start = [], 0
    for g, group in enumerate(groups):
        prompt_len = packed.prompt_lengths[g]
        prompt = prompt_positions(owner, ids[start : start + prompt_len], group_images(group), image_token)
        rows.append(prompt)
        following = packed.position_ids[0, start + prompt_len : start + prompt_len + sum(len(r) for r in group[1])]
        rows.append((following - prompt_len + prompt.max() + 1).expand(3, -1))  # packed positions restart at P per response
        start += prompt_len + following.numel()
    return torch.cat(rows, dim=1)[:, None]


def embeddings_with_images(
    model: torch.nn.Module, ids: torch.Tensor, slots: torch.Tensor, pixel_values: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """Token embeddings of `ids` with the images' features in the prompt's image slots (`slots`, bool like `ids`),
    the vision tower called once for all the images. An image token a response sampled keeps its plain
    embedding, as in the engine's decoding (HF's own forward would put image features there too)."""
    features = rope_owner(model).get_image_features(pixel_values, grid, return_dict=True).pooler_output
    features = torch.cat(features, dim=0)
    embeds = model.get_input_embeddings()(ids)
    if int(slots.sum()) != features.shape[0]:
        raise ValueError(f"the prompts hold {int(slots.sum())} image tokens for {features.shape[0]} image features")
    return embeds.masked_scatter(slots[..., None], features.to(embeds.dtype))


def pack_images(model: torch.nn.Module, packed: PackedBatch, groups: Sequence[Sequence]) -> PackedImages:
    device = packed.input_ids.device
    present = [group_images(g) for g in groups if group_images(g) is not None]
    pixels = torch.cat([torch.tensor(i.pixel_values) for i in present]).to(device)
    grid = torch.cat([torch.tensor(i.image_grid_thw) for i in present]).to(device)
    return PackedImages(pixels, grid, packed_positions(model, packed, groups))


def packed_vision_token_logprobs(
    model: torch.nn.Module,
    groups: Sequence[Sequence],
    device: torch.device | str,
    temperature: float = 1.0,
    kernel: str = "auto",
    with_entropy: bool = False,
) -> list[GroupTokenLogprobs]:
    """`packing.packed_token_logprobs` for groups with images: one forward, each image encoded once."""
    packed, rows = packed_vision_rows(model, groups, device, temperature, kernel, with_entropy)
    return split_per_group(rows, packed.group_sizes, packed.response_lengths)


def packed_vision_rows(
    model: torch.nn.Module,
    groups: Sequence[Sequence],
    device: torch.device | str,
    temperature: float = 1.0,
    kernel: str = "auto",
    with_entropy: bool = False,
) -> tuple[PackedBatch, GroupTokenLogprobs]:
    """`packed_vision_token_logprobs` as one block of response rows, every group's in order, and the packed row."""
    packed = pack_groups(groups, device=device)
    images = pack_images(model, packed, groups)
    kernel = resolve_kernel(kernel, device)
    text = SimpleNamespace(config=text_config(model))
    with _attention_implementation(text, _HF_ATTENTION[kernel]):
        slots = (packed.input_ids == image_token_id(model)) & (packed.response_ids == -1)[None]
        logits = model(
            inputs_embeds=embeddings_with_images(model, packed.input_ids, slots, images.pixel_values, images.image_grid_thw),
            position_ids=images.position_ids,
            logits_to_keep=packed.logit_index,
            use_cache=False,
            **_attention_inputs(packed, kernel),
        ).logits[0]
    return packed, packed_rows(packed, *token_logprobs_from_logits(logits, packed.target_ids, temperature, with_entropy))


def naive_vision_token_logprobs(
    model: torch.nn.Module, groups: Sequence[Sequence], temperature: float = 1.0, with_entropy: bool = False
) -> list[GroupTokenLogprobs]:
    """Reference: every response its own row ``prompt + response`` with its own copy of the images, the model's
    own positions and attention; the vision encoder encodes each group's images G times."""
    device = next(model.parameters()).device
    image_token = image_token_id(model)
    results = []
    for group in groups:
        prompt, responses, masks = group_parts(group)
        images = group_images(group)
        prompt_len, width, size = len(prompt), max((len(r) for r in responses), default=0), len(responses)
        targets = torch.full((size, width), _PAD_ID, dtype=torch.long, device=device)
        mask = torch.zeros(size, width, dtype=torch.bool, device=device)
        loss_mask = torch.zeros(size, width, dtype=torch.bool, device=device)
        for i, (response, sampled) in enumerate(zip(responses, masks)):
            targets[i, : len(response)] = torch.tensor(response, dtype=torch.long, device=device)
            mask[i, : len(response)] = True
            loss_mask[i, : len(response)] = True if sampled is None else torch.tensor([bool(m) for m in sampled], dtype=torch.bool)
        ids = torch.cat([torch.tensor(prompt, dtype=torch.long, device=device).expand(size, -1), targets], dim=1)
        keep = torch.arange(prompt_len - 1, prompt_len + width - 1, device=device)
        if images is None:
            logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        else:
            slots = torch.zeros_like(ids, dtype=torch.bool)
            slots[:, :prompt_len] = ids[:, :prompt_len] == image_token
            grid = torch.tensor(images.image_grid_thw, device=device).repeat(size, 1)
            pixels = torch.tensor(images.pixel_values, device=device).repeat(size, 1)
            # the model's own positions for each whole row, its prompt's images the only images in it
            positions, _ = rope_owner(model).get_rope_index(ids, mm_token_type_ids=slots.long(), image_grid_thw=grid)
            embeds = embeddings_with_images(model, ids, slots, pixels, grid)
            logits = model(inputs_embeds=embeds, position_ids=positions, logits_to_keep=keep, use_cache=False).logits
        logprobs, entropy = token_logprobs_from_logits(logits, targets, temperature, with_entropy)
        results.append(
            GroupTokenLogprobs(logprobs.masked_fill(~mask, 0.0), mask, entropy.masked_fill(~mask, 0.0) if with_entropy else None, loss_mask)
        )
    return results

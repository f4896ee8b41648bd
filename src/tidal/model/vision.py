"""A vision-language model's processor: its tokenizer and its image processor, saved in the model's directory.

Our own pairing rather than transformers' `ProcessorMixin`: the chat template puts one image token per
image, and `encode` widens each to the number of tokens the image processor's grid gives (grid cells /
merge_size^2), on token ids, so the text is never re-tokenized around the image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tidal.images import ImageInputs, open_image

IMAGE_TOKEN = "<|image_pad|>"


@dataclass
class VisionProcessor:
    tokenizer: object
    image_processor: object

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    def process_images(self, images: list[bytes]) -> ImageInputs:
        out = self.image_processor(images=[open_image(b) for b in images], return_tensors="np")
        return ImageInputs(np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"], dtype=np.int64))

    def expand_image_tokens(self, ids: list[int], inputs: ImageInputs) -> list[int]:
        """Each image token of `ids` widened to its image's token count, in order."""
        counts = iter(int(n) // self.merge_size**2 for n in inputs.image_grid_thw.prod(axis=1))
        out: list[int] = []
        for token in ids:
            out += [token] * next(counts) if token == self.image_token_id else [token]
        if next(counts, None) is not None:
            raise ValueError(f"{len(inputs.image_grid_thw)} images for fewer image tokens in the prompt")
        return out

    def encode(self, ids: list[int], images: list[bytes]) -> tuple[list[int], ImageInputs]:
        """Prompt ids with one image token per image -> the model's prompt ids and image inputs."""
        inputs = self.process_images(images)
        placeholders = sum(1 for t in ids if t == self.image_token_id)
        if placeholders != len(images):
            raise ValueError(f"the prompt has {placeholders} image tokens for {len(images)} images")
        return self.expand_image_tokens(ids, inputs), inputs

    def save_pretrained(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)


def load_processor(path: str | Path) -> VisionProcessor:
    """The tokenizer and image processor saved with a vision-language model."""
    from transformers import AutoImageProcessor

    from tidal.model.loading import load_tokenizer

    return VisionProcessor(load_tokenizer(path), AutoImageProcessor.from_pretrained(str(path), backend="pil"))


def is_vision_model(config) -> bool:
    """Whether a model config has a vision tower (Qwen2-VL and alike)."""
    return getattr(config, "vision_config", None) is not None


def rope_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module that computes M-RoPE positions (Qwen2-VL's inner model), under any wrapper (peft, DDP)."""
    for module in model.modules():
        if hasattr(module, "get_rope_index"):
            return module
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen2-VL-style vision-language model")


def text_config(model: torch.nn.Module):
    """The language model's config (its attention implementation is the packed layout's to switch)."""
    return rope_owner(model).config.get_text_config()


def image_token_id(model: torch.nn.Module) -> int:
    return int(rope_owner(model).config.image_token_id)


def prompt_positions(owner: torch.nn.Module, prompt: torch.Tensor, images: ImageInputs | None, image_token: int) -> torch.Tensor:
    """[3, P] M-RoPE positions of one prompt on its own (plain 0..P-1 in each row when it has no image), by the
    model's own rule (`owner` is `rope_owner(model)`)."""
    if images is None:
        return torch.arange(len(prompt), device=prompt.device).expand(3, -1)
    grid = torch.tensor(images.image_grid_thw, device=prompt.device)
    token_types = (prompt == image_token).long()[None]
    positions, _ = owner.get_rope_index(prompt[None], mm_token_type_ids=token_types, image_grid_thw=grid)
    return positions[:, 0]

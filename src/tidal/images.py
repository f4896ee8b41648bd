"""Images in prompts: reading them from data rows, checking them, and the processed inputs a group carries.

A data row names its images as file paths (relative to the JSONL file) or as base64 bytes; they are read
once, checked (a PIL-readable image, not too many bytes or pixels) and kept as the file's bytes. A work
item carries those bytes, once per prompt; the worker's processor turns them into the model's inputs
(`ImageInputs`: pixel patches and each image's grid), which the group carries once for its G samples,
so the trainer encodes each image once per group. Numpy and PIL only: the protocol module uses this.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_IMAGE_BYTES = 8 * 1024 * 1024  # one encoded image file
MAX_IMAGE_PIXELS = 4096 * 4096  # one decoded image (width x height); beyond it PIL's decompression-bomb territory
MAX_IMAGES_PER_PROMPT = 16
# where an image goes in a prompt without a chat template (Qwen2-VL's tokens; the processor widens the image token)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class ImageError(ValueError):
    """An image that cannot be used; the text names it and says why."""


def check_image_bytes(data: bytes, what: str) -> bytes:
    """`data` if it is one readable image within the limits, else ImageError naming `what`."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what}: {len(data)} bytes, more than the {MAX_IMAGE_BYTES}-byte limit for one image")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageError(f"{what}: {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS}-pixel limit")
            image.verify()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{what}: not a readable image ({type(err).__name__}: {err})") from None
    return data


def open_image(data: bytes):
    """The RGB PIL image of checked bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def row_images(value: Any, base_dir: Path, what: str) -> tuple[bytes, ...]:
    """A data row's `images`: a list of file paths (relative to `base_dir`) or {"bytes": base64} entries."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_IMAGES_PER_PROMPT:
        raise ImageError(f"{what}: 'images' must be a list of at most {MAX_IMAGES_PER_PROMPT} paths or {{'bytes': base64}} entries")
    out = []
    for i, entry in enumerate(value):
        where = f"{what}: images[{i}]"
        if isinstance(entry, str):
            path = Path(entry) if Path(entry).is_absolute() else base_dir / entry
            if not path.is_file():
                raise ImageError(f"{where}: image file not found: {path}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{where}: {path} has {path.stat().st_size} bytes, more than the {MAX_IMAGE_BYTES}-byte limit")
            out.append(check_image_bytes(path.read_bytes(), f"{where} ({path})"))
        elif isinstance(entry, dict) and isinstance(entry.get("bytes"), str):
            try:
                data = base64.b64decode(entry["bytes"], validate=True)
            except (binascii.Error, ValueError):
                raise ImageError(f"{where}: 'bytes' is not base64") from None
            out.append(check_image_bytes(data, where))
        else:
            raise ImageError(f"{where}: expected a file path or {{'bytes': base64}}, got {type(entry).__name__}")
    return tuple(out)


@dataclass
class ImageInputs:
    """The processed images of one prompt, in prompt order: every image's patches stacked, and its grid."""

    pixel_values: np.ndarray  # float32 [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: np.ndarray  # int64 [images, 3]: (temporal, height, width) in patches

    def to_wire(self) -> dict:
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    def tokens(self, merge_size: int) -> int:
        """Image tokens the prompt holds for these images."""
        return int(self.image_grid_thw.prod(axis=1).sum()) // (merge_size * merge_size)


def image_inputs_from(value: Any, what: str, error: type[Exception] = ValueError) -> ImageInputs | None:
    """A group's `images` from the wire, checked: a grid of positive integers, one row of patches per grid cell,
    finite pixel values."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise error(f"{what}: expected a map with pixel_values and image_grid_thw, got {type(value).__name__}")
    pixels, grid = value.get("pixel_values"), value.get("image_grid_thw")
    if not isinstance(grid, np.ndarray) or grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu":
        raise error(f"{what}.image_grid_thw: expected an [images, 3] integer array")
    if not 0 < grid.shape[0] <= MAX_IMAGES_PER_PROMPT or (grid <= 0).any():
        raise error(f"{what}.image_grid_thw: 1 to {MAX_IMAGES_PER_PROMPT} images of positive sizes expected, got {grid.tolist()[:4]}")
    if not isinstance(pixels, np.ndarray) or pixels.ndim != 2 or pixels.dtype.kind != "f":
        raise error(f"{what}.pixel_values: expected a 2-D float array")
    patches = int(grid.prod(axis=1).sum())
    if pixels.shape[0] != patches:
        raise error(f"{what}.pixel_values: {pixels.shape[0]} patch rows for a grid of {patches} patches")
    if not np.isfinite(pixels).all():
        raise error(f"{what}.pixel_values: not finite")
    return ImageInputs(pixels.astype(np.float32, copy=False), grid.astype(np.int64, copy=False))


def image_bytes_from(value: Any, what: str, error: type[Exception] = ValueError) -> list[bytes] | None:
    """A work item's `images` from the wire: encoded image files (checked by the worker when it opens them)."""
    if value is None:
        return None
    if not isinstance(value, list) or not 0 < len(value) <= MAX_IMAGES_PER_PROMPT or not all(isinstance(v, bytes) for v in value):
        raise error(f"{what}: expected a list of 1 to {MAX_IMAGES_PER_PROMPT} encoded images (bytes)")
    too_large = [len(v) for v in value if len(v) > MAX_IMAGE_BYTES]
    if too_large:
        raise error(f"{what}: an image of {too_large[0]} bytes, more than the {MAX_IMAGE_BYTES}-byte limit")
    return value

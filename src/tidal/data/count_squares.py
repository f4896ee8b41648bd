"""The synthetic image task `count_squares`: "how many red squares?" over a small image of coloured squares,
made from the seed in memory (PNG bytes), like the arithmetic task; nothing is read or written."""

from __future__ import annotations

import hashlib
import io
import random

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
COUNT_QUESTION = "how many {colour} squares?\n"


def count_image(rng: random.Random, target: str, count: int, side: int = 56, cell: int = 14, distractors: int = 2):
    """A `side`x`side` white image with `count` squares of colour `target` and `distractors` of others,
    one per cell of a grid, so that squares never overlap."""
    from PIL import Image, ImageDraw

    cells = [(x, y) for x in range(0, side, cell) for y in range(0, side, cell)]
    others = [c for c in COLOURS if c != target]
    placed = rng.sample(cells, count + distractors)
    image = Image.new("RGB", (side, side), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i, (x, y) in enumerate(placed):
        colour = COLOURS[target] if i < count else COLOURS[rng.choice(others)]
        draw.rectangle([x + 2, y + 2, x + cell - 3, y + cell - 3], fill=colour)
    return image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def count_problem_images(seed: int, total: int, max_count: int, max_distractors: int) -> list[tuple[bytes, int]]:
    """`total` distinct images (PNG bytes) with their red-square counts, uniform in 0..max_count, and 0..max_distractors
    squares of other colours each (at most the grid's 16 cells in all)."""
    rng = random.Random(f"tidal-count-squares-{seed}")
    seen: set[bytes] = set()
    out: list[tuple[bytes, int]] = []
    for _ in range(total * 20):  # distinct images are plentiful: the bound only stops a pathological setting
        count = rng.randint(0, max_count)
        data = png_bytes(count_image(rng, "red", count, distractors=rng.randint(0, min(max_distractors, 16 - count))))
        digest = hashlib.sha256(data).digest()
        if digest not in seen:
            seen.add(digest)
            out.append((data, count))
            if len(out) == total:
                return out
    raise ValueError(f"data.max_count={max_count} and data.max_distractors={max_distractors} give fewer than {total} distinct images")

"""The built-in vision task `task:shapes` (registered in `packrl.registry.TASKS`): count the
shapes in a synthetic image.

Each row is one image (``data.shapes.image_size`` pixels square, white) with 1 to
``data.shapes.max_shapes`` filled circles, squares and triangles of random colours at places
that do not overlap, drawn with Pillow, and the question how many there are. The answer is in
the image only: the text is the same for every row. A row is verl's RL schema with the image
as PNG bytes::

    {"prompt": [{"role": "user", "content": "<image>How many shapes are in the image? ..."}],
     "images": [{"bytes": b"\\x89PNG..."}],
     "reward_model": {"ground_truth": "3"}, "data_source": "packrl/shapes"}

Rows are drawn from ``random.Random(seed)``; the validation split uses ``seed +
VAL_SEED_OFFSET`` (the images differ even where a count repeats).
"""

from __future__ import annotations

import io
import random

from packrl.data.task_sources import TaskRequest
from packrl.registry import TASKS

SHAPES_SOURCE = "packrl/shapes"
QUESTION = 'How many shapes are in the image? Output the number after "####".'
_KINDS = ("circle", "square", "triangle")
_PLACEMENT_TRIES = 200


def _boxes(rng: random.Random, count: int, size: int) -> list[tuple[int, int, int]]:
    """``count`` non-overlapping squares ``(x, y, side)`` inside a ``size`` canvas (fewer when
    they do not fit)."""
    side = max(8, size // 5)
    boxes: list[tuple[int, int, int]] = []
    for _ in range(_PLACEMENT_TRIES):
        if len(boxes) == count:
            break
        s = rng.randint(side * 2 // 3, side)
        x, y = rng.randint(1, size - s - 2), rng.randint(1, size - s - 2)
        if all(x + s + 2 <= bx or bx + bs + 2 <= x or y + s + 2 <= by or by + bs + 2 <= y for bx, by, bs in boxes):
            boxes.append((x, y, s))
    return boxes


def shapes_image(rng: random.Random, count: int, size: int) -> tuple[bytes, int]:
    """A PNG of up to ``count`` shapes on a ``size`` x ``size`` white canvas, and how many it holds."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    boxes = _boxes(rng, count, size)
    for x, y, s in boxes:
        colour = tuple(rng.randint(0, 200) for _ in range(3))
        kind = rng.choice(_KINDS)
        if kind == "circle":
            draw.ellipse((x, y, x + s, y + s), fill=colour)
        elif kind == "square":
            draw.rectangle((x, y, x + s, y + s), fill=colour)
        else:
            draw.polygon([(x + s // 2, y), (x, y + s), (x + s, y + s)], fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), len(boxes)


def shapes_rows(num_rows: int, max_shapes: int, image_size: int, seed: int) -> list[dict]:
    """Generate `task:shapes` rows (module docstring).

    Args:
        num_rows: rows to return.
        max_shapes: at most this many shapes per image (counts are drawn uniformly from 1..max).
        image_size: side of each image, pixels (>= 28).
        seed: seeds the draw; the same arguments always give the same rows.

    Raises:
        ValueError: a non-positive count, or an image smaller than 28 pixels; Pillow missing.
    """
    if num_rows < 1 or max_shapes < 1 or image_size < 28:
        raise ValueError(f"task:shapes needs num_rows >= 1, max_shapes >= 1 and image_size >= 28; got {num_rows}, "
                         f"{max_shapes}, {image_size}: set data.shapes.*")
    try:
        import PIL  # noqa: F401
    except ImportError as err:
        raise ValueError("task:shapes draws its images with Pillow, which is not installed: pip install 'packrl[vision]'") from err
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        png, count = shapes_image(rng, rng.randint(1, max_shapes), image_size)
        rows.append({"prompt": [{"role": "user", "content": "<image>" + QUESTION}], "images": [{"bytes": png}],
                     "reward_model": {"style": "rule", "ground_truth": str(count)}, "data_source": SHAPES_SOURCE})
    return rows


@TASKS.register("shapes")
def shapes_task(request: TaskRequest) -> list[dict]:
    """``task:shapes``: `shapes_rows` of ``data.shapes`` (``request.options``), drawn from the request's split seed."""
    cfg = request.options
    return shapes_rows(cfg.num_rows, cfg.max_shapes, cfg.image_size, request.split_seed)

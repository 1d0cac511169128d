"""Images of vision-language rows: where they come from, reading them, and sizing them to a budget.

An image reference in a row is a path (relative to the data file), a ``file://`` path, a dict
with ``bytes`` and/or ``path`` (parquet image columns), or a Pillow image. Reading one can fail
(missing file, unreadable or empty data, an aspect ratio over 200 that the Qwen-VL processors
refuse): the row is then rejected with the reason, as other bad rows are.

Sizing (`fit_sizes`): Qwen2-VL-style processors resize each image to sides that are multiples of
``factor = patch_size x merge_size`` (28 for Qwen2-VL) with an area in ``[min_pixels,
max_pixels]`` (transformers' ``smart_resize``), one language-model token per ``factor^2``
pixels. packrl picks each image's size itself, the same way, with ``data.image.max_pixels`` /
``min_pixels`` over the processor's own; when a row's images together exceed
``data.max_image_tokens`` or what the prompt budget leaves after the text, every image of the
row is shrunk by one linear scale, the largest that fits, each side rounded to a multiple of
``factor`` (the aspect ratio kept within that rounding). The image is then resized to exactly that
size with Pillow (bicubic) before the processor, whose own resize leaves it unchanged, so the
rollout engine and the trainer see the same pixels and the budget counts the real tokens.
A prompt is never cut inside an image: a row whose images cannot fit even at ``min_pixels`` is
filtered (or, under ``data.overlong_prompt=error``, named).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrl.config.schema import ImageConfig

MAX_ASPECT_RATIO = 200
"""Qwen-VL processors refuse more elongated images."""


@dataclass(frozen=True)
class ImageRef:
    """Where one image is: raw ``data`` (encoded bytes), a ``path``, or an in-memory ``image``."""

    data: bytes | None = None
    path: Path | None = None
    image: Any = None

    def describe(self) -> str:
        return repr(str(self.path)) if self.path is not None else "bytes" if self.data is not None else "an in-memory image"


def image_ref(value: Any, base_dir: Path | None) -> ImageRef | str:
    """The `ImageRef` of a row's image value, or the reason it is not one."""
    if hasattr(value, "size") and hasattr(value, "convert"):  # a Pillow image
        return ImageRef(image=value)
    data, ref = None, value
    if isinstance(value, dict):
        data, ref = value.get("bytes"), value.get("path") or value.get("image")
        if isinstance(ref, dict) or (hasattr(ref, "size") and hasattr(ref, "convert")):
            return image_ref(ref, base_dir)
    if isinstance(data, str):  # text formats (jsonl) carry bytes as base64
        if not data:
            return "an image has empty bytes"
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return "an image's 'bytes' is text that is not base64 (a jsonl row holds an image's bytes as base64, or give its path)"
    if isinstance(data, (bytes, bytearray)):
        return ImageRef(data=bytes(data)) if data else "an image has empty bytes"
    if isinstance(ref, str) and ref:
        if ref.startswith(("http://", "https://")):
            return f"image {ref!r} is a URL; packrl reads images from files or bytes (download it first)"
        path = Path(ref.removeprefix("file://")).expanduser()
        return ImageRef(path=path if path.is_absolute() or base_dir is None else base_dir / path)
    seen = f"a dict with keys {', '.join(sorted(map(str, value)))}" if isinstance(value, dict) else f"a {type(value).__name__}"
    return (f"an image is neither a path, bytes (base64 text in jsonl) nor a Pillow image ({seen}; give 'path' or 'bytes' "
            "a non-empty value)")


def open_image(ref: ImageRef) -> Any:
    """The image as an RGB Pillow image, fully read.

    Raises:
        ValueError: a missing file, unreadable or empty data, a side of 0 pixels, or an aspect
            ratio over `MAX_ASPECT_RATIO` (the reason names the image).
    """
    try:
        from PIL import Image
    except ImportError as err:
        raise ValueError("images need Pillow, which is not installed: pip install 'packrl[vision]'") from err
    if ref.path is not None and ref.path.is_file() and ref.path.stat().st_size == 0:
        raise ValueError(f"image file {ref.describe()} is empty (0 bytes)")
    try:
        if ref.image is not None:
            image = ref.image
        elif ref.data is not None:
            image = Image.open(io.BytesIO(ref.data))
        else:
            assert ref.path is not None  # an ImageRef holds one of the three
            image = Image.open(ref.path)
        image.load()
    except FileNotFoundError:
        raise ValueError(f"image file {ref.describe()} does not exist") from None
    except Exception as err:  # Pillow raises several types for unreadable data
        raise ValueError(f"image {ref.describe()} is not a readable image ({type(err).__name__})") from err
    width, height = image.size
    if min(width, height) < 1:
        raise ValueError(f"image {ref.describe()} is {width}x{height} pixels (empty)")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {ref.describe()} is {width}x{height} pixels: aspect ratio over {MAX_ASPECT_RATIO}, which "
                         "the Qwen-VL processors refuse")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageGeometry:
    """How a processor turns an image size into tokens (Qwen2-VL style).

    Attributes:
        factor: pixels per side of one language-model token (patch x merge; 28 for Qwen2-VL).
        merge: the spatial merge (patches per token side).
        min_pixels / max_pixels: the resized area bounds, pixels.
        extra_tokens: tokens around each image's placeholders (``<|vision_start|>``, ``<|vision_end|>``).
    """

    factor: int
    merge: int
    min_pixels: int
    max_pixels: int
    extra_tokens: int = 2

    @classmethod
    def of(cls, processor: Any, image: ImageConfig) -> ImageGeometry:
        """The geometry of ``processor``'s image processor, with ``data.image.min/max_pixels``
        (``image``) over its own.

        Raises:
            ValueError: an image processor without Qwen2-VL-style ``patch_size``/``merge_size``.
        """
        ip = processor.image_processor
        patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
        if not isinstance(patch, int) or not isinstance(merge, int):
            raise ValueError(f"{type(ip).__name__} has no patch_size/merge_size; packrl sizes images for Qwen2-VL-style processors")
        size = getattr(ip, "size", None) or {}
        own_min = getattr(ip, "min_pixels", None) or _get(size, "shortest_edge") or 56 * 56
        own_max = getattr(ip, "max_pixels", None) or _get(size, "longest_edge") or 28 * 28 * 1280
        return cls(patch * merge, merge, image.min_pixels or own_min, image.max_pixels or own_max)

    def resized(self, width: int, height: int, max_pixels: int | None = None) -> tuple[int, int]:
        """``(width, height)`` after transformers' ``smart_resize`` with this geometry (a lower
        ``max_pixels`` to shrink further)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=max(self.min_pixels, max_pixels or self.max_pixels))
        return w, h

    def tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of an image already at a resized size."""
        return (width // self.factor) * (height // self.factor)


def _get(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return value if isinstance(value, int) else None


def fit_sizes(sizes: list[tuple[int, int]], geometry: ImageGeometry, max_tokens: int | None) -> list[tuple[int, int]] | None:
    """Each image's resized ``(width, height)``, all shrunk by one linear scale, the largest at
    which the images' tokens (placeholders + markers) total at most ``max_tokens`` (None: no
    bound).

    Unshrunk, an image gets transformers' ``smart_resize`` size (`ImageGeometry.resized`). Shrunk
    by ``scale``, each side of its unshrunk extent (the original, scaled down to ``max_pixels``)
    is rounded to the nearest multiple of ``factor`` (at least one), so the aspect ratio is kept
    up to that rounding: a 20.5:1 image of 41 x 2 tokens one token over its budget becomes
    40 x 2 tokens (20:1), where ``smart_resize``'s floor under a lower ``max_pixels`` gives
    40 x 1 (40:1, half the tokens). An image that would fall below ``min_pixels`` takes its
    ``min_pixels`` size instead (the processor would enlarge it to that). Every size is a
    multiple of ``factor`` with an area in ``[min_pixels, max_pixels]``, which the processor's
    own resize keeps unchanged. The scales tried are the ones at which some side's rounded
    token count changes, from the largest down, so no image shrinks more than the budget needs.

    Returns:
        The sizes, or None when even the smallest sizes (``min_pixels``) do not fit.
    """
    unshrunk = [geometry.resized(w, h) for w, h in sizes]

    def total(out: list[tuple[int, int]]) -> int:
        return sum(geometry.tokens(w, h) + geometry.extra_tokens for w, h in out)

    if max_tokens is None or total(unshrunk) <= max_tokens:
        return unshrunk
    extents = [_extent(w, h, geometry.max_pixels) for w, h in sizes]
    smallest = [_least(w, h, geometry) for w, h in sizes]
    for scale in _scales(extents, geometry.factor):
        fitted = [_scaled(extent, scale, cap, least, geometry)
                  for extent, cap, least in zip(extents, unshrunk, smallest)]
        if total(fitted) <= max_tokens:
            return fitted
    return smallest if total(smallest) <= max_tokens else None


def _least(width: int, height: int, geometry: ImageGeometry) -> tuple[int, int]:
    """The smallest size the processor keeps: ``smart_resize`` to ``min_pixels``, whose floor can
    land under ``min_pixels`` (42 x 84 -> 28 x 56, 1,568 < 3,136 pixels), enlarged to it then as
    the processor would enlarge it."""
    least = geometry.resized(width, height, max_pixels=geometry.min_pixels)
    return least if least[0] * least[1] >= geometry.min_pixels else geometry.resized(*least)


def _extent(width: int, height: int, max_pixels: int) -> tuple[float, float]:
    """An image's sides before rounding: the original, scaled down (aspect kept) to ``max_pixels``."""
    shrink = min(1.0, math.sqrt(max_pixels / (width * height)))
    return width * shrink, height * shrink


def _scales(extents: list[tuple[float, float]], factor: int) -> list[float]:
    """The linear scales below 1 at which a side of one of ``extents`` rounds to one more token,
    largest first (each a little above the exact step, so it rounds up there)."""
    steps = {(k - 0.5) * factor / side * (1 + 1e-9) for w, h in extents for side in (w, h)
             for k in range(1, int(side / factor + 0.5) + 1)}
    return sorted((s for s in steps if s < 1.0), reverse=True)


def _scaled(extent: tuple[float, float], scale: float, cap: tuple[int, int], least: tuple[int, int],
            geometry: ImageGeometry) -> tuple[int, int]:
    """``extent`` x ``scale`` with each side rounded to a multiple of ``factor`` (at least one,
    at most the unshrunk ``cap``); the ``min_pixels`` size ``least`` when that is smaller."""
    f = geometry.factor
    width = min(cap[0], max(f, math.floor(extent[0] * scale / f + 0.5) * f))
    height = min(cap[1], max(f, math.floor(extent[1] * scale / f + 0.5) * f))
    return (width, height) if width * height >= geometry.min_pixels else least

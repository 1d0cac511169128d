"""Image tokens of multimodal prompt rows, for Qwen2-VL-style patching (used by `packrl audit`).

A multimodal row is a chat whose message ``content`` is a list of parts, each a dict with a
``type``: ``{"type": "text", "text": str}`` or ``{"type": "image", ...}``. An image part is
sized from its ``width``/``height`` keys (pixels) when both are given, else by reading the
image header with Pillow from ``image`` (a path, or a dict with ``bytes`` or ``path`` as
parquet image columns hold) or ``path``. A relative path is taken relative to the data file.

Image tokens (Qwen2-VL processor defaults; Wang et al. 2024, arXiv 2409.12191, section 2.1):

    patch 14 px, spatial merge 2x2  ->  one token per 28 x 28 pixel cell
    (h, w) = smart_resize(height, width): each side rounded to the nearest multiple of 28
             (at least 28); if h*w > max_pixels = 28*28*1280 both sides shrink by
             sqrt(height*width / max_pixels) and round down to multiples of 28; if
             h*w < min_pixels = 56*56 both grow by sqrt(min_pixels / (height*width)) and
             round up to multiples of 28
    tokens = (h / 28) * (w / 28) + 2           (+2: <|vision_start|> and <|vision_end|>)

    ===========  ========  ======
    image        resized   tokens
    ===========  ========  ======
    224 x 224    224x224   64 + 2
    1000 x 1000  980x980   1225 + 2
    20 x 20      56x56     4 + 2
    ===========  ========  ======

Image tokens are fixed: a prompt policy may shorten the text around an image, never the image.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, TypeGuard

IMAGE_FACTOR = 28
"""Pixels per side of one image token: patch 14 x spatial merge 2 (Qwen2-VL)."""

IMAGE_MIN_PIXELS = 56 * 56
"""Smallest resized image area in pixels (Qwen2-VL processor default ``min_pixels``)."""

IMAGE_MAX_PIXELS = 28 * 28 * 1280
"""Largest resized image area in pixels (Qwen2-VL processor default ``max_pixels``): 1,280 tokens."""

IMAGE_MARKER_TOKENS = 2
"""Tokens around each image's pads: ``<|vision_start|>`` and ``<|vision_end|>``."""

IMAGE_PLACEHOLDER = ""
"""What an image part becomes in the rendered text. Empty: all of the image's tokens, markers
included, are counted by `image_tokens`; a text placeholder would add tokens that a text
tokenizer splits into pieces the vision model's prompt does not have."""

_MAX_ASPECT_RATIO = 200  # the Qwen2-VL processor refuses more elongated images


def smart_resize(height: int, width: int) -> tuple[int, int]:
    """The size (pixels) a Qwen2-VL processor resizes a ``height x width`` image to.

    Returns:
        ``(h, w)``, both multiples of `IMAGE_FACTOR`, with ``IMAGE_MIN_PIXELS <= h*w`` and
        ``h*w <= IMAGE_MAX_PIXELS`` (see the module docstring).

    Raises:
        ValueError: a side < 1 pixel, or an aspect ratio over 200 (the processor refuses it).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size {width}x{height} px: both sides must be >= 1 pixel")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(f"image size {width}x{height} px: aspect ratio > {_MAX_ASPECT_RATIO}, which Qwen2-VL refuses")
    f = IMAGE_FACTOR
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > IMAGE_MAX_PIXELS:
        beta = math.sqrt(height * width / IMAGE_MAX_PIXELS)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < IMAGE_MIN_PIXELS:
        beta = math.sqrt(IMAGE_MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def image_tokens(width: int, height: int) -> int:
    """Prompt tokens of one image of ``width x height`` pixels: grid tokens + 2 markers.

    Raises:
        ValueError: as `smart_resize`.
    """
    h, w = smart_resize(height, width)
    return (h // IMAGE_FACTOR) * (w // IMAGE_FACTOR) + IMAGE_MARKER_TOKENS


def is_image_part(part: Any) -> bool:
    """True for a content part ``{"type": "image", ...}``."""
    return isinstance(part, dict) and part.get("type") == "image"


def split_content(content: Any) -> tuple[str, list[dict]] | None:
    """A list content as (its text with image parts replaced by `IMAGE_PLACEHOLDER`, its image
    parts); None when ``content`` is not a list. Text parts are joined without separators, as
    Qwen2-VL's chat template joins them; parts of other types are dropped."""
    if hasattr(content, "tolist") and not isinstance(content, (list, tuple, str)):
        content = content.tolist()  # a numpy array of parts (pandas-read parquet)
    if not isinstance(content, (list, tuple)):
        return None
    texts, images = [], []
    for part in content:
        if is_image_part(part):
            texts.append(IMAGE_PLACEHOLDER)
            images.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "".join(texts), images


def image_size(part: dict, base_dir: Path | None) -> tuple[int, int]:
    """``(width, height)`` in pixels of an image part.

    Args:
        part: ``{"type": "image", "width": int, "height": int}``, or with ``image``/``path``
            naming a file (relative to ``base_dir``) or ``image`` a dict with ``bytes``/``path``.
        base_dir: the folder of the data file, for relative paths.

    Raises:
        ValueError: no size and no readable image (the message names the part's keys and the
            fix); Pillow missing when a file must be read (with the install command).
    """
    width, height = part.get("width"), part.get("height")
    if _is_int(width) and _is_int(height):
        return int(width), int(height)
    ref = part.get("image") if part.get("image") is not None else part.get("path")
    data, path = None, None
    if isinstance(ref, dict):
        data, ref = ref.get("bytes"), ref.get("path")
    if isinstance(ref, str) and ref:
        if ref.startswith(("http://", "https://")):
            raise ValueError(f"image {ref!r} is a URL, which cannot be read offline; add width and height (pixels) to the part")
        path = Path(ref.removeprefix("file://")).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
    if data is None and path is None:
        keys = ", ".join(sorted(map(str, part))) or "none"
        raise ValueError(f"image part has no width/height and no image file (keys: {keys}); add width and height (pixels)")
    return _read_size(data, path)


def _read_size(data: bytes | None, path: Path | None) -> tuple[int, int]:
    try:
        from PIL import Image
    except ImportError as err:
        raise ValueError(
            "reading image sizes needs Pillow, which is not installed: pip install pillow "
            "(or give width and height, in pixels, in each image part)"
        ) from err
    try:
        if data is not None:
            opened = Image.open(io.BytesIO(data))
        else:
            assert path is not None  # image_size raises before calling with neither
            opened = Image.open(path)
        with opened as image:
            return image.size
    except FileNotFoundError:
        raise ValueError(f"image file {str(path)!r} does not exist; fix the path or give width and height in the part") from None
    except Exception as err:  # Pillow raises several types for unreadable images
        where = repr(str(path)) if data is None else "bytes"
        raise ValueError(f"image {where} is not a readable image ({type(err).__name__}: {err})") from err


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

"""The audit's section on rows with images (`MultimodalStats`), from the prompts training builds.

`packrl.inspect.audit` runs every row, images or not, through `packrl.data.prompts.budget_examples`
with the configured model's prompt encoder, as `PromptDataset.build` does: for a vision-language
``model.path`` that is its processor, which sizes each image under ``data.image.*`` and
``data.max_image_tokens`` and resizes (never cuts) the images of a row over
``data.max_prompt_tokens``; for a text ``model.path`` every row with images is rejected with
training's reason. This module turns those outcomes and prompts into the section:

    vision tokens of a row = sum over its images of (placeholders + start/end markers) at the
                             size the row was fitted to (`packrl.data.images.ImageGeometry`)
    text tokens of a row   = len(prompt ids) - vision tokens (template, text, generation prompt)
    encoder patches        = placeholders x merge^2 per image (what the vision tower runs)

A row with images is a row that training reads as one (its `Example` has images), or a row with
an ``images`` column entry or an ``{"type": "image"}`` content part that training rejects while
reading it (a marker without an image, an image part without a file, ...); the latter are bad
rows with their reasons and count as rejected here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from packrl.data.examples import as_list
from packrl.inspect.audit_report import ImageSizeTokens, LengthStats, MultimodalRow, MultimodalStats, PolicyOutcome
from packrl.models.modality import MODALITIES

if TYPE_CHECKING:
    from packrl.config.schema import DataConfig
    from packrl.data.images import ImageGeometry
    from packrl.data.prompts import DatasetPrompt, LoadedRows
    from packrl.seqlen.prompt_policy import RowOutcome

NEEDS_VISION_MODEL = "a row with images needs a vision-language model.path"
"""The start of training's reason for rejecting a row with images under a text model (`budget_examples`)."""


def is_processor(encoder: Any) -> bool:
    """True for a vision-language model's processor, as `budget_examples` tells it from a tokenizer."""
    return hasattr(encoder, "image_processor")


def image_rows(loaded: LoadedRows) -> list[int]:
    """Global numbers of the rows with images (module docstring), in row order."""
    with_images = {e.row for e in loaded.examples if e.images}
    return [row for row, raw in enumerate(loaded.raw_rows) if row in with_images or (row in loaded.bad and _raw_images(raw))]


def reads_image_files(loaded: LoadedRows, encoder: Any) -> bool:
    """True when the audit opens image files (a processor reads every image; the files are not in the cache key)."""
    return is_processor(encoder) and any(ref.path is not None for e in loaded.examples for ref in e.images)


def multimodal_stats(
    loaded: LoadedRows,
    encoder: Any,
    data: DataConfig,
    *,
    outcomes: Mapping[int, RowOutcome],
    prompts: Sequence[DatasetPrompt],
    policies: tuple[PolicyOutcome, ...],
    max_image_patches: int | None = None,
) -> MultimodalStats | None:
    """The section on rows with images, or None when no row has images.

    Args:
        loaded: the audited rows.
        encoder: the tokenizer or processor the rows went through.
        data: the ``data`` section (``overlong_prompt``, ``image``, ``max_image_tokens``).
        outcomes: global row -> its outcome under ``data.overlong_prompt`` (``error``: ``filter``), every row.
        prompts: the prompts of rows with images under that policy (`DatasetPrompt.part_sizes` as fitted).
        policies: these rows' counts under each policy.
        max_image_patches: ``train.max_vision_patches_per_microbatch`` (for the description).

    Raises:
        ValueError: a processor without Qwen2-VL-style geometry (as training raises, `ImageGeometry.of`).
    """
    rows = image_rows(loaded)
    if not rows:
        return None
    from packrl.data.images import ImageGeometry

    geometry = ImageGeometry.of(encoder, data.image) if is_processor(encoder) else None
    by_row = {p.example.row: p for p in prompts}
    details = [_row(row, _raw_images(loaded.raw_rows[row]), outcomes[row], by_row.get(row), geometry) for row in rows]
    sized = [d for d in details if d.vision_tokens is not None and d.text_tokens is not None]
    changed = [d for d in details if d.status in ("truncated", "filtered")]
    sizes = _size_table([d.image_sizes for d in sized], geometry) if geometry is not None else []
    return MultimodalStats(
        num_rows=len(rows), num_images=sum(d.num_images for d in details), policy=_row_policy(data.overlong_prompt),
        vision_tokens=LengthStats.from_lengths([d.vision_tokens for d in sized if d.vision_tokens is not None]),
        text_tokens=LengthStats.from_lengths([d.text_tokens for d in sized if d.text_tokens is not None]),
        total_tokens=LengthStats.from_lengths([len(by_row[d.row].prompt_ids) for d in sized]),
        image_sizes=tuple(sizes[: MultimodalStats.MAX_SIZES]), num_sizes=len(sizes), policies=policies,
        rows=tuple(details[: PolicyOutcome.MAX_ROWS]), changed=tuple(changed[: PolicyOutcome.MAX_ROWS]),
        processor=type(encoder).__name__ if geometry is not None else None,
        geometry=asdict(geometry) if geometry is not None else None,
        training=_training(encoder, geometry, data, max_image_patches),
    )


def _row_policy(policy: str) -> str:
    """The policy whose prompts the per-row numbers show: ``error`` builds as ``filter`` (then stops on an overlong row)."""
    return "filter" if policy == "error" else policy


def vision_tokens(sizes: Sequence[tuple[int, int]], geometry: ImageGeometry) -> int:
    """Prompt tokens of images at fitted ``(width, height)`` sizes: placeholders + markers of each."""
    return sum(geometry.tokens(w, h) + geometry.extra_tokens for w, h in sizes)


def _row(row: int, num_images: int, outcome: RowOutcome, prompt: DatasetPrompt | None, geometry: ImageGeometry | None) -> MultimodalRow:
    if prompt is None or geometry is None:
        return MultimodalRow(row, outcome.status, num_images, None, None, (), outcome.reason)
    sizes = tuple((w, h) for w, h in prompt.part_sizes)
    vision = vision_tokens(sizes, geometry)
    return MultimodalRow(row, outcome.status, num_images, vision, len(prompt.prompt_ids) - vision, sizes, outcome.reason)


def _size_table(sizes: Sequence[tuple[tuple[int, int], ...]], geometry: ImageGeometry) -> list[ImageSizeTokens]:
    """One entry per distinct fitted size, the most frequent first (then the largest)."""
    counts = Counter(size for row in sizes for size in row)
    ordered = sorted(counts.items(), key=lambda item: (-item[1], -item[0][0] * item[0][1], item[0]))
    return [ImageSizeTokens(w, h, geometry.tokens(w, h) + geometry.extra_tokens, geometry.tokens(w, h) * geometry.merge ** 2, n)
            for (w, h), n in ordered]


def _training(encoder: Any, geometry: ImageGeometry | None, data: DataConfig, max_image_patches: int | None) -> str:
    """What training does with these rows, and how they were sized (or how to get sizing)."""
    if geometry is None:
        return (f"model.path is a text model, so packrl train rejects them ({NEEDS_VISION_MODEL}); there is no vision or "
                f"text token count per row without a processor: set model.path (or --model) to a vision-language model "
                f"({', '.join(MODALITIES.names())}) to size them")
    cap = f"data.max_image_tokens={data.max_image_tokens}" if data.max_image_tokens is not None else "no data.max_image_tokens"
    if max_image_patches is not None:
        cap += f", train.max_vision_patches_per_microbatch={max_image_patches:,} patches per row's images"
    return (f"sized as packrl train sizes them, by model.path's processor ({type(encoder).__name__}): one token per "
            f"{geometry.factor}x{geometry.factor} pixels, {geometry.min_pixels:,}..{geometry.max_pixels:,} pixels per image "
            f"(data.image.min_pixels/max_pixels or the processor's), {cap}")


def _raw_images(raw: Any) -> int:
    """Images a raw row names: entries of its ``images`` column plus ``{"type": "image"}`` parts of its messages."""
    if not isinstance(raw, dict):
        return 0
    column = as_list(raw.get("images"))
    count = len(column) if isinstance(column, (list, tuple)) else 0
    prompt = as_list(raw.get("prompt"))
    for message in prompt if isinstance(prompt, (list, tuple)) else ():
        parts = as_list(message.get("content")) if isinstance(message, dict) else None
        if isinstance(parts, (list, tuple)):
            count += sum(isinstance(p, dict) and p.get("type") == "image" for p in parts)
    return count

"""Prompt budgets for rows with images, through the model's own processor.

A row's prompt ids are what the processor makes of its chat and images: the template's text
with each image's placeholder expanded to its tokens (``<|vision_start|>`` + one
``<|image_pad|>`` per token + ``<|vision_end|>`` for Qwen2-VL). So the prompt budget
(``data.max_prompt_tokens``) holds text and image tokens together, counted as the rollout
engine and the trainer see them. Per row (`budget_image_examples`):

1. every image is read (unreadable, empty, too elongated or too many: the row is rejected with
   the reason) and sized (`packrl.data.images.fit_sizes`): ``data.image.*`` bounds, then
   ``data.max_image_tokens`` for the row's images together, and the patch budget of a
   micro-batch (``train.max_vision_patches_per_microbatch``: the row's images must fit one)
   (``kept``: asked for);
2. the prompt is rendered; when text + images exceed the budget, the images are shrunk to what
   the budget leaves after the text (``truncated``: the reason says the images were resized, and
   the tokens removed are counted); no policy ever cuts a prompt inside an image's run;
3. a row whose text and smallest images still do not fit is ``filtered`` (named under
   ``data.overlong_prompt=error``).

The sizes are kept with the prompt; the pixels are read again and processed when the prompt is
drawn (`image_inputs`), and their ids checked against the budgeted ones, so a dataset holds ids
and sizes, not pixel tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from packrl.config.grouped_caps import PATCH_LOAD
from packrl.config.schema import DataConfig, ImageConfig
from packrl.data.examples import Example
from packrl.data.images import ImageGeometry, fit_sizes, open_image
from packrl.seqlen.microbatch import CapLimit
from packrl.seqlen.prompt_policy import Policy, RowOutcome
from packrl.seqlen.stats import length_percentiles

if TYPE_CHECKING:
    from packrl.models.image_inputs import ImageInputs


@dataclass(frozen=True)
class ImageRows:
    """The image modality's data side (`packrl.data.prompts.ExtraRows`): rows with images through
    a vision-language model's processor, under ``data.image.*``, ``data.max_image_tokens`` and
    the patch cap (``train.max_vision_patches_per_microbatch``).

    Attributes:
        processor: the model's processor (``image_processor`` + ``tokenizer``).
        image: the ``data.image`` section.
        max_image_tokens: ``data.max_image_tokens`` (None: no bound).
        patch_cap: the patch cap a row's images must fit (None: no bound).
    """

    processor: Any
    image: ImageConfig
    max_image_tokens: int | None
    patch_cap: CapLimit | None

    @cached_property
    def geometry(self) -> ImageGeometry:
        """How the processor sizes images (`ImageGeometry.of`), read when a row with images needs it.

        Raises:
            ValueError: a processor without Qwen2-VL-style geometry.
        """
        return ImageGeometry.of(self.processor, self.image)

    @property
    def tokenizer(self) -> Any:
        """The processor's tokenizer, which renders the text rows."""
        return self.processor.tokenizer

    def budget(self, examples: Sequence[Example], *, max_prompt_tokens: int, policy: Policy) -> list[tuple[Any, RowOutcome]]:
        """`budget_image_examples` under these settings: per example ``(prompt, outcome)``,
        ``prompt`` = ``(prompt_ids, sizes, num_tokens_removed)`` or None."""
        return budget_image_examples(examples, self.processor, geometry=self.geometry, max_prompt_tokens=max_prompt_tokens,
                                     max_image_tokens=self.max_image_tokens, max_images=self.image.max_images_per_row, policy=policy,
                                     patch_cap=self.patch_cap)

    def inputs(self, example: Example, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, ...]]) -> ImageInputs:
        """The drawn prompt's images, read and processed again at ``sizes`` (`image_inputs`)."""
        return image_inputs(self.processor, example, prompt_ids, [(w, h) for w, h in sizes], self.geometry)

    def summary(self, prompts: Sequence[tuple[Sequence[int], Sequence[tuple[int, ...]]]], key: str) -> str:
        """A line on the prompts' text and vision tokens (image placeholders + markers, at the
        sizes the prompts hold) and vision-encoder patches, for ``RUN_DIR/budgets.txt``
        (``prompts``: each prompt's ids and image sizes)."""
        geometry = self.geometry
        vision = [sum(geometry.tokens(w, h) + geometry.extra_tokens for w, h in sizes) for _, sizes in prompts]
        patches = [sum(geometry.tokens(w, h) for w, h in sizes) * geometry.merge ** 2 for _, sizes in prompts]
        text = [len(ids) - v for (ids, _), v in zip(prompts, vision)]
        v, t, n = length_percentiles(vision), length_percentiles(text), length_percentiles(patches)
        return (f"vision ({key}): prompt tokens per prompt: text p50 {t['p50']}, max {t['max']}; vision p50 {v['p50']}, "
                f"max {v['max']} (placeholders + markers); vision-encoder patches per prompt p50 {n['p50']}, max {n['max']}")


def image_rows(encoder: Any, data_cfg: DataConfig, caps: Sequence[CapLimit] = ()) -> ImageRows | None:
    """The `ImageRows` of a vision-language model's processor (one with an ``image_processor``),
    with the ``data`` section's image settings and the patch cap among ``caps``; None for a
    text model's tokenizer."""
    if not hasattr(encoder, "image_processor"):
        return None
    return ImageRows(encoder, data_cfg.image, data_cfg.max_image_tokens, next((c for c in caps if c.name == PATCH_LOAD), None))


def encode_images(processor: Any, chat: Sequence[dict], images: Sequence[Any], sizes: Sequence[tuple[int, int]],
                  geometry: ImageGeometry) -> dict[str, Any]:
    """The processor's outputs (``input_ids`` [1, P], ``pixel_values``, ``image_grid_thw``) for
    ``chat`` with ``images`` resized to ``sizes`` ((width, height) each; the processor's own
    resize then keeps them)."""
    from PIL import Image

    resized = [im if im.size == size else im.resize(size, Image.Resampling.BICUBIC) for im, size in zip(images, sizes)]
    text = processor.apply_chat_template(list(chat), tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=resized, return_tensors="pt",
                     size={"shortest_edge": geometry.min_pixels, "longest_edge": geometry.max_pixels})


def budget_image_examples(examples: Sequence[Example], processor: Any, *, geometry: ImageGeometry, max_prompt_tokens: int,
                          max_image_tokens: int | None, max_images: int, policy: Policy,
                          patch_cap: CapLimit | None = None) -> list[tuple[Any, RowOutcome]]:
    """Fit each image example to the budget (module docstring); ``patch_cap``: the
    vision-encoder patches a row's images may have together (None: no bound).

    Returns:
        Per example, ``(prompt, outcome)``: ``prompt`` is ``(prompt_ids, sizes, num_tokens_removed)``
        or None; ``outcome.row`` is the example's global row.
    """
    out: list[tuple[Any, RowOutcome]] = []
    for example in examples:
        if len(example.images) > max_images:
            reason = f"{len(example.images)} images > data.image.max_images_per_row={max_images}"
            out.append((None, RowOutcome(example.row, "rejected", reason)))
            continue
        try:
            images = [open_image(ref) for ref in example.images]
        except ValueError as err:
            out.append((None, RowOutcome(example.row, "rejected", str(err))))
            continue
        cap = image_token_cap(geometry, len(images), max_image_tokens, None if patch_cap is None else patch_cap.cap)
        out.append(_fit_row(example, images, processor, geometry, max_prompt_tokens, cap, policy))
    return out


def image_token_cap(geometry: ImageGeometry, num_images: int, max_image_tokens: int | None,
                    max_image_patches: int | None) -> tuple[int | None, str]:
    """The image tokens (placeholders + markers) a row of ``num_images`` images may hold:
    ``data.max_image_tokens`` and, from a patch budget, ``patches / merge^2`` placeholders plus
    the markers, whichever is smaller; with the key that sets it (for messages)."""
    caps = []
    if max_image_tokens is not None:
        caps.append((max_image_tokens, f"data.max_image_tokens={max_image_tokens}"))
    if max_image_patches is not None:
        caps.append((max_image_patches // geometry.merge ** 2 + geometry.extra_tokens * num_images,
                     f"train.max_vision_patches_per_microbatch={max_image_patches} (patches)"))
    return min(caps) if caps else (None, "")


def _fit_row(example: Example, images: list[Any], processor: Any, geometry: ImageGeometry, budget: int,
             image_cap: tuple[int | None, str], policy: Policy) -> tuple[Any, RowOutcome]:
    i = example.row
    originals = [im.size for im in images]
    max_image_tokens, cap_key = image_cap
    sizes = fit_sizes(originals, geometry, max_image_tokens)
    if sizes is None:
        return None, RowOutcome(i, "filtered", f"its images need more than {cap_key} even at data.image.min_pixels")
    ids = _ids(processor, example.chat, images, sizes, geometry)
    if len(ids) <= budget:
        return (ids, sizes, 0), RowOutcome(i, "kept", "", len(ids))
    vision = sum(geometry.tokens(w, h) + geometry.extra_tokens for w, h in sizes)
    room = min(budget - (len(ids) - vision), max_image_tokens or budget)
    smaller = fit_sizes(originals, geometry, room) if room > 0 and policy != "filter" else None
    if smaller is not None:
        fitted = _ids(processor, example.chat, images, smaller, geometry)
        if len(fitted) <= budget:
            resized = ", ".join(f"{w}x{h}" for w, h in smaller)
            return (fitted, smaller, len(ids) - len(fitted)), RowOutcome(
                i, "truncated", f"{len(ids)} -> {len(fitted)} tokens (images resized to {resized}; text kept whole)",
                len(ids), len(ids) - len(fitted))
    why = "images are never cut" if policy != "filter" else "data.overlong_prompt=filter"
    return None, RowOutcome(i, "filtered", f"{len(ids)} tokens ({vision} of them image tokens) > data.max_prompt_tokens={budget}; "
                                           f"{why}", len(ids))


def _ids(processor: Any, chat: Sequence[dict], images: list[Any], sizes: list[tuple[int, int]], geometry: ImageGeometry) -> tuple[int, ...]:
    return tuple(encode_images(processor, chat, images, sizes, geometry)["input_ids"][0].tolist())


def image_inputs(processor: Any, example: Example, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, int]],
                 geometry: ImageGeometry) -> Any:
    """The `packrl.models.image_inputs.ImageInputs` of a budgeted image prompt, read and processed again.

    Raises:
        RuntimeError: the processor now gives other prompt ids than at budgeting (an image file
            changed on disk while training).
    """
    from packrl.models.image_inputs import ImageInputs

    out = encode_images(processor, example.chat, [open_image(ref) for ref in example.images], list(sizes), geometry)
    ids = tuple(out["input_ids"][0].tolist())
    if ids != tuple(prompt_ids):
        raise RuntimeError(f"row {example.row}: its images now give a {len(ids)}-token prompt, {len(prompt_ids)} when the "
                           "dataset was built; did an image file change during the run?")
    return ImageInputs(out["pixel_values"], out["image_grid_thw"], merge_size=geometry.merge)

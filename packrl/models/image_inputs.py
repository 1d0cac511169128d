"""A vision-language prompt's images as the model takes them: the `packrl.types.ExtraInputs` of
the image modality (Qwen2-VL layout), read by the batches, the planner and the packs through
that protocol and by the vision module (`packrl.models.vision`) itself.

Shapes: ``n`` images of a prompt · ``Np`` vision-encoder patches (rows of ``pixel_values``) ·
``D`` values per patch (3 x temporal patch x patch^2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from packrl.config.grouped_caps import PATCH_LOAD
from packrl.types import ExtraInputs


@dataclass(frozen=True)
class ImageInputs:
    """One prompt's images as its model's processor produced them (Qwen2-VL layout).

    Attributes:
        pixel_values: every image's patches in order. Shape [Np, D], float32.
        image_grid_thw: per image, its patch grid (temporal, height, width) before the spatial
            merge. Shape [n, 3], int64; ``Np = sum(t*h*w)``.
        merge_size: the spatial merge (2 for Qwen2-VL): an image gives ``t*h*w / merge^2``
            placeholder tokens.

    Raises:
        ValueError: ``image_grid_thw`` is not [n, 3] or its patches are not the rows of ``pixel_values``.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    merge_size: int = 2

    def __post_init__(self) -> None:
        patches = int(self.image_grid_thw.prod(dim=-1).sum()) if self.image_grid_thw.numel() else 0
        if self.image_grid_thw.dim() != 2 or self.image_grid_thw.shape[-1] != 3 or patches != self.pixel_values.shape[0]:
            raise ValueError(f"ImageInputs: image_grid_thw {tuple(self.image_grid_thw.shape)} gives {patches} patches but "
                             f"pixel_values has {self.pixel_values.shape[0]} rows; the processor's outputs must be kept together")

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_patches(self) -> int:
        """Vision-encoder patches (rows of ``pixel_values``): what the encoder's activations and
        its attention scale with."""
        return int(self.pixel_values.shape[0])

    def tokens_per_image(self) -> list[int]:
        """Language-model placeholder tokens of each image: ``t*h*w / merge^2``."""
        return [int(n) // self.merge_size ** 2 for n in self.image_grid_thw.prod(dim=-1).tolist()]

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of all images (the prompt holds exactly these)."""
        return sum(self.tokens_per_image())

    def grouped_loads(self) -> dict[str, int]:
        """``{"vision_patches": num_patches}``: the encoder's patches, counted once per micro-batch
        against ``train.max_vision_patches_per_microbatch``."""
        return {PATCH_LOAD: self.num_patches}

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device), self.merge_size)

    @classmethod
    def batch_metrics(cls, inputs: Sequence[ExtraInputs | None], prompt_lengths: Sequence[int]) -> dict[str, float]:
        """Image tokens of a vision-language rollout's prompts.

        Returns:
            ``prompt_length/vision_tokens/mean|max`` (image placeholder tokens per prompt, as the
            processor expanded them), ``prompt_length/text_tokens/mean`` (the rest of the prompt,
            the image start/end markers included), ``prompt_length/vision_patches/mean``
            (vision-encoder patches per prompt) and ``prompt_length/num_images/mean``.
        """
        images = [x if isinstance(x, ImageInputs) else None for x in inputs]
        vision = [0 if x is None else x.num_tokens for x in images]
        text = [n - v for n, v in zip(prompt_lengths, vision)]
        count = max(1, len(images))
        return {"prompt_length/vision_tokens/mean": sum(vision) / max(1, len(vision)),
                "prompt_length/vision_tokens/max": float(max(vision, default=0)),
                "prompt_length/text_tokens/mean": sum(text) / max(1, len(text)),
                "prompt_length/vision_patches/mean": sum(0 if x is None else x.num_patches for x in images) / count,
                "prompt_length/num_images/mean": sum(0 if x is None else x.num_images for x in images) / count}


def merge_images(images: list[ImageInputs]) -> ImageInputs:
    """Several prompts' images as one input, in order (what the vision tower runs at once)."""
    return ImageInputs(torch.cat([x.pixel_values for x in images]), torch.cat([x.image_grid_thw for x in images]),
                       images[0].merge_size)

"""The micro-batch budgets beyond tokens that a config sets: grouped caps
(`packrl.seqlen.microbatch.GroupedCap`), read by the plan (`packrl.config.plan.BatchPlan`), the
data (a row's parts must fit one micro-batch) and the worker set-up. This module imports no torch.
"""

from __future__ import annotations

from packrl.config.schema import TrainConfig
from packrl.seqlen.microbatch import CapLimit

PATCH_LOAD = "vision_patches"
"""The load a vision-language prompt's images report (`packrl.models.image_inputs.ImageInputs.grouped_loads`)
against ``train.max_vision_patches_per_microbatch``."""


def grouped_cap_limits(train: TrainConfig) -> tuple[CapLimit, ...]:
    """Every micro-batch budget beyond tokens that the ``train`` section sets
    (`packrl.seqlen.microbatch.GroupedCap`: a load per sequence over items a prompt's responses
    share, each item counted once per micro-batch), per rank: the one list a new such budget joins.
    A cap applies to the batches whose prompts report its load (`packrl.types.ExtraInputs.grouped_loads`).

    - ``train.max_vision_patches_per_microbatch``: vision-encoder patches of the distinct images
      a micro-batch holds (``vision_patches``), which set the encoder's activation memory and
      attention cost as the token budget sets the language model's.
    """
    out = []
    if train.max_vision_patches_per_microbatch is not None:
        out.append(CapLimit(PATCH_LOAD, train.max_vision_patches_per_microbatch, "train.max_vision_patches_per_microbatch",
                            unit="vision-encoder patches", fix="lower data.max_image_tokens / data.image.max_pixels"))
    return tuple(out)


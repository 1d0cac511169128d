"""Preflight's image checks for a vision-language model (`packrl.inspect.preflight` runs them
after its modality's rules): what the processor makes of images of common sizes under the run's
image budgets, and the budgets no image fits."""

from __future__ import annotations

from typing import Any

from packrl.config import ConfigProblem
from packrl.config.budgets import PromptRoom
from packrl.config.schema import DataConfig, ModelConfig
from packrl.config.train import TrainConfig

VISION_SIZES = ((224, 224), (448, 448), (1024, 768), (1920, 1080))
"""Image sizes (width, height) preflight reports for a vision-language model."""


def image_preflight(model_cfg: ModelConfig, data: DataConfig, train: TrainConfig,
                    room: PromptRoom | None) -> tuple[list[str], list[ConfigProblem]]:
    """The image modality's preflight (`packrl.models.vision.QwenVL.preflight`): for a
    vision-language model (``model_cfg``: the ``model`` section), the image tokens of
    `VISION_SIZES` as its processor (with the ``data`` section's ``data.image.*`` and
    ``data.max_image_tokens``, and ``train.max_vision_patches_per_microbatch``)
    sizes them and the prompt budget each leaves for text (a note), and the image budgets no image
    fits (problems); a prompt budget it proposes stays within ``room`` (what the model context
    leaves for a prompt; None when unknown). The model's rules are its modality's
    (`packrl.models.vision.vision_run_problems`, read by `packrl.inspect.preflight`)."""
    from packrl.data.images import ImageGeometry, fit_sizes
    from packrl.data.vision_prompts import image_token_cap
    from packrl.models.loading import load_policy_tokenizer, load_prompt_encoder

    patch_cap = train.max_vision_patches_per_microbatch
    out: list[ConfigProblem] = []
    try:
        processor = load_prompt_encoder(model_cfg, load_policy_tokenizer(model_cfg))
        geometry = ImageGeometry.of(processor, data.image)
    except ValueError as err:
        return [], [ConfigProblem("model.path", model_cfg.path, str(err), "see the message")]
    smallest = geometry.tokens(*geometry.resized(28, 28)) + geometry.extra_tokens  # an image at min_pixels
    if data.max_image_tokens is not None and data.max_image_tokens < smallest:
        out.append(ConfigProblem("data.max_image_tokens", data.max_image_tokens,
                                 f"is below the {smallest} tokens of one image at the smallest size (min_pixels={geometry.min_pixels:,}"
                                 ", markers included): every image row would be filtered",
                                 f"set data.max_image_tokens >= {smallest}, or lower data.image.min_pixels"))
    if patch_cap is not None and patch_cap < (smallest - geometry.extra_tokens) * geometry.merge ** 2:
        least = (smallest - geometry.extra_tokens) * geometry.merge ** 2
        out.append(ConfigProblem("train.max_vision_patches_per_microbatch", patch_cap,
                                 f"is below the {least} encoder patches of one image at the smallest size "
                                 f"(min_pixels={geometry.min_pixels:,}): every image row would be filtered",
                                 f"set train.max_vision_patches_per_microbatch >= {least}, or lower data.image.min_pixels"))
    template = _template_tokens(processor, data.system_prompt)
    if data.max_prompt_tokens <= smallest + template:
        out.append(ConfigProblem("data.max_prompt_tokens", data.max_prompt_tokens,
                                 f"leaves no room for text beside the chat template ({template} tokens with one word of text) and "
                                 f"one image at its smallest size ({smallest} tokens)",
                                 f"raise data.max_prompt_tokens well above {smallest + template}"
                                 if room is None or smallest + template < room.max_prompt_tokens else
                                 f"no data.max_prompt_tokens the model context holds is well above {smallest + template} "
                                 f"({room.describe()}): lower rollout.max_response_tokens or data.image.min_pixels, or use a "
                                 "model with a longer context"))
    rows = []
    for width, height in VISION_SIZES:
        cap, cap_key = image_token_cap(geometry, 1, data.max_image_tokens, patch_cap)
        fitted = fit_sizes([(width, height)], geometry, cap)
        if fitted is None:
            rows.append(f"{width}x{height}: does not fit {cap_key}")
            continue
        (w, h), = fitted
        tokens = geometry.tokens(w, h) + geometry.extra_tokens
        patches = geometry.tokens(w, h) * geometry.merge ** 2
        rows.append(f"{width}x{height} -> {w}x{h}: {tokens} tokens, {patches} encoder patches, "
                    f"{data.max_prompt_tokens - tokens} of data.max_prompt_tokens={data.max_prompt_tokens} left for text")
    pixels = f"{geometry.min_pixels:,}..{geometry.max_pixels:,} pixels per image (data.image.min_pixels/max_pixels or the processor's)"
    return [f"vision-language model: one image token per {geometry.factor}x{geometry.factor} pixels, {pixels}; per image: "
            + "; ".join(rows)], out


def _template_tokens(processor: Any, system_prompt: str | None) -> int:
    """Tokens of the chat template around a one-word user message (with ``data.system_prompt``)
    and its generation prompt, as the processor's tokenizer renders it."""
    tokenizer = getattr(processor, "tokenizer", processor)
    chat = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": "x"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])

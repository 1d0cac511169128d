"""Vision-language policies: the image inputs that travel with a sequence, and a packed forward
that keeps every sequence's images, M-RoPE positions and attention its own.

Shapes: ``K`` tokens in a pack · ``H`` hidden size · ``n_i`` images of sequence i · ``Np`` vision
patches (rows of ``pixel_values``) · ``D`` values per patch (3 x temporal patch x patch^2).

Families: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers' ``*ForConditionalGeneration``): a
vision tower turns ``pixel_values`` ([Np, D], every image's patches one after another) into one
embedding per merged patch (``t*h*w / merge^2`` per image, `ImageInputs.num_tokens`), which
replace the prompt's image placeholder tokens (``<|image_pad|>``) in order. Positions are 3-D
(M-RoPE: temporal, height, width; Wang et al. 2024, arXiv 2409.12191, section 2.1): text tokens
advance all three together, an image's tokens take their grid coordinates. Qwen3-VL's tower
also feeds the first language-model layers (deepstack: transformers' ``Qwen3VLTextModel``
takes ``deepstack_visual_embeds``): per fed layer one more feature per placeholder, added to that layer's hidden states at
the image positions; a pack passes them with the mask of its placeholders.

A pack of such sequences (`packed_vision_forward`):

1. the vision tower runs once over the pack's distinct images, concatenated in pack order (its
   own attention is per image: the tower splits on each image's grid); a group's responses
   share their prompt's images, encoded once per pack;
2. the features replace the pack's placeholders in order (a shared image's features go to each
   of its sequences); the count must match exactly;
3. M-RoPE positions are computed per sequence by the model's own ``get_rope_index`` and laid
   side by side, with a fourth, leading row of per-sequence text positions (0..L_i-1): the
   row transformers reads to find a pack's sequence boundaries (its Qwen2-VL text model takes
   ``position_ids`` [4, 1, K]); the vision rows are not monotone and cannot mark them;
4. the language model runs the pack with packrl's attention isolation (`packrl.models.attention`).

Design after verl (``get_rope_index`` per sample with a text row prepended) and the measured
packing check in transformers 5.19/5.24 (a pack equals each sequence alone to 2e-7 in fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from packrl.config.rollout_modes import mode_info
from packrl.errors import ConfigProblem
from packrl.models.image_inputs import PATCH_LOAD, ImageInputs, merge_images
from packrl.models.modality import MODALITIES, Modality
from packrl.seqlen.packing import Pack
from packrl.types import ExtraInputs

if TYPE_CHECKING:
    from packrl.config.schema import ModelConfig, RunConfig

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Vision-language model types packrl trains (M-RoPE packing, their processors' token counts,
Qwen3-VL's deepstack features), each registered in `packrl.models.modality.MODALITIES`."""


class QwenVL:
    """The Qwen-VL families' `packrl.models.modality.Modality`: images, through the functions of
    this module (see its docstring) and `packrl.models.processor`."""

    name: str = "image"
    encoder_module: str = "visual"
    processor_files: tuple[str, ...] = ("preprocessor_config.json", "processor_config.json")
    load_names: tuple[str, ...] = (PATCH_LOAD,)
    shared_prompts_blocker: str = "a vision-language model's M-RoPE positions continue each sequence's own prompt"
    preflight: str = "packrl.inspect.preflight_images:image_preflight"

    def auto_class(self) -> Any:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    def prepare(self, model: torch.nn.Module, cfg: ModelConfig) -> None:
        """``model.freeze_vision_tower``: the tower takes no gradients."""
        if cfg.freeze_vision_tower:
            freeze_vision_tower(model)

    def load_processor(self, model_dir: Path, model_type: str, tokenizer: Any) -> Any:
        from packrl.models.processor import load_processor

        return load_processor(model_dir, model_type, tokenizer)

    def run_problems(self, cfg: RunConfig, *, engine_modalities: Sequence[str], has_critic: bool) -> list[ConfigProblem]:
        return vision_run_problems(cfg, engine_takes_images=self.name in engine_modalities, has_critic=has_critic)

    def packed_forward(self, model: torch.nn.Module, pack: Pack, kwargs: dict[str, Any]) -> torch.Tensor:
        return packed_vision_forward(model, pack, kwargs)

    def check_prompts(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                      extra_inputs: Sequence[ExtraInputs | None] | None) -> None:
        check_image_prompts(model, prompt_ids, extra_inputs)

    def generate_inputs(self, model: torch.nn.Module, extra_inputs: Sequence[ExtraInputs], ids: torch.Tensor) -> dict[str, Any]:
        return image_generate_inputs(model, extra_inputs, ids)


QWEN_VL: Modality = QwenVL()  # the protocol's check of the class
for _model_type in VISION_MODEL_TYPES:
    MODALITIES.register(_model_type)(QWEN_VL)


def vision_run_problems(cfg: RunConfig, *, engine_takes_images: bool, has_critic: bool) -> list[ConfigProblem]:
    """What a vision-language policy cannot run with yet, each a problem naming its keys and its
    fix; the one list worker set-up (`packrl.worker.parts.check_modality_run`) and preflight read.

    Args:
        cfg: the run's config.
        engine_takes_images: whether the run's rollouts take images
            (`packrl.rollout.engine.engine_capabilities`, ``modalities``).
        has_critic: whether the run has a critic (`packrl.config.plan.BatchPlan.has_critic`).
    """
    out = []
    mt, engine = cfg.rollout.multi_turn, cfg.rollout.engine
    if not engine_takes_images and mt.enabled:
        out.append(ConfigProblem("rollout.multi_turn.tools", mt.tools, "does not generate from images: a vision-language model's "
                                 "multi-turn rollouts are not built yet", "set rollout.multi_turn.tools=[]",
                                 keys=("rollout.multi_turn.tools", "model.path")))
    elif not engine_takes_images:
        out.append(ConfigProblem("rollout.engine", engine, "does not generate from images (its registration declares no "
                                 "EngineCapabilities(modalities=('image',)))", "set rollout.engine=hf",
                                 keys=("rollout.engine", "model.path")))
    size = cfg.trainer.sequence_parallel_size
    if size > 1:
        out.append(ConfigProblem("trainer.sequence_parallel_size", size, "does not split image packs over ranks",
                                 "set trainer.sequence_parallel_size=1", keys=("trainer.sequence_parallel_size", "model.path")))
    if has_critic:
        out.append(ConfigProblem("algorithm.adv_estimator", cfg.algorithm.adv_estimator, "needs a critic, which does not read images",
                                 "use grpo, rloo or another critic-free estimator", keys=("algorithm.adv_estimator", "model.path")))
    if mode_info(cfg.trainer.rollout_mode).carries_groups:
        out.append(ConfigProblem("trainer.rollout_mode", cfg.trainer.rollout_mode, "does not carry images across steps",
                                 "set trainer.rollout_mode=sync", keys=("trainer.rollout_mode", "model.path")))
    if cfg.model.lora.rank > 0 and not cfg.model.freeze_vision_tower:
        out.append(ConfigProblem("model.freeze_vision_tower", False, "has no effect with model.lora.rank > 0: the adapters go on "
                                 "the language model only and the vision tower stays frozen",
                                 "set model.freeze_vision_tower=true, or model.lora.rank=0 to train the tower too",
                                 keys=("model.freeze_vision_tower", "model.lora.rank", "model.path")))
    return out


def freeze_vision_tower(model: torch.nn.Module) -> None:
    """``model.freeze_vision_tower``: the vision tower (encoder and merger) takes no gradients."""
    for param in _inner(model).visual.parameters():
        param.requires_grad_(False)


def _inner(model: torch.nn.Module) -> Any:
    """The ``*Model`` of a ``*ForConditionalGeneration`` (through a peft wrapper)."""
    base = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    return cast(Any, base).model


def image_token_id(model: torch.nn.Module) -> int:
    return int(cast(Any, model).config.image_token_id)


def vision_token_ids(config: Any) -> list[int]:
    """The vision tokens of a config (image/video placeholders, vision start/end): never sampled."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if isinstance(getattr(config, n, None), int)})


def vision_features(model: torch.nn.Module, images: ImageInputs) -> list[torch.Tensor]:
    """The vision tower's embeddings of ``images``, one row per placeholder token, in order:
    ``[features, *deepstack]``, each Shape [num_tokens, H] in the tower's dtype. ``deepstack``
    (Qwen3-VL) holds one tensor per language-model layer the tower also feeds (added to that
    layer's hidden states at the image positions); empty for Qwen2-VL / Qwen2.5-VL."""
    inner = _inner(model)
    dtype = inner.visual.get_dtype() if hasattr(inner.visual, "get_dtype") else next(inner.visual.parameters()).dtype
    out = inner.get_image_features(images.pixel_values.to(dtype), images.image_grid_thw, return_dict=True)
    deepstack = getattr(out, "deepstack_features", None) or []
    return [torch.cat(list(out.pooler_output), dim=0), *(torch.cat(list(layer), dim=0) for layer in deepstack)]


def sequence_positions(model: torch.nn.Module, ids: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
    """M-RoPE positions of one sequence, by the model's own ``get_rope_index``.

    Args:
        ids: the sequence's token ids (prompt with its placeholders, then response). Shape [L], int64.
        images: the sequence's images, or None (text: every row is 0..L-1).

    Returns:
        Shape [3, L], int64.
    """
    if images is None or images.num_images == 0:
        return torch.arange(ids.shape[0], device=ids.device).expand(3, -1)
    token_types = (ids == image_token_id(model)).to(torch.int32)[None]  # 1 = image placeholder
    positions, _ = _inner(model).get_rope_index(ids[None], token_types, image_grid_thw=images.image_grid_thw)
    return positions[:, 0]


def vision_embeds(model: torch.nn.Module, input_ids: torch.Tensor, images: list[ImageInputs]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token embeddings with every image placeholder replaced by its vision feature, in order,
    and the language model's other image arguments.

    The vision tower runs once over the distinct images (by object: a group's responses hold
    the same `ImageInputs`), and each sequence's placeholders take its images' features.

    Args:
        input_ids: Shape [b, L], int64.
        images: the images of the rows' placeholders, in row order (rows without images add none).

    Returns:
        ``(embeds, extra)``: embeds Shape [b, L, H], the embeddings' dtype; ``extra`` for a
        Qwen3-VL language model: ``visual_pos_masks`` (Shape [b, L], bool, True = an image
        placeholder) and ``deepstack_visual_embeds`` (per fed layer, Shape [placeholders, H]);
        else empty.

    Raises:
        ValueError: the placeholders and the images' tokens differ in number (a prompt cut
            inside an image, or a sampled placeholder).
    """
    inner = _inner(model)
    embeds = inner.get_input_embeddings()(input_ids)
    placeholders = input_ids == image_token_id(model)
    num_placeholders = int(placeholders.sum())
    present = [x for x in images if x.num_images]
    expected = sum(x.num_tokens for x in present)
    if num_placeholders != expected:
        raise ValueError(f"{num_placeholders} image placeholder tokens but the images give {expected} features; every "
                         "image's placeholder run must be whole (a prompt is never cut inside one) and no response may hold "
                         "placeholders")
    if present:
        distinct = list({id(x): x for x in present}.values())
        sizes = [x.num_tokens for x in distinct]
        own = [dict(zip(map(id, distinct), part.to(embeds.dtype).split(sizes))) for part in vision_features(model, merge_images(distinct))]
        features, *deepstack = [torch.cat([part[id(x)] for x in present]) for part in own]
        embeds = embeds.masked_scatter(placeholders[..., None], features)
        return embeds, ({"visual_pos_masks": placeholders, "deepstack_visual_embeds": deepstack} if deepstack else {})
    if _tower_trains(inner) or (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        embeds = embeds + 0.0 * _idle_vision(model).to(embeds.dtype)
    return embeds, {}


def _tower_trains(inner: Any) -> bool:
    """True when the vision tower takes gradients (``model.freeze_vision_tower=false``, with grad on)."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in inner.visual.parameters())


def _idle_vision(model: torch.nn.Module) -> torch.Tensor:
    """The vision tower on one 16-patch blank image, summed: a pack without images runs the tower
    too, so every rank's sharded tower gathers the same parameters in the same order (a rank
    skipping it would leave the others waiting), and a trainable tower gets a zero gradient from
    a text-only mini-batch, not none: AdamW then steps it by its momentum on one process as on
    several ranks (it skips a parameter without a gradient). Added times 0: no effect on the values."""
    inner = _inner(model)
    cfg = inner.visual.config
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    param = next(inner.visual.parameters())
    blank = torch.zeros(16, patch_dim, dtype=param.dtype, device=param.device)
    grid = torch.tensor([[1, 4, 4]], device=param.device)
    parts = vision_features(model, ImageInputs(blank, grid, merge_size=getattr(cfg, "spatial_merge_size", 2)))
    return torch.stack([part.sum() for part in parts]).sum()  # every output the tower has (deepstack mergers too)


def packed_vision_forward(model: torch.nn.Module, pack: Pack, kwargs: dict[str, Any]) -> torch.Tensor:
    """Final hidden states of a pack of a vision-language model's sequences (see the module
    docstring), each sequence with its own images, positions and attention.

    Args:
        pack: the pack; ``pack.extra_inputs`` holds each packed sequence's images (None for text).
        kwargs: the attention isolation's arguments (`packrl.models.attention.packed_forward`);
            their ``position_ids`` are replaced by the M-RoPE ones.

    Returns:
        Shape [K, H], model dtype.
    """
    if pack.shares_prompts:
        raise ValueError("a vision-language pack cannot share prompts (a response's M-RoPE positions continue its own "
                         "prompt's); set train.share_prompts=false")
    ids = pack.input_ids[0]
    images = [_images(x) for x in pack.extra_inputs or (None,) * len(pack.indices)]
    bounds = pack.cu_seqlens.tolist()
    rows = [sequence_positions(model, ids[bounds[s]:bounds[s + 1]], images[s]) for s in range(len(images))]
    mrope = torch.cat(rows, dim=1)[:, None]  # [3, 1, K]
    positions = torch.cat([pack.position_ids[None].to(mrope.device), mrope])  # [4, 1, K]: text row first
    embeds, extra = vision_embeds(model, pack.input_ids, [x for x in images if x is not None])
    out = _inner(model).language_model(inputs_embeds=embeds, **{**kwargs, **extra, "position_ids": positions})
    return out.last_hidden_state[0]


def _images(x: ExtraInputs | None) -> ImageInputs | None:
    """``x`` as the images it is (None stays None).

    Raises:
        TypeError: ``x`` is another modality's inputs.
    """
    if x is None or isinstance(x, ImageInputs):
        return x
    raise TypeError(f"a vision-language model got {type(x).__name__} as a prompt's extra inputs; it takes ImageInputs")


def check_image_prompts(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                        extra_inputs: Sequence[ExtraInputs | None] | None) -> None:
    """The engine's check of a vision-language batch: every prompt's image placeholders are its
    images' tokens (an image without its pixels would be generated from as if it were text).

    Raises:
        ValueError: ``extra_inputs`` has another length than ``prompt_ids``, or a prompt's
            placeholders and its images' tokens differ in number (named by prompt index).
    """
    if extra_inputs is not None and len(extra_inputs) != len(prompt_ids):
        raise ValueError(f"got images for {len(extra_inputs)} prompts, generating {len(prompt_ids)}")
    placeholder = image_token_id(model)
    for b, ids in enumerate(prompt_ids):
        x = None if extra_inputs is None else _images(extra_inputs[b])
        held, given = sum(int(t) == placeholder for t in ids), 0 if x is None else x.num_tokens
        if held != given:
            raise ValueError(f"prompt {b} holds {held} image placeholder tokens but its images give {given}; pass each "
                             "prompt's images (packrl.models.image_inputs.ImageInputs) with its processor-expanded ids")


def image_generate_inputs(model: torch.nn.Module, extra_inputs: Sequence[ExtraInputs], ids: torch.Tensor) -> dict[str, Any]:
    """The image arguments of ``generate`` for a batch of a vision-language model: every row's
    images in row order (``extra_inputs``: a prompt's images once per sample row), their grids,
    the placeholder mask the model's M-RoPE needs, and the vision tokens banned from sampling (a
    sampled placeholder would have no image: verl PR #7038). Empty when no row has an image.

    Args:
        ids: the batch's rows, Shape [b, P], int64.
    """
    present = [x for x in map(_images, extra_inputs) if x is not None and x.num_images]
    if not present:
        return {}
    images = merge_images(present).to(ids.device)
    config = cast(Any, model).config
    return {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw,
            "mm_token_type_ids": (ids == image_token_id(model)).to(torch.int32),
            "suppress_tokens": vision_token_ids(config)}

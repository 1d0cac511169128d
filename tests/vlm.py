"""Tiny random vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with a working processor, built
offline from the SmolLM2 tokenizer plus the Qwen vision tokens, and synthetic images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

from tests.conftest import SMOLLM_DIR

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
MAX_PIXELS = 28 * 28 * 64  # at most 64 image tokens: small test images stay small


def vlm_tokenizer():
    from transformers import AutoTokenizer

    if not (SMOLLM_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the tiny VLMs use SmolLM2's tokenizer, not found under {SMOLLM_DIR}; "
                                "set PACKRL_SHARED to the shared/ folder (PACKRL_SHARED=/path/to/shared)")
    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_vlm(family: str = "qwen2_vl", *, tokenizer=None, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random 2-layer ``family`` model (`FAMILIES`) over ``tokenizer``'s vocabulary."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    tok = tokenizer or vlm_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "qwen2_vl":
        vision: dict[str, Any] = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                                      spatial_merge_size=2, temporal_patch_size=2)
        config: Any = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        cls: Any = Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        cls = Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":  # patch 16; the tower's first block also feeds the first text layer (deepstack)
        text["head_dim"] = 8
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **common)
        cls = Qwen3VLForConditionalGeneration
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return cls(config).to(dtype).eval()


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The vision-language families packrl trains, as `tiny_vlm` builds them."""

PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
"""Vision patch side (pixels) per family: an image token is (2 x patch)^2 pixels."""


def tiny_processor(tokenizer=None, max_pixels: int = MAX_PIXELS, family: str = "qwen2_vl"):
    """The family's processor (image-only, `packrl.models.processor.image_only_processor`);
    ``max_pixels`` is in Qwen2-VL pixels (28 x 28 per token) and scaled to the family's patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from packrl.models.processor import image_only_processor

    tok = tokenizer or vlm_tokenizer()
    scale = (PATCH[family] / 14) ** 2
    image_processor = Qwen2VLImageProcessorPil(min_pixels=int(56 * 56 * scale), max_pixels=int(max_pixels * scale),
                                               patch_size=PATCH[family])
    return image_only_processor(family, image_processor, tok, CHAT_TEMPLATE)


def save_tiny_vlm(path: Path, family: str = "qwen2_vl", max_pixels: int = MAX_PIXELS) -> Path:
    """A tiny random VLM saved with its tokenizer, chat template and image processor, loadable as ``model.path``."""
    tok = vlm_tokenizer()
    model = tiny_vlm(family, tokenizer=tok)
    model.save_pretrained(path)
    tiny_processor(tok, max_pixels, family).save_pretrained(path)
    return path


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


IMAGE_SIZES = [[(100, 60)], [(40, 150), (64, 64)], [], [(300, 200)]]
"""Images of `vlm_train_batch`'s four prompts: one, two of other sizes, none, one large."""

RESPONSE_LENS = [7, 3, 12, 5, 1, 9, 4, 8]


def vlm_prompt(processor, sizes, text: str, seed: int = 0):
    """``(prompt_ids, ImageInputs | None)`` of a user turn with images of ``sizes`` then ``text``."""
    from packrl.models.image_inputs import ImageInputs

    content = [{"type": "image", "image": image(w, h, seed + k)} for k, (w, h) in enumerate(sizes)] + [{"type": "text", "text": text}]
    out = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=True, return_dict=True,
                                        add_generation_prompt=True, return_tensors="pt")
    images = ImageInputs(out["pixel_values"], out["image_grid_thw"]) if sizes else None
    return tuple(out["input_ids"][0].tolist()), images


def vlm_train_batch(processor, dtype: torch.dtype = torch.float64):
    """Four prompts with 1, 2, 0 and 1 images (`IMAGE_SIZES`), two random text responses each,
    every token in the loss, with old and reference log-probs and advantages in ``dtype``."""
    from packrl.types import PromptBatch, Response, RolloutBatch
    from tests.builders import whole_loss_batch

    g = torch.Generator().manual_seed(5)
    prompts = [vlm_prompt(processor, sizes, f"How many shapes? {k}", seed=10 * k) for k, sizes in enumerate(IMAGE_SIZES)]
    batch = PromptBatch(tuple(p for p, _ in prompts), ("0",) * 4, ("t",) * 4, (0, 1, 2, 3), (False,) * 4,
                        extra_inputs=tuple(x for _, x in prompts))
    responses = tuple(Response(tuple(torch.randint(3, 1000, (n,), generator=g).tolist()), "eos") for n in RESPONSE_LENS)
    return whole_loss_batch(RolloutBatch(batch, 2, responses), g, dtype, logprob_mean=-7.0)

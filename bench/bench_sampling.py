"""Sampling cost per decode step in the HF engine: packrl's two-level Gumbel-max
(`packrl.rollout.sampling.GumbelMaxSampler`) against one-level Gumbel-max (one exponential draw
per vocabulary entry and row, the sampler it replaced) and ``softmax`` + ``torch.multinomial``,
on the same float32 scores, in one run.

The engine samples from float32 scores whatever ``model.dtype`` is, so this benchmark runs fp32
on every machine; its JSON names the host (``host``) and the dtype (``dtype``: fp32).

Command (seconds)::

    python bench/bench_sampling.py [--rows 32] [--vocab 49152] [--repeats 20]

Measured on 2 idle CPU cores (32 rows, SmolLM2's 49,152-token vocabulary): two-level 7.3 ms per
step, one-level 66.8 ms (ratio 9.2), multinomial 67.4 ms; a second run 7.7 / 57.9 / 62.6 ms (7.5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import check_positive, emit  # noqa: E402
from packrl.rollout.sampling import gumbel_argmax, two_level_gumbel_max  # noqa: E402


def multinomial(scores: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """``softmax`` + ``torch.multinomial`` (one shared generator: no per-request seeds)."""
    return torch.multinomial(torch.softmax(scores, -1), 1, generator=generators[0]).squeeze(1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    check_positive(parser, args, "rows", "vocab", "repeats")
    torch.set_num_threads(2)
    scores = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(i) for i in range(args.rows)]
    ms = {}
    for name, sample in (("two_level_gumbel", two_level_gumbel_max), ("one_level_gumbel", gumbel_argmax),
                         ("multinomial", multinomial)):
        sample(scores, generators)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sample(scores, generators)
            times.append(time.perf_counter() - start)
        ms[name] = round(1000 * statistics.median(times), 2)
    report = {"command": " ".join(["python", "bench/bench_sampling.py", *sys.argv[1:]]), "rows": args.rows, "vocab": args.vocab,
              "ms_per_step": ms, "one_level_over_two_level": round(ms["one_level_gumbel"] / ms["two_level_gumbel"], 2)}
    emit(report, dtype="fp32", device="cpu")
    return report


if __name__ == "__main__":
    main()

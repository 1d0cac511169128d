"""Data-parallel balance: packrl's partitioner against verl's ``get_seqlen_balanced_partitions``.

Splits 4,096 sequences over 8 ranks in two scenarios: GSM8K-shaped lengths (prompt + response
under SmolLM2's tokenizer) and a skewed variant where 10% of the sequences are 10x longer.
Every method gets the same integer workloads ``a*L + L^2`` with ``a = 6 * 576`` and is scored on

- ``imbalance``: costliest rank / mean rank cost under that cost model (1.0 is perfect);
- ``planning_s``: median wall time of 5 repeats (each after a full garbage collection).

Methods: packrl ``karmarkar_karp`` + ``refine_partition``; packrl ``balance_ranks`` (the same
partition plus micro-batch planning under an 8,192-token cap); verl with ``equal_size`` False and
True. verl runs in its own interpreter (``--verl-python``), which times only the partition call.
Prints one JSON object on stdout, naming the host (``host``; ``dtype`` is null: no model compute).
Run from the repository root:

    python bench/bench_balance.py
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUM_SEQUENCES, NUM_RANKS, MAX_TOKENS, REPEATS = 4096, 8, 8192, 5
LINEAR_COEF = 6 * 576  # 6 * hidden_size of SmolLM2-135M
SETUP_HINT = f"""create it with:
  cd {REPO} && python3 -m venv .bench-venv
  .bench-venv/bin/pip install torch==2.13.0
  .bench-venv/bin/pip install --no-deps verl==0.9.1 ray==2.60.0
  .bench-venv/bin/pip install packaging numpy msgpack protobuf requests pyyaml jsonschema tensordict omegaconf transformers"""


def timed(fn: Callable[[], list[list[int]]], repeats: int = REPEATS) -> tuple[list[list[int]], float]:
    """Run ``fn`` ``repeats`` times; return its last result and the median seconds.

    A full garbage collection runs before each repeat, so a collection of the large heap left by
    the imports (transformers, torch) does not land inside one method's timing and not another's.
    """
    times, result = [], []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def verl_worker() -> None:
    """In verl's interpreter: read {"costs", "num_parts"} on stdin, write partitions and times."""
    request = json.load(sys.stdin)
    try:
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
    except ImportError as err:
        print(f"cannot import verl: {err}", file=sys.stderr)
        sys.exit(3)
    out = {}
    for equal_size in (False, True):
        parts, seconds = timed(lambda: get_seqlen_balanced_partitions(request["costs"], request["num_parts"], equal_size))
        out[f"equal_size_{str(equal_size).lower()}"] = {"parts": parts, "planning_s": seconds}
    Path(request["output"]).write_text(json.dumps(out))


def run_verl(verl_python: Path | None, costs: list[int]) -> dict | None:
    """verl's partitions and times for ``costs``, or None (with a hint on stderr) if unavailable."""
    if verl_python is None:
        return None
    if not verl_python.exists():
        print(f"verl interpreter {verl_python} not found; {SETUP_HINT}", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "verl_partitions.json"
        request = json.dumps({"costs": costs, "num_parts": NUM_RANKS, "output": str(output)})
        proc = subprocess.run([str(verl_python), __file__, "--verl-worker"], input=request, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if proc.returncode != 0:
            print(f"{proc.stderr.strip()[-2000:]}\nverl run failed in {verl_python}; {SETUP_HINT}", file=sys.stderr)
            return None
        return json.loads(output.read_text())


def score(parts: Sequence[Sequence[int]], costs: Sequence[int], seconds: float) -> dict:
    """Check ``parts`` partitions every index and return imbalance, time and rank sizes."""
    flat = sorted(i for p in parts for i in p)
    assert len(parts) == NUM_RANKS and flat == list(range(len(costs))), "not a partition of all indices"
    loads = [sum(costs[i] for i in p) for p in parts]
    mean = sum(loads) / len(loads)
    return {"imbalance": max(loads) / mean, "planning_s": seconds,
            "rank_sizes": [min(map(len, parts)), max(map(len, parts))]}


def scenario(lengths: list[int], verl_python: Path | None) -> dict:
    """All four methods on one list of sequence lengths."""
    from packrl.seqlen.balance import balance_ranks, karmarkar_karp, refine_partition
    from packrl.seqlen.microbatch import sequence_costs

    costs = [int(c) for c in sequence_costs(lengths, LINEAR_COEF)]
    parts, seconds = timed(lambda: refine_partition(karmarkar_karp(costs, NUM_RANKS), costs))
    out: dict = {"packrl_kk_refine": score(parts, costs, seconds)}
    try:
        plan, seconds = timed(lambda: balance_ranks(lengths, NUM_RANKS, MAX_TOKENS, linear_coef=LINEAR_COEF))
        out["packrl_balance_ranks"] = score(plan.rank_indices(), costs, seconds)
        out["packrl_balance_ranks"]["num_microbatches"] = plan.num_microbatches
    except (RecursionError, ValueError) as err:
        print(f"balance_ranks failed: {type(err).__name__}: {err}", file=sys.stderr)
        out["packrl_balance_ranks"] = {"imbalance": None, "planning_s": None, "error": f"{type(err).__name__}: {err}"}
    verl = run_verl(verl_python, costs)
    for key in ("equal_size_false", "equal_size_true"):
        out[f"verl_{key}"] = score(verl[key]["parts"], costs, verl[key]["planning_s"]) if verl else {"imbalance": None, "planning_s": None}
    ours, theirs = out["packrl_kk_refine"], out["verl_equal_size_false"]
    out["ratios"] = {
        "imbalance_packrl_over_verl": ours["imbalance"] / theirs["imbalance"] if verl else None,
        "time_packrl_over_verl": ours["planning_s"] / theirs["planning_s"] if verl else None,
    }
    return out


def skewed(lengths: list[int], seed: int = 1) -> list[int]:
    """``lengths`` with a random 10% of the sequences made 10x longer."""
    rng = random.Random(seed)
    long = set(rng.sample(range(len(lengths)), len(lengths) // 10))
    return [n * 10 if i in long else n for i, n in enumerate(lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl-python", type=Path, default=REPO / ".bench-venv" / "bin" / "python")
    parser.add_argument("--verl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.verl_worker:
        verl_worker()
        return
    sys.path.insert(0, str(REPO))
    from bench.common import emit, sample_lengths

    print("tokenizing GSM8K lengths...", file=sys.stderr)
    gsm8k = [p + r for p, r in sample_lengths(NUM_SEQUENCES, seed=0)]
    results, verl_python = {}, args.verl_python
    for name, lengths in (("gsm8k", gsm8k), ("skewed", skewed(gsm8k))):
        print(f"scenario {name}...", file=sys.stderr)
        results[name] = scenario(lengths, verl_python)
        if results[name]["verl_equal_size_false"]["imbalance"] is None:
            verl_python = None  # reported once; later scenarios skip verl
    emit({"scenario": results, "num_sequences": NUM_SEQUENCES, "num_ranks": NUM_RANKS, "max_tokens": MAX_TOKENS,
          "linear_coef": LINEAR_COEF, "command": "python bench/bench_balance.py"}, dtype=None)


if __name__ == "__main__":
    main()

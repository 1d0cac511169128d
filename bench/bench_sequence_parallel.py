"""One long sequence with and without Ulysses sequence parallelism: peak memory per rank and step time.

A randomly initialised model of SmolLM2-135M's shape (``--layers`` decoder layers, default 4, to
keep a CPU run short) takes forward + backward passes over one pack holding a single sequence of
``--tokens`` tokens (default 16,384) through packrl's packed log-prob path (``pack_logprobs``,
chunked LM head), float32 weights, loss = the mean token log-prob. The compute dtype is packrl's
for ``model.dtype=--dtype`` (default ``auto``, resolved once here for this CPU by
`packrl.hardware.resolve_dtype`): bf16 autocast over the float32 weights where the CPU multiplies
bf16 natively, plain float32 elsewhere (``--dtype bf16`` forces autocast). SP=1 runs in
one process with 2 torch threads; SP=S runs S gloo ranks with 1 thread each, each holding 1/S of
the tokens, attention gathering its heads over the whole sequence by all-to-all
(`packrl.models.ulysses`). SmolLM2-135M has 9 attention heads (3 KV heads), so S must divide 9:
the default is S=3 (S=2 is refused, as `trainer.sequence_parallel_size=2` is for this model). On a
2-core machine 3 ranks share 2 cores, so the step-time ratio there measures overhead, not speed-up.
Per run: the median step time of ``--steps`` steps after a warm-up, and each rank's peak RSS
during them (``VmHWM``, reset through ``/proc/self/clear_refs`` after the warm-up). Printed: one
JSON object with both runs, the ratios SP=S / SP=1, the host (``host``) and the dtype (``dtype``:
requested, resolved, why).

    python bench/bench_sequence_parallel.py [--tokens 16384] [--layers 4] [--steps 2] [--sp 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import emit, smollm_model  # noqa: E402


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run(rank: int, world: int, args: argparse.Namespace, out_dir: str) -> None:
    """One rank: build the model, warm up, time ``args.steps`` steps, write its figures."""
    import torch
    import torch.distributed as dist

    from packrl.models.logprobs import pack_logprobs
    from packrl.models.ulysses import PACKRL_ULYSSES, SequenceParallel, check_heads, sequence_parallel
    from packrl.seqlen.packing import pack_sequences

    torch.set_num_threads(max(1, 2 // world))
    sp = None
    if world > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    model = smollm_model("fp32", num_layers=args.layers)
    problem = check_heads(model.config, world)
    if problem is not None:
        raise SystemExit(f"--sp {world}: {problem}")
    if world > 1:
        sp = SequenceParallel(dist.group.WORLD, world, rank, inner=model.config._attn_implementation)
        model.set_attn_implementation(PACKRL_ULYSSES)
    g = torch.Generator().manual_seed(0)
    pack = pack_sequences([torch.randint(0, model.config.vocab_size, (args.tokens,), generator=g)])
    times = []
    for step in range(1 + args.steps):
        if step == 1:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.compute == "bf16" else contextlib.nullcontext()
        with sequence_parallel(sp), autocast:
            out = pack_logprobs(model, pack, chunk_tokens=1024)
            loss = out.token_logprobs.sum() / args.tokens
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    result = {"step_s": [round(t, 3) for t in times[1:]], "peak_rss_gib": round(_rss_kib("VmHWM") / 2**20, 3),
              "all_to_all_s": round(sp.all_to_all_s, 3) if sp is not None else 0.0}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="packrl-sp-bench-") as out:
        mp.spawn(run, args=(world, args, out), nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    steps = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    return {"step_s_median": round(statistics.median(steps), 3), "peak_rss_gib_per_rank": [r["peak_rss_gib"] for r in ranks],
            "all_to_all_s": [r["all_to_all_s"] for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sp", type=int, default=3, help="sequence-parallel size to compare with 1 (must divide the 9 heads)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="model.dtype (auto: bf16 autocast where this CPU multiplies bf16 natively, else fp32)")
    args = parser.parse_args()
    from packrl.hardware import resolve_for_device

    compute = resolve_for_device(args.dtype, "cpu")
    if compute.warning:
        print(f"warning: {compute.warning}", file=sys.stderr)
    args.compute = compute.name  # every rank of both runs computes in it
    one, two = measure(1, args), measure(args.sp, args)
    emit({
        "command": " ".join(["python bench/bench_sequence_parallel.py", *sys.argv[1:]]), "tokens": args.tokens,
        "layers": args.layers, "sp1": one, f"sp{args.sp}": two,
        f"peak_rss_per_rank_ratio_sp{args.sp}_over_sp1": round(max(two["peak_rss_gib_per_rank"]) / one["peak_rss_gib_per_rank"][0], 3),
        f"step_time_ratio_sp{args.sp}_over_sp1": round(two["step_s_median"] / one["step_s_median"], 3),
    }, dtype=args.dtype, device="cpu")


if __name__ == "__main__":
    main()

"""Packed vs padded forward+backward: real tokens per second on one GSM8K-shaped batch.

Shapes: ``N`` sequences · ``L_i`` tokens of sequence i · ``b`` sequences per padded micro-batch ·
``K`` tokens in a pack · ``V`` vocabulary.

Measured: one random model with SmolLM2-135M's shapes (30 layers, hidden 576, V = 49,152) and
one batch of N sequences of random token ids whose lengths (prompt + response) are drawn from
GSM8K's real distribution. Each variant runs forward + next-token log-probs + backward over the
whole batch; time is the median wall time over ``--repeats`` timed runs, after one warm-up of
every variant on a single padded micro-batch's sequences. The variant order alternates between
repeats, so padded and ``varlen`` always run back to back and drifting background load hits
them alike.

- ``padded``: what a padded trainer does. Fixed micro-batches of ``b`` sequences in the given
  (random) order, each right-padded to its longest sequence, HF forward with a 2D attention
  mask, position ids from the mask, ``use_cache=False``; full ``[b, L, V]`` logits in float32 ->
  log_softmax -> gather; loss = -(sum of log-probs of real tokens).
- ``varlen`` / ``block_mask`` / ``position_ids``: `plan_microbatches` under a token cap, one
  `pack_sequences` per micro-batch, `pack_logprobs` with that attention path and a chunked LM
  head; loss = -(sum of token log-probs). ``varlen`` is the default path.

Reported: real tokens/s per variant (real tokens = sum L_i), each packed path's throughput over
padded (target for ``varlen``: >= 1.5), pad fraction measured from the tensors actually fed to
the model (pad positions / positions processed), micro-batch counts, and the summed log-prob of
each variant as a sanity check that all compute the same quantity. The headline ratio is also
given per repeat and on process CPU time, to show how much background load moved it. The JSON
also names the host (``host``) and the dtype of the model's weights (``dtype``: ``--dtype``,
default ``auto``: bf16 where this CPU multiplies bf16 natively, else fp32, as
`packrl.hardware.resolve_dtype` resolves ``model.dtype=auto``; bf16 on a CPU without it is
emulated and tens of times slower).

The default batch is 24 sequences (~6,400 real tokens): with 32 and a full-batch warm-up a run
took ~12 minutes on 2 shared CPU cores, mostly in the two K^2-mask paths (``block_mask``,
``position_ids``). The layer count stays at 30 so the attention/linear/LM-head mix is the real one.

Command (defaults: 24 sequences, ``--dtype auto``, 30 layers, 2 repeats; ~5 minutes in bf16 on 2
idle CPU cores)::

    python bench/bench_packing.py [--dtype auto|bf16|fp32]

Shared prompts (``--group-size G``): ``num_sequences / G`` prompts with G responses each (GSM8K
prompt and response lengths, or ``--prompt-tokens`` / ``--response-tokens`` fixed), packed under
the same token cap two ways with the ``varlen`` path: every sequence whole (``unshared``) and each
group's prompt once (``shared``, `packrl.seqlen.packing.pack_shared`, planned with
`PromptSharing`). Throughput counts the same sequence tokens for both (what the trainer needs
scored), so the ratio is the speed-up (target at G = 4 on GSM8K lengths: >= 1.25)::

    python bench/bench_packing.py --group-size 4 --num-sequences 32
    python bench/bench_packing.py --group-size 16 --num-sequences 32
    python bench/bench_packing.py --group-size 4 --num-sequences 16 --prompt-tokens 1024 --response-tokens 128 --max-tokens 8192

Measured in bf16 on 2 idle CPU cores (``--repeats 3``, ``--repeats 2`` for the long prompts),
median wall time, unshared -> shared:

- ``--group-size 4 --num-sequences 32``: 8,651 -> 5,516 positions, 32.9 -> 25.3 s, ratio 1.30
  (per repeat 1.33 / 1.23 / 1.43);
- ``--group-size 16 --num-sequences 32``: 9,143 -> 4,763 positions, 33.0 -> 21.2 s, ratio 1.55;
- 1,024-token prompts, 128-token responses, G = 4, 16 sequences: 18,432 -> 6,144 positions,
  53.6 -> 25.3 s, ratio 2.12.

So ``train.share_prompts`` is on by default where the attention path can run it.

Vision-language packs (``--vision``, `bench/packing_vision.py`): a random Qwen2-VL with
SmolLM2-135M's text shapes and a 4-block vision tower, GSM8K lengths plus 0-2 images of mixed
sizes per prompt, ``padded`` (the model's own forward) against ``varlen`` packs carrying their
images::

    python bench/bench_packing.py --vision [--num-sequences 24] [--num-layers 30]

Measured (defaults, AMX host, 2 cores, bf16; 24 sequences, 9,196 real tokens of which 2,736
image tokens in 25 images, 10,944 encoder patches): padded 51.9 s (pad fraction 0.38) vs varlen
24.7 s, ``varlen/padded`` 2.10x (per repeat 2.26 / 1.93); summed log-probs agree (-100,415 vs
-100,417 in bf16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import check_positive, emit, sample_lengths, smollm_model  # noqa: E402
from packrl.hardware import resolve_for_device  # noqa: E402
from packrl.models.logprobs import pack_logprobs  # noqa: E402
from packrl.seqlen.microbatch import plan_microbatches  # noqa: E402
from packrl.seqlen.packing import pack_sequences, pack_shared  # noqa: E402
from packrl.seqlen.update_plan import PromptSharing, plan_ranks  # noqa: E402

PACKED_PATHS = ("varlen", "block_mask", "position_ids")
Step = Callable[[], tuple[float, int, int]]  # -> (summed log-prob, positions processed, pad positions)


def padded_step(model: torch.nn.Module, seqs: list[torch.Tensor], microbatch: int, pad_id: int) -> Step:
    """Forward+backward over fixed micro-batches of ``microbatch`` right-padded sequences."""
    groups = [seqs[i : i + microbatch] for i in range(0, len(seqs), microbatch)]

    def step() -> tuple[float, int, int]:
        total, positions, pads = 0.0, 0, 0
        for group in groups:
            width = max(len(s) for s in group)
            input_ids = torch.full((len(group), width), pad_id, dtype=torch.int64)  # [b, L]
            attention_mask = torch.zeros((len(group), width), dtype=torch.int64)  # 1 = real token
            for row, s in enumerate(group):
                input_ids[row, : len(s)], attention_mask[row, : len(s)] = s, 1
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [b, L-1, V]
            logprobs = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [b, L-1]
            loss_mask = attention_mask[:, 1:].bool()  # right padding: label k+1 is real iff token k+1 is
            loss = -logprobs.masked_fill(~loss_mask, 0.0).sum()
            loss.backward()
            total -= loss.item()
            positions += input_ids.numel()
            pads += int((attention_mask == 0).sum())
        return total, positions, pads

    return step


def packed_step(model: torch.nn.Module, seqs: list[torch.Tensor], max_tokens: int, attention: str, chunk_tokens: int) -> tuple[Step, int]:
    """Forward+backward over token-capped packs; returns the step and its micro-batch count."""
    plan = plan_microbatches([len(s) for s in seqs], max_tokens)
    packs = [pack_sequences([seqs[i] for i in mb], indices=mb) for mb in plan.microbatches if mb]

    def step() -> tuple[float, int, int]:
        total, positions, pads = 0.0, 0, 0
        for pack in packs:
            out = pack_logprobs(model, pack, attention=attention, chunk_tokens=chunk_tokens)
            loss = -out.token_logprobs.sum()
            loss.backward()
            total -= loss.item()
            positions += pack.input_ids.numel()
            pads += pack.input_ids.numel() - int(pack.cu_seqlens[-1])
        return total, positions, pads

    return step, len(packs)


def shared_step(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], max_tokens: int, share: bool,
                chunk_tokens: int) -> tuple[Step, int]:
    """Forward+backward of ``prompts[i] + responses[i]`` over token-capped packs, each group's
    prompt written once when ``share`` (planned with `PromptSharing`)."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    sharing = PromptSharing.of(prompts) if share else None
    plan = plan_ranks(lengths, 1, max_tokens, balance=True, budget_key="--max-tokens", sharing=sharing).ranks[0]
    packs = [pack_shared([prompts[i] for i in mb], [responses[i] for i in mb], mb) if share
             else pack_sequences([prompts[i] + responses[i] for i in mb], indices=mb) for mb in plan.microbatches if mb]

    def step() -> tuple[float, int, int]:
        total, positions = 0.0, 0
        for pack in packs:
            out = pack_logprobs(model, pack, chunk_tokens=chunk_tokens, needed=_response_positions(pack, responses))
            loss = -out.token_logprobs.sum()
            loss.backward()
            total -= loss.item()
            positions += pack.input_ids.numel()
        return total, positions, 0

    return step, len(packs)


def _response_positions(pack, responses: list[list[int]]) -> torch.Tensor:
    """True at every response token of ``pack`` (the last R_i tokens of each sequence's own segment). Shape [K], bool."""
    flags = torch.zeros(pack.num_tokens, dtype=torch.bool)
    positions = pack.unpack(torch.arange(pack.num_tokens))
    for i, own in zip(pack.indices, positions):
        flags[own[len(own) - len(responses[i]):]] = True
    return flags


def shared_report(args: argparse.Namespace) -> dict:
    """The ``--group-size`` comparison (module docstring)."""
    gen = torch.Generator().manual_seed(args.seed)
    model = smollm_model(args.dtype, args.num_layers)
    model.train()
    pairs = sample_lengths(args.num_sequences, args.seed)
    vocab = model.config.vocab_size
    prompts, responses = [], []
    for g in range(args.num_sequences // args.group_size):
        p_len = args.prompt_tokens or pairs[g * args.group_size][0]
        prompt = torch.randint(0, vocab, (p_len,), generator=gen).tolist()
        for j in range(args.group_size):
            r_len = args.response_tokens or pairs[g * args.group_size + j][1]
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (r_len,), generator=gen).tolist())
    steps, counts = {}, {}
    for name, share in (("unshared", False), ("shared", True)):
        steps[name], counts[name] = shared_step(model, prompts, responses, args.max_tokens, share, args.chunk_tokens)
    for step in steps.values():  # warm-up
        timed(model, step)
    wall: dict[str, list[float]] = {name: [] for name in steps}
    results = {}
    for r in range(args.repeats):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            seconds, _, results[name] = timed(model, steps[name])
            wall[name].append(seconds)
            print(f"repeat {r} {name}: {seconds:.1f} s wall", file=sys.stderr, flush=True)
    sequence_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    median = {name: statistics.median(t) for name, t in wall.items()}
    ratio = median["unshared"] / median["shared"]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": f"SmolLM2-135M shapes, random init, {args.num_layers} layers, {_dtype_name(args.dtype)}",
        "group_size": args.group_size, "num_sequences": len(prompts), "sequence_tokens": sequence_tokens,
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
        "response_tokens_mean": statistics.mean(len(r) for r in responses),
        "max_tokens": args.max_tokens,
        "variants": {name: {"sequence_tokens_per_s": round(sequence_tokens / median[name], 1), "median_s": round(median[name], 2),
                            "wall_s": [round(t, 2) for t in wall[name]], "num_microbatches": counts[name],
                            "positions_processed": results[name][1], "sum_logprobs": round(results[name][0], 2)}
                     for name in steps},
        "throughput_ratio_shared_vs_unshared": round(ratio, 3),
        "target": "shared/unshared >= 1.25 at group size 4 on GSM8K lengths",
    }
    emit(report, dtype=args.dtype, device="cpu")
    return report


def _dtype_name(requested: str) -> str:
    """What ``--dtype`` resolves to on this CPU (``bf16`` or ``fp32``), as `smollm_model` resolves it."""
    return resolve_for_device(requested, "cpu").name


def timed(model: torch.nn.Module, step: Step) -> tuple[float, float, tuple[float, int, int]]:
    """(wall s, process CPU s, step result) of one forward+backward over the batch, grads zeroed first."""
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    result = step()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def build_steps(model: torch.nn.Module, seqs: list[torch.Tensor], args: argparse.Namespace,
                pad_id: int) -> tuple[dict[str, Step], dict[str, int]]:
    steps = {"padded": padded_step(model, seqs, args.padded_microbatch, pad_id)}
    num_microbatches = {"padded": -(-len(seqs) // args.padded_microbatch)}
    for path in [p for p in args.paths.split(",") if p]:
        steps[path], num_microbatches[path] = packed_step(model, seqs, args.max_tokens, path, args.chunk_tokens)
    return steps, num_microbatches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sequences", type=int, default=24, help="sequences in the batch")
    parser.add_argument("--seed", type=int, default=0, help="seed for lengths and token ids")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="weights' dtype (auto: bf16 where this CPU multiplies bf16 natively, else fp32)")
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per variant after one warm-up")
    parser.add_argument("--padded-microbatch", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token cap per packed micro-batch")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per LM-head chunk (packed)")
    parser.add_argument("--paths", default=",".join(PACKED_PATHS), help="packed attention paths to run, comma-separated")
    parser.add_argument("--group-size", type=int, default=0, help="compare shared-prompt packs with G responses per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="with --group-size: fixed prompt length (0 = GSM8K's)")
    parser.add_argument("--response-tokens", type=int, default=0, help="with --group-size: fixed response length (0 = GSM8K's)")
    parser.add_argument("--vision", action="store_true", help="a vision-language batch with mixed image sizes (bench/packing_vision.py)")
    parser.add_argument("--vision-depth", type=int, default=4, help="with --vision: blocks of the vision tower")
    args = parser.parse_args(argv)
    check_positive(parser, args, "num_sequences", "num_layers", "repeats", "padded_microbatch", "max_tokens", "chunk_tokens",
                   "group_size", "prompt_tokens", "response_tokens", allow_zero=("group_size", "prompt_tokens", "response_tokens"))
    if args.group_size and args.num_sequences % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide --num-sequences {args.num_sequences}")
    if args.group_size:
        return shared_report(args)
    if args.vision:
        from bench.packing_vision import vision_report

        return vision_report(args, timed, _dtype_name(args.dtype))

    lengths = [p + r for p, r in sample_lengths(args.num_sequences, args.seed)]
    model = smollm_model(args.dtype, args.num_layers)
    model.train()
    gen = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id

    steps, num_microbatches = build_steps(model, seqs, args, pad_id)
    # Warm-up: every variant once on the first padded micro-batch's sequences (lazy init, allocator).
    for step in build_steps(model, seqs[: args.padded_microbatch], args, pad_id)[0].values():
        timed(model, step)
    names, results = list(steps), {}
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):  # alternate the order so drifting background load hits all alike
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, cpu_seconds, results[name] = timed(model, steps[name])
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
            print(f"repeat {r} {name}: {seconds:.1f} s wall, {cpu_seconds:.1f} s cpu", file=sys.stderr, flush=True)

    real_tokens = sum(lengths)
    median = {name: statistics.median(t) for name, t in wall.items()}
    tokens_per_s = {name: real_tokens / median[name] for name in steps}
    variants = {
        name: {
            "tokens_per_s": round(tokens_per_s[name], 1),
            "median_s": round(median[name], 2),
            "wall_s": [round(t, 2) for t in wall[name]],
            "cpu_s": [round(t, 2) for t in cpu[name]],
            "num_microbatches": num_microbatches[name],
            "positions_processed": results[name][1],
            "pad_positions": results[name][2],
            "pad_fraction": round(results[name][2] / results[name][1], 4),
            "sum_logprobs": round(results[name][0], 2),
        }
        for name in steps
    }
    packed = [name for name in steps if name != "padded"]
    ratios = {f"{name}/padded": round(tokens_per_s[name] / tokens_per_s["padded"], 3) for name in packed}
    # Checks on the headline ratio: per repeat (each pair ran back to back) and on process CPU time.
    paired = {f"{name}/padded": [round(p / q, 3) for p, q in zip(wall["padded"], wall[name])] for name in packed}
    cpu_ratios = {f"{name}/padded": round(statistics.median(cpu["padded"]) / statistics.median(cpu[name]), 3) for name in packed}
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": f"SmolLM2-135M shapes, random init, {args.num_layers} layers, {_dtype_name(args.dtype)}",
        "torch_threads": torch.get_num_threads(),
        "num_sequences": len(seqs),
        "real_tokens": real_tokens,
        "max_sequence_tokens": max(lengths),
        "padded_microbatch": args.padded_microbatch,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "variants": variants,
        "throughput_ratio_vs_padded": ratios,
        "throughput_ratio_per_repeat": paired,
        "throughput_ratio_cpu_time": cpu_ratios,
        "target": "varlen/padded >= 1.5",
        "target_met": ratios.get("varlen/padded", 0.0) >= 1.5,
    }
    emit(report, dtype=args.dtype, device="cpu")
    return report


if __name__ == "__main__":
    main()

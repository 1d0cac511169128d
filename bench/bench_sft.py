"""SFT tokens/s: `packrl sft` against a padded supervised loop on the same traces, in one run.

Both arms train the same model (``model.path`` of the preset, float32 master weights, the compute
dtype by autocast: ``--dtype``) on the same rendered traces (`packrl.trainer.sft.sft_traces`: the
preset's ``sft.train_files``) in the same order (`packrl.trainer.sft.trace_sampler`), for
``--steps`` optimizer steps of ``sft.batch_size`` traces, with AdamW at ``sft.lr`` and the same
loss: the token-mean NLL of the assistant's tokens over the whole step.

- ``packrl``: `packrl.trainer.sft.sft` (token-budget micro-batches, packed varlen attention,
  chunked log-probs); its time is the update's (``perf/update_s``).
- ``padded``: the loop most SFT scripts run: micro-batches of ``--padded-microbatch`` traces in
  step order, right-padded to the longest, a full-vocabulary LM head, the masked NLL summed and
  divided by the step's loss tokens, one backward per micro-batch, gradient clipping at
  ``train.grad_clip`` and one AdamW step; timed from the first forward to the optimizer step.

Step 1 of each arm is a warm-up and is not timed. Printed as JSON: tokens/s of each (prompt +
response tokens, the pads not counted), ``speedup`` = packrl / padded, the pad fraction of the
padded arm, and both arms' step-1 loss (the same loss on the same traces: they agree up to the
compute dtype's rounding).

Command (arithmetic_tool's calculator traces, a few minutes on 2 CPU cores)::

    python bench/bench_sft.py [--preset arithmetic_tool] [--steps 6] [--padded-microbatch 8] [--dtype auto] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import check_positive, emit  # noqa: E402
from packrl.config import load_config  # noqa: E402
from packrl.hardware import resolve_dtype  # noqa: E402
from packrl.models.loading import load_policy  # noqa: E402
from packrl.trainer.sft import sft, sft_traces, trace_sampler  # noqa: E402


def packrl_arm(cfg) -> dict:
    run_dir = sft(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = lines[1:]
    tokens, seconds = sum(line["sft/num_tokens"] for line in timed), sum(line["perf/update_s"] for line in timed)
    return {"tokens_per_s": round(tokens / seconds, 1), "timed_s": round(seconds, 2), "loss_step_1": lines[0]["sft/loss"],
            "loss_last": lines[-1]["sft/loss"]}


def padded_arm(cfg, microbatch: int) -> dict:
    dtype = resolve_dtype(cfg.model.dtype)
    model, tokenizer = load_policy(cfg.model, compute_dtype=dtype)
    traces = sft_traces(cfg, tokenizer)
    sampler = trace_sampler(traces, cfg.sft.batch_size, cfg.train.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr, weight_decay=cfg.train.weight_decay)
    pad = tokenizer.pad_token_id
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype.name == "bf16")
    tokens = padded = seconds = 0.0
    losses = []
    for step in range(1, cfg.sft.total_steps + 1):
        rows = sampler.next_indices()
        seqs = [list(traces.prompt_ids[i]) + list(traces.response_ids[i]) for i in rows]
        masks = [[False] * len(traces.prompt_ids[i]) + list(traces.response_masks[i]) for i in rows]
        num_loss = sum(sum(m) for m in masks)
        start, step_loss = time.perf_counter(), 0.0
        for k in range(0, len(seqs), microbatch):
            batch, batch_masks = seqs[k:k + microbatch], masks[k:k + microbatch]
            width = max(map(len, batch))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in batch])
            attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
            labels = torch.tensor([m + [False] * (width - len(m)) for m in batch_masks])
            with autocast:
                logits = model(input_ids=ids, attention_mask=attention).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * labels[:, 1:]).sum() / num_loss
            loss.backward()
            step_loss += float(loss)
            if step > 1:
                tokens, padded = tokens + int(attention.sum()), padded + ids.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step > 1:
            seconds += time.perf_counter() - start
    return {"tokens_per_s": round(tokens / seconds, 1), "timed_s": round(seconds, 2), "loss_step_1": losses[0],
            "loss_last": losses[-1], "pad_fraction": round(1 - tokens / padded, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="arithmetic_tool")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per arm (step 1 is not timed)")
    parser.add_argument("--padded-microbatch", type=int, default=8, help="traces per padded micro-batch")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    args = parser.parse_args()
    check_positive(parser, args, "padded_microbatch")
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: give at least 2 (step 1 is a warm-up)")
    out = Path(tempfile.mkdtemp(prefix="packrl-bench-sft-"))
    cfg = load_config(args.preset, [f"model.dtype={args.dtype}", f"sft.total_steps={args.steps}", f"train.out_dir={out}",
                                    *args.overrides])
    ours = packrl_arm(cfg)
    theirs = padded_arm(cfg, args.padded_microbatch)
    emit({"command": "python bench/bench_sft.py " + " ".join([f"--preset {args.preset} --steps {args.steps} --padded-microbatch "
                                                               f"{args.padded_microbatch} --dtype {args.dtype}", *args.overrides]),
          "batch_size": cfg.sft.batch_size, "packrl": ours, "padded": theirs,
          "speedup": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 2)}, dtype=args.dtype)


if __name__ == "__main__":
    main()

"""One GRPO step, packrl against TRL 1.16 ``GRPOTrainer``, side by side in one run (CPU).

Each framework runs in its own subprocess (same interpreter, 2 torch threads, one after the
other; ``--first`` picks which goes first) for ``--warmup`` + ``--steps`` GRPO steps on the same
model directory, the same prompts in the same order, and reports per timed step:

- ``step_s``: wall time of one whole step: prompts -> generate -> reward -> (old log-probs) ->
  loss -> backward -> clip -> optimizer step. packrl: ``timing_s/step`` from ``metrics.jsonl`` of
  `packrl.trainer.loop.train` (excludes metric logging and the checkpoint saved at the last step).
  TRL: a callback's ``on_step_begin`` -> ``on_step_end`` (includes ``_prepare_inputs``, i.e.
  generation and reward, and the optimizer step; excludes logging).
- ``tokens_per_s``: prompt + response tokens of the step's sequences / step time. packrl:
  ``perf/total_num_tokens``. TRL: the growth of ``state.num_input_tokens_seen``, which
  ``GRPOTrainer._generate`` raises by the prompt + completion tokens (``include_num_input_tokens_seen``
  is "no", so the Trainer adds nothing); checked against the reward hook's ``completion_ids``.
- response lengths and ``s_per_1k_response_tokens`` (the frameworks sample different responses,
  so compare step times knowing them), and packrl's stage times (``timing_s/*``) and TRL's
  generation time (a timer around ``GRPOTrainer._generate_single_turn``).

Settings (packrl key = TRL ``GRPOConfig`` argument):

    model.path (resolved dir)          = model (same dir; float32 params: model_init_kwargs dtype)
    model.dtype=bf16 (autocast)        = bf16=True (accelerate autocast), fp32 master weights
    data.batch_size B x rollout.n      = per_device_train_batch_size x gradient_accumulation_steps = B*n
    rollout.n                          = num_generations
    rollout.max_response_tokens        = max_completion_length
    rollout.temperature/top_p/top_k 0  = temperature / top_p / top_k=0
    reward gsm8k, extraction flexible  = the same function, wrapped (prompts, completions, ground_truth)
    train.lr, no warmup, constant      = learning_rate, warmup_steps=0, lr_scheduler_type="constant"
    train.grad_clip / weight_decay     = max_grad_norm / weight_decay; optim="adamw_torch"
    algorithm.kl_coef=0 (no ref model) = beta=0.0
    clip_ratio_low / clip_ratio_high   = epsilon / epsilon_high
    loss_agg_mode=token-mean           = loss_type="dapo"; scale_rewards="group" (grpo, std-normalised)
    algorithm.truncated=keep           = mask_truncated_completions=False
    train.ppo_epochs=1, one mini-batch = num_iterations=1 (one optimizer step per step)
    (no activation checkpointing)      = gradient_checkpointing=False
    HF engine (model.generate)         = use_vllm=False (model.generate)
    PromptSampler order (seed 0)       = the same rows in that order, shuffle_dataset=False
    val_every=0, save outside timing   = report_to="none", save_strategy="no", eval_strategy="no"

Target: packrl step time <= 0.6 x TRL's. Command (from the repository root, with the venv of
``/work/main/.bench-trl`` that holds both; setup in the reply of the task or below)::

    python3 -m venv .bench-trl && .bench-trl/bin/pip install torch==2.13.0
    .bench-trl/bin/pip install trl==1.16.0 && .bench-trl/bin/pip install -e .
    .bench-trl/bin/python bench/bench_trl_step.py [--settings demo gsm8k] [--steps 3] [--first trl]

Caveats: the two sample different responses (lengths differ; see ``s_per_1k_response_tokens``).
packrl always scores old log-probs in a separate no-grad forward (``timing_s/old_log_prob``);
TRL skips that forward when on-policy (one generation per optimizer step, ``num_iterations=1``),
so packrl does one more forward per step. TRL pads the batch to its longest sequence; packrl
packs by token budget. TRL adds the EOS-aligned completion mask and a fused LM-head log-prob;
packrl chunks logits. Timings on a shared 2-core CPU are noisy: run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import GSM8K_TRAIN  # noqa: E402

THREADS = 2
SETTINGS = {  # preset + overrides; every setting also gets COMMON below
    "demo": ("demo", []),  # task:arithmetic, B=8, n=4, 64 response tokens, lr 1e-5
    "gsm8k": ("gsm8k", [f"data.train_files=[{GSM8K_TRAIN}]", "reward.extraction=flexible"]),  # B=4, n=4, 256
}
COMMON = ["data.val_files=[]", "train.val_every=0", "train.save_every=0", "algorithm.kl_coef=0", "model.dtype=bf16",
          "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0", "train.warmup_steps=0", "train.ppo_epochs=1"]


def packrl_config(setting: str, total_steps: int, out_dir: str):
    from packrl.config import load_config

    preset, overrides = SETTINGS[setting]
    return load_config(preset, [*overrides, *COMMON, f"train.total_steps={total_steps}", f"train.out_dir={out_dir}"])


def summarise(step_s: list[float], tokens: list[float], response_tokens: list[float], sequences: int, extra: dict) -> dict:
    return {
        "step_s_median": round(statistics.median(step_s), 3), "step_s": [round(s, 3) for s in step_s],
        "tokens_per_s": round(sum(tokens) / sum(step_s), 1), "sequences_per_step": sequences,
        "tokens_per_step": tokens, "response_length_mean": round(sum(response_tokens) / (sequences * len(step_s)), 1),
        "s_per_1k_response_tokens": round(1000 * sum(step_s) / sum(response_tokens), 3), **extra,
    }


def run_packrl(setting: str, warmup: int, steps: int) -> dict:
    from packrl.trainer.loop import train

    with tempfile.TemporaryDirectory(prefix="packrl-trlbench-") as out:
        cfg = packrl_config(setting, warmup + steps, out)
        run_dir = train(cfg)
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    n = cfg.data.batch_size * cfg.rollout.n
    stages = sorted({k for line in lines for k in line if k.startswith("timing_s/")})
    return summarise(
        [line["timing_s/step"] for line in lines], [line["perf/total_num_tokens"] for line in lines],
        [line["response_length/mean"] * n for line in lines], n,
        {"stages_s_median": {k.split("/", 1)[1]: round(statistics.median(line[k] for line in lines), 3) for k in stages},
         "reward_mean": [round(line["critic/score/mean"], 3) for line in lines]},
    )


def prompt_schedule(cfg, tokenizer, total_steps: int) -> list:
    """The `DatasetPrompt`s packrl's loop samples in its first ``total_steps`` steps, in order."""
    from packrl.data.dataset import PromptDataset, PromptSampler

    train_set = PromptDataset.build(cfg.data.train_files, tokenizer, cfg.data, seed=cfg.train.seed, split="train", key="data.train_files")
    by_row = {p.example.row: p for p in train_set.prompts}
    sampler = PromptSampler(train_set, cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=cfg.train.seed)
    return [by_row[row] for _ in range(total_steps) for row in sampler.next_batch().rows]


def run_trl(setting: str, warmup: int, steps: int, micro: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from packrl.models.loading import load_tokenizer, resolve_model
    from packrl.reward.gsm8k import gsm8k_reward

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        cfg = packrl_config(setting, warmup + steps, out)
        resolved = resolve_model(cfg.model.path)
        schedule = prompt_schedule(cfg, load_tokenizer(resolved, cfg.model.path), warmup + steps)
        dataset = Dataset.from_list([{"prompt": p.example.chat, "ground_truth": p.example.ground_truth} for p in schedule])
        completion_tokens: list[int] = []

        def gsm8k_flexible(prompts, completions, completion_ids, ground_truth, **_):
            completion_tokens.append(sum(len(ids) for ids in completion_ids))
            return [gsm8k_reward(c[0]["content"], gt, data_source="", cfg=cfg.reward) for c, gt in zip(completions, ground_truth)]

        class StepTimer(TrainerCallback):
            def __init__(self):
                self.records: list[tuple[float, int]] = []

            def on_step_begin(self, args, state, control, **_):
                self.start, self.tokens = time.perf_counter(), state.num_input_tokens_seen

            def on_step_end(self, args, state, control, **_):
                self.records.append((time.perf_counter() - self.start, state.num_input_tokens_seen - self.tokens))

        algo, n = cfg.algorithm, cfg.rollout.n
        if (cfg.data.batch_size * n) % micro:
            raise SystemExit(f"--trl-micro-batch {micro} does not divide B*n = {cfg.data.batch_size * n}")
        args = GRPOConfig(
            output_dir=out, max_steps=warmup + steps, per_device_train_batch_size=micro,
            gradient_accumulation_steps=cfg.data.batch_size * n // micro, num_generations=n, max_completion_length=cfg.rollout.max_response_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.train.weight_decay,
            max_grad_norm=cfg.train.grad_clip, optim="adamw_torch", beta=0.0, epsilon=algo.clip_ratio_low,
            epsilon_high=algo.clip_ratio_high, loss_type="dapo", scale_rewards="group", num_iterations=1,
            mask_truncated_completions=False, bf16=cfg.model.dtype == "bf16", use_cpu=True, use_vllm=False,
            gradient_checkpointing=False, activation_checkpointing=False, shuffle_dataset=False, seed=cfg.train.seed,
            model_init_kwargs={"dtype": "float32"},
            report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
            include_num_input_tokens_seen="no", dataloader_num_workers=0, log_completions=False,
        )
        timer = StepTimer()
        trainer = GRPOTrainer(model=str(resolved.model_dir), reward_funcs=gsm8k_flexible, args=args,
                              train_dataset=dataset, callbacks=[timer])
        trl_ids, _, _ = trainer._tokenize_prompts([p.example.chat for p in schedule])
        gen_s: list[float] = []
        generate = trainer._generate_single_turn

        def timed_generate(*a, **k):
            start = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                gen_s.append(time.perf_counter() - start)

        trainer._generate_single_turn = timed_generate
        trainer.train()
    records = timer.records[warmup:]
    num = cfg.data.batch_size * n
    prompt_tokens = [n * sum(len(p.prompt_ids) for p in schedule[s * cfg.data.batch_size:(s + 1) * cfg.data.batch_size])
                     for s in range(warmup + steps)][warmup:]
    counted = [p + c for p, c in zip(prompt_tokens, completion_tokens[warmup:])]
    return summarise(
        [s for s, _ in records], [float(t) for _, t in records], completion_tokens[warmup:], num,
        {"gen_s_median": round(statistics.median(gen_s[warmup:]), 3),
         "prompt_ids_identical_to_packrl": [list(i) for i in trl_ids] == [list(p.prompt_ids) for p in schedule],
         "num_tokens_matches_prompt_plus_completion_ids": counted == [t for _, t in records],
         "gradient_checkpointing": bool(trainer.model.is_gradient_checkpointing), "param_dtype": str(next(trainer.model.parameters()).dtype)},
    )


def worker(framework: str, setting: str, warmup: int, steps: int, micro: int) -> None:
    import torch

    torch.set_num_threads(THREADS)
    result = run_packrl(setting, warmup, steps) if framework == "packrl" else run_trl(setting, warmup, steps, micro)
    result["torch_threads_at_end"] = torch.get_num_threads()
    print("RESULT " + json.dumps(result), flush=True)


def spawn(framework: str, setting: str, warmup: int, steps: int, micro: int) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--worker", framework, "--settings", setting, "--warmup", str(warmup), "--steps", str(steps),
           "--trl-micro-batch", str(micro)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{framework} worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][7:]) | {"process_wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["demo"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--first", choices=["packrl", "trl"], default="packrl")
    parser.add_argument("--trl-micro-batch", type=int, default=4, help="TRL per_device_train_batch_size (sequences)")
    parser.add_argument("--worker", choices=["packrl", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.settings[0], args.warmup, args.steps, args.trl_micro_batch)
    import torch
    import transformers
    import trl

    order = [args.first, "trl" if args.first == "packrl" else "packrl"]
    report: dict = {"command": " ".join([Path(sys.executable).as_posix(), "bench/bench_trl_step.py", *sys.argv[1:]]),
                    "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
                    "torch_threads": THREADS, "order": order, "target_step_time_ratio": 0.6, "settings": {}}
    for setting in args.settings:
        cfg = packrl_config(setting, args.warmup + args.steps, tempfile.gettempdir())
        res = {fw: spawn(fw, setting, args.warmup, args.steps, args.trl_micro_batch) for fw in order}
        p, t = res["packrl"], res["trl"]
        report["settings"][setting] = {
            "config": {"B": cfg.data.batch_size, "n": cfg.rollout.n, "max_response_tokens": cfg.rollout.max_response_tokens,
                       "lr": cfg.train.lr, "dtype": cfg.model.dtype, "data": cfg.data.train_files,
                       "trl_micro_batch": args.trl_micro_batch, "instruction": cfg.data.instruction},
            "packrl": p, "trl": t,
            "step_time_ratio_packrl_over_trl": round(p["step_s_median"] / t["step_s_median"], 3),
            "tokens_per_s_ratio_packrl_over_trl": round(p["tokens_per_s"] / t["tokens_per_s"], 3),
            "s_per_1k_response_tokens_ratio_packrl_over_trl": round(p["s_per_1k_response_tokens"] / t["s_per_1k_response_tokens"], 3),
            "meets_target": p["step_s_median"] <= 0.6 * t["step_s_median"],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

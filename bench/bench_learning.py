"""It learns: the `demo` preset (GRPO, SmolLM2-135M-Instruct, built-in arithmetic) for 30 steps.

Prints one JSON object: mean training reward (``critic/score/mean``, sampled at temperature 1)
over steps 1-5 and over the last 5 steps, their difference, greedy validation accuracy before
training (step 0) and after, and the wall time. An RL trainer that does not raise the reward on
this easy task has a bug. With ``--preset arithmetic_tool`` (multi-turn, calculator tool) it also
prints the tool-use rate (``multi_turn/tool_use_rate``) over the first and last 5 steps and in
greedy validation before and after.

``--dtype`` sets ``model.dtype`` (default ``auto``: bf16 where this machine multiplies bf16
natively, else fp32; `packrl.hardware.resolve_dtype`); set it there, not as a ``model.dtype=``
override. Every mode's JSON names the host (``host``) and the dtype (``dtype``: requested,
resolved, why).

Command (about 10 minutes on 2 CPU cores for demo)::

    python bench/bench_learning.py [--preset demo] [--steps 30] [--dtype auto] [key=value ...]

With ``--sft-steps N`` it first runs ``packrl sft`` of the preset for N steps (its ``sft``
section: for ``arithmetic_tool`` calculator traces, docs/sft.md) and trains RL from that
checkpoint; it also prints validation after the supervised steps, the SFT loss and tokens/s, and
(for a tool preset) the model's accuracy before training on the same problems without the tool::

    python bench/bench_learning.py --preset arithmetic_tool --steps 10 --sft-steps 8

Measured (AMD EPYC, AVX512_BF16, bf16, 2 cores): held-out 3-digit accuracy 1.6% (1.6% without
the tool) -> 93.8% after 8 SFT steps (103 s, loss 0.61 -> 0.03) -> 100% after 10 GRPO steps;
validation tool use 1.6% -> 100%; 759 s in all.

With ``--steps 0`` (and ``--sft-steps N``) only the supervised steps run: greedy validation
before and after them, with the mean response length and the share cut by the response budget::

    python bench/bench_learning.py --preset char_count --steps 0 --sft-steps 8

With ``--vs-gae`` it trains the preset twice, as configured (GRPO in ``demo``) and as PPO with a
critic (``algorithm.adv_estimator=gae`` plus the ``--gae`` overrides), validating every
``--val-every`` steps, and prints both arms' reward rise and held-out accuracy at the same wall
time: the last validation each reached within the shorter arm's training time (generation,
reward, log-prob, value and update time, ``timing_s/step``; validation excluded), and the accuracy
read off each arm's curve linearly at that time (``val_accuracy_at_equal_wall_interpolated``: the
last validation within the time favours the shorter arm, which is validated at its end, while the
other's last validation may be up to ``--val-every`` steps earlier).

With ``--vs-sync`` the second arm is the same preset with partial rollouts
(``trainer.rollout_mode=colocate_async`` plus the ``--async`` overrides), compared the same way::

    python bench/bench_learning.py --vs-sync [--steps 30] [--val-every 10] data.arithmetic.digits=2 [--async key=value ...]

With ``--vs-no-tool`` (a tool preset) the first arm is the preset itself, after ``--sft-steps``
supervised steps when given (their training time counts in the arm's, and the curve starts with
the base model's accuracy at 0 s), and the second the same problems without the calculator
(single-turn, asked for the answer itself: ``_NO_TOOL``), both compared the same way::

    python bench/bench_learning.py --vs-no-tool --preset arithmetic_tool --sft-steps 8 --steps 30 --val-every 10

Measured (Intel Xeon with AMX, AVX512, bf16, 2 cores): at equal wall time (1,111.3 s, the no-tool
arm's training time) 100% with the tool (SFT 114.6 s, then 30 GRPO steps; 92.2% after SFT) against
1.6% without it (its training reward stayed 0.0); both 1.6% before training.

With ``--vs-trl`` (demo preset only) it compares learning per second of training with TRL 1.16's
``GRPOTrainer`` on held-out 2-digit arithmetic::

    python bench/bench_learning.py --vs-trl [--steps 30] [--val-every 5] [--trl-micro-batch 4] [--dtype auto] \\
        data.arithmetic.digits=2

The packrl arm is a ``--vs-gae`` arm: greedy validation before training, every ``--val-every``
steps and at the end; its training time W is the sum of its ``timing_s/step``. The TRL arm then
runs in a subprocess of ``--trl-python`` (default ``.bench-trl/bin/python``: the venv of
bench/bench_trl_step.py, whose docstring says how to create it) with that file's settings table:
the same model directory, the same training prompts in packrl's sampling order, the same reward
function, the preset's lr, B, n and response budget, and the same overrides. It trains until its
step times (``on_step_begin`` -> ``on_step_end``: generation, reward, loss, backward, optimizer
step) add up to W, or for ``--steps`` steps, and saves the policy (``save_pretrained``, float32
weights) with packrl's tokenizer before training, every ``--val-every`` steps, after its last step
and, when that step ends past W, at the last step that ended within W (whose weights it keeps in
memory until then); saving is outside the timed steps. Then, in this process, packrl's `validate`
scores every saved model (``model.path=<saved dir>`` plus the same overrides): the same held-out
rows, greedy decoding and scorer, so one evaluator measures both arms. TRL's accuracy before
training is that of its saved step-0 model, which checks the save and reload (it should equal
packrl's). Both arms and the scoring run one dtype: ``--dtype`` resolved once in this process
(`packrl.hardware.resolve_dtype`), given to packrl as ``model.dtype=bf16|fp32`` and to TRL as
``bf16=True|False`` (bench/bench_trl_step.py's settings table).

Printed per arm: held-out accuracy before training, at equal wall time (``equal_wall_s``, the
shorter arm's training time: the arm's last validation at or before it) and at its end, the curve
``[(train_s, accuracy)]``, steps done, training seconds, median step time, and the mean training
reward over steps 1-5 and the last 5 (TRL: the mean of its reward function's values in each step).

Measured (``--vs-trl --steps 30 --val-every 10``, shared GGUF model, ``data.arithmetic.digits=2``,
idle machine, bf16: then the demo preset's ``model.dtype``): packrl trained 30 steps in 335 s
(median step 10.1 s) and went 14.1% -> 35.9% / 54.7% / 62.5% held-out accuracy at steps 10 / 20 /
30 (148 / 251 / 335 s). TRL, given those 335 s, ran 10 steps (median step 32.3 s) and its step-10
model scored 39.1%; the step it was in when the time ran out ended at 359 s (11 steps, 42.2%). At
equal wall time: **62.5% vs 39.1%**. Reward, steps 1-5 -> last 5: packrl 0.019 -> 0.450, TRL
0.025 -> 0.138 (steps 7-11). An earlier run on a busier host, where four packrl steps shared the
cores with other work, took TRL to 30 steps: 51.6% at step 30 vs packrl's 51.6% at step 20 and
59.4% at step 30, so per step the two learn alike and packrl's lead is its shorter steps.

Caveats. The two sample different responses (in bf16 TRL generates under bf16 autocast over
float32 weights, packrl on a bf16 copy of them; in fp32 both on the float32 weights), so their
rewards and curves also differ by chance; one seed each. TRL's micro-batch (``--trl-micro-batch``,
default 4 sequences, its fastest in bench/bench_trl_step.py) changes its speed, not its update:
each optimizer step takes B*n sequences either way. Both arms run 2 torch threads; only training
time counts (not model loading, validation or saving), and any other load on the CPU skews it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.bench_trl_step import DTYPES, THREADS, packrl_config, prompt_schedule, resolve_arms_dtype, run_worker, trl_trainer  # noqa: E402
from bench.common import emit  # noqa: E402
from packrl.config import load_config  # noqa: E402
from packrl.data.dataset import PromptDataset  # noqa: E402
from packrl.distributed.local import local_group  # noqa: E402
from packrl.errors import ConfigError  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from packrl.trainer.sft import sft  # noqa: E402
from packrl.trainer.validate import validate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--vs-gae", action="store_true", help="also train PPO with a critic and compare at equal wall time")
    parser.add_argument("--gae", nargs="*", default=[], help="extra overrides of the PPO arm (e.g. critic.lr=1e-5)")
    parser.add_argument("--vs-sync", action="store_true",
                        help="also train with trainer.rollout_mode=colocate_async and compare at equal wall time")
    parser.add_argument("--async", dest="async_overrides", nargs="*", default=[],
                        help="extra overrides of the colocate_async arm (e.g. rollout.max_staleness=4)")
    parser.add_argument("--vs-trl", action="store_true", help="also train TRL's GRPOTrainer and compare at equal wall time")
    parser.add_argument("--trl-python", default=str(REPO / ".bench-trl" / "bin" / "python"),
                        help="interpreter of the venv with trl==1.16.0 (see bench/bench_trl_step.py)")
    parser.add_argument("--trl-micro-batch", type=int, default=4, help="TRL per_device_train_batch_size (sequences)")
    parser.add_argument("--val-every", type=int, default=5, help="validation interval of the --vs-gae / --vs-sync / --vs-trl arms")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="model.dtype (auto: bf16 where this machine multiplies bf16 natively, else fp32); "
                             "with --vs-trl resolved once for both arms (TRL's bf16= follows it)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # directory the TRL arm saves its models into
    parser.add_argument("--trl-budget-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--vs-no-tool", action="store_true",
                        help="tool preset: also train it without the tool (single-turn) and compare at equal wall time")
    parser.add_argument("--sft-steps", type=int, default=0,
                        help="first fine-tune on the preset's sft.train_files for this many steps (packrl sft), then RL from it")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the preset")
    args = parser.parse_args()
    if any(o.startswith("model.dtype=") for o in args.overrides):
        parser.error("set the compute dtype with --dtype, not a model.dtype= override")
    if (args.vs_trl or args.trl_worker) and args.preset != "demo":
        parser.error("--vs-trl compares the demo preset only (the settings table of bench/bench_trl_step.py)")
    if args.trl_worker:
        return trl_worker(args)
    if args.vs_trl:
        if not Path(args.trl_python).is_file():
            parser.error(f"--trl-python {args.trl_python} does not exist; create TRL's venv as bench/bench_trl_step.py's docstring says")
        return compare_trl(args)
    if args.vs_no_tool and not load_config(args.preset).rollout.multi_turn.tools:
        parser.error(f"--vs-no-tool compares a tool preset with itself without the tool; {args.preset} names no tool")
    if args.vs_gae or args.vs_sync or args.vs_no_tool:
        try:
            compare_arms(args)
        except ConfigError as err:
            parser.error(str(err))
        return
    out = Path(tempfile.mkdtemp(prefix="packrl-learning-"))
    base = [f"model.dtype={args.dtype}", *args.overrides]
    start = time.perf_counter()
    before = _validate(load_config(args.preset, base))
    sft_report: dict = {}
    if args.sft_steps:
        sft_report = _sft_arm(args.preset, args.sft_steps, base, out / "sft")
        base = [*base, f"model.path={sft_report.pop('checkpoint')}"]
    if not args.steps:
        return _emit_sft_only(args, before, _validate(load_config(args.preset, base)), sft_report, time.perf_counter() - start)
    cfg = load_config(args.preset, [f"train.total_steps={args.steps}", f"train.out_dir={out / 'rl'}",
                                    f"train.val_every={args.steps}", *base])
    workers = local_group(cfg)
    rl_before = _validate(cfg, workers) if args.sft_steps else before
    run_dir = train(cfg, workers)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [line["critic/score/mean"] for line in lines]
    first, last = statistics.mean(scores[:5]), statistics.mean(scores[-5:])
    tools = {}
    if "multi_turn/tool_use_rate" in lines[0]:
        rates = [line["multi_turn/tool_use_rate"] for line in lines]
        tools = {"tool_use_rate_steps_1_5": statistics.mean(rates[:5]), "tool_use_rate_last_5": statistics.mean(rates[-5:]),
                 "val_tool_use_rate_before": before.get("val/multi_turn/tool_use_rate"),
                 "val_tool_use_rate_after_sft": rl_before.get("val/multi_turn/tool_use_rate") if args.sft_steps else None,
                 "val_tool_use_rate_after": lines[-1].get("val/multi_turn/tool_use_rate"),
                 "malformed_calls_first_5": statistics.mean(line["multi_turn/malformed_calls"] for line in lines[:5]),
                 "malformed_calls_last_5": statistics.mean(line["multi_turn/malformed_calls"] for line in lines[-5:])}
    emit({
        "command": "python bench/bench_learning.py " + " ".join(
            f"--preset {args.preset} --steps {args.steps} --sft-steps {args.sft_steps} --dtype {args.dtype}".split() + args.overrides),
        "steps": args.steps,
        "reward_mean_steps_1_5": first,
        "reward_mean_last_5": last,
        "reward_gain": last - first,
        "val_accuracy_before": before["val/accuracy"],
        **({"val_accuracy_after_sft": rl_before["val/accuracy"], "sft": sft_report} if args.sft_steps else {}),
        "val_accuracy_after": lines[-1].get("val/accuracy"),
        **({"val_accuracy_before_without_tool": _validate(load_config(args.preset, [f"model.dtype={args.dtype}", *args.overrides,
                                                                             *_NO_TOOL]))["val/accuracy"]}
           if cfg.rollout.multi_turn.tools else {}),
        "response_length_mean_first_5": statistics.mean(line["response_length/mean"] for line in lines[:5]),
        "response_length_mean_last_5": statistics.mean(line["response_length/mean"] for line in lines[-5:]),
        **tools,
        "reward_per_step": [round(s, 4) for s in scores],
        "wall_s": round(time.perf_counter() - start, 1),
        "run_dir": str(run_dir),
    }, dtype=args.dtype)


def _emit_sft_only(args: argparse.Namespace, before: dict, after: dict, sft_report: dict, wall_s: float) -> None:
    """``--steps 0``: greedy validation before and after the supervised steps (accuracy, mean
    response length and the share cut by the response budget), no RL."""
    emit({
        "command": "python bench/bench_learning.py " + " ".join(
            f"--preset {args.preset} --steps 0 --sft-steps {args.sft_steps} --dtype {args.dtype}".split() + args.overrides),
        "val_accuracy_before": before["val/accuracy"], "val_accuracy_after_sft": after["val/accuracy"],
        "val_response_length_mean_before": before["val/response_length/mean"],
        "val_response_length_mean_after_sft": after["val/response_length/mean"],
        "val_clip_ratio_before": before["val/response_length/clip_ratio"],
        "val_clip_ratio_after_sft": after["val/response_length/clip_ratio"],
        "sft": sft_report, "wall_s": round(wall_s, 1),
    }, dtype=args.dtype)


_NO_TOOL = ["rollout.multi_turn.tools=[]", "rollout.stop=[]", "rollout.multi_turn.max_turns=4",
            "rollout.multi_turn.max_tokens_per_turn=null", "rollout.multi_turn.max_tool_response_tokens=256", "data.system_prompt=null",
            "data.instruction=Compute it and give the final answer after ####.", "reward.shaping.tool_format=null"]
"""The same problems without the calculator: single-turn, asked for the answer itself, and no
format reward (it scores tool calls); applied after the user's overrides."""


def _validate(cfg, workers=None) -> dict[str, float]:
    """Greedy validation of ``cfg``'s model on its val set (a worker of its own unless given)."""
    workers = workers or local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    return validate(workers, val_set, cfg.rollout, cfg.reward)


def _sft_arm(preset: str, steps: int, overrides: list[str], out: Path) -> dict:
    """``packrl sft`` of the preset for ``steps`` steps: its loss, throughput and final checkpoint."""
    cfg = load_config(preset, [*overrides, f"sft.total_steps={steps}", f"train.out_dir={out}"])
    run_dir = sft(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens, seconds = sum(line["sft/num_tokens"] for line in lines), sum(line["perf/update_s"] for line in lines)
    return {"steps": steps, "loss_first": lines[0]["sft/loss"], "loss_last": lines[-1]["sft/loss"],
            "tokens_per_s": round(tokens / seconds, 1), "train_s": round(seconds, 1),
            "checkpoint": str(run_dir / "checkpoints" / f"step_{steps}")}


def _arm(preset: str, steps: int, val_every: int, overrides: list[str], sft_steps: int = 0) -> dict:
    """One arm of --vs-gae / --vs-sync / --vs-no-tool / --vs-trl: validation before, training with
    validation every ``val_every`` steps; its per-step scores and times, training seconds and
    validation accuracies. With ``sft_steps`` the arm starts with that many `packrl sft` steps:
    their training seconds count in the arm's time, validated before and after them."""
    out = Path(tempfile.mkdtemp(prefix="packrl-learning-"))
    elapsed, curve, warm = 0.0, [], {}
    if sft_steps:
        curve.append((0.0, _validate(load_config(preset, overrides))["val/accuracy"]))
        warm = _sft_arm(preset, sft_steps, overrides, out / "sft")
        overrides, elapsed = [*overrides, f"model.path={warm.pop('checkpoint')}"], warm["train_s"]
    cfg = load_config(preset, [f"train.total_steps={steps}", f"train.out_dir={out}", f"train.val_every={val_every}", *overrides])
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    curve.append((elapsed, validate(workers, val_set, cfg.rollout, cfg.reward)["val/accuracy"]))
    run_dir = train(cfg, workers)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        elapsed += line["timing_s/step"]
        if "val/accuracy" in line:
            curve.append((elapsed, line["val/accuracy"]))
    tool_use = [line["val/multi_turn/tool_use_rate"] for line in lines if "val/multi_turn/tool_use_rate" in line]
    return {"scores": [line["critic/score/mean"] for line in lines], "step_s": [line["timing_s/step"] for line in lines],
            "train_s": elapsed, "curve": curve, "run_dir": str(run_dir)} | ({"sft": warm} if warm else {}) | (
            {"val_tool_use_curve": tool_use} if tool_use else {})


def _interpolated(curve: list[tuple[float, float]], wall: float) -> float:
    """The accuracy at ``wall`` training seconds read off ``curve`` linearly between the two
    validations around it (the last one when ``wall`` is at or past it)."""
    for (t0, a0), (t1, a1) in zip(curve, curve[1:]):
        if t0 <= wall <= t1:
            return a0 + (a1 - a0) * (wall - t0) / (t1 - t0) if t1 > t0 else a1
    return curve[-1][1]


def _summary(arm: dict, wall: float) -> dict:
    """An arm's reward rise and held-out accuracy before, at ``wall`` training seconds (its last
    validation at or before them; and read off its curve linearly between the validations around
    them, which does not favour the arm whose end defines ``wall``) and at its end."""
    reached = [acc for t, acc in arm["curve"] if t <= wall + 1e-6]
    return {"steps": len(arm["scores"]),
            "reward_mean_steps_1_5": statistics.mean(arm["scores"][:5]),
            "reward_mean_last_5": statistics.mean(arm["scores"][-5:]),
            "val_accuracy_before": arm["curve"][0][1], "val_accuracy_at_equal_wall": reached[-1],
            "val_accuracy_at_equal_wall_interpolated": round(_interpolated(arm["curve"], wall), 4),
            "val_accuracy_end": arm["curve"][-1][1], "train_s": round(arm["train_s"], 1),
            "step_s_median": round(statistics.median(arm["step_s"]), 2),
            "val_curve": [(round(t, 1), acc) for t, acc in arm["curve"]]} | (
            {"val_tool_use_curve": arm["val_tool_use_curve"]} if "val_tool_use_curve" in arm else {})


def compare_arms(args: argparse.Namespace) -> None:
    """Both arms of --vs-gae, --vs-sync or --vs-no-tool, then each one's reward rise and accuracy at
    the shorter arm's training time (an arm's supervised warm start, --sft-steps, counts in it)."""
    overrides = [f"model.dtype={args.dtype}", *args.overrides]
    if args.vs_gae:
        flag, extra = "--vs-gae", (["--gae", *args.gae] if args.gae else [])
        second = {"ppo_gae": ["algorithm.adv_estimator=gae", *args.gae]}
        first = "grpo"
    elif args.vs_sync:
        flag, extra = "--vs-sync", (["--async", *args.async_overrides] if args.async_overrides else [])
        second = {"colocate_async": ["trainer.rollout_mode=colocate_async", *args.async_overrides]}
        first = "sync"
    else:
        flag, extra, second, first = "--vs-no-tool", [f"--sft-steps {args.sft_steps}"], {"no_tool": _NO_TOOL}, "tool"
    for more in [[], *second.values()]:  # both arms' settings checked before either trains
        load_config(args.preset, [f"train.total_steps={args.steps}", f"train.val_every={args.val_every}", *overrides, *more])
    arms = {first: _arm(args.preset, args.steps, args.val_every, overrides, sft_steps=args.sft_steps if args.vs_no_tool else 0)}
    arms |= {name: _arm(args.preset, args.steps, args.val_every, [*overrides, *more]) for name, more in second.items()}
    wall = min(arm["train_s"] for arm in arms.values())
    report = {"command": f"python bench/bench_learning.py {flag} " + " ".join(
        [f"--preset {args.preset} --steps {args.steps} --val-every {args.val_every} --dtype {args.dtype}", *args.overrides] + extra),
        "equal_wall_s": round(wall, 1)}
    for name, arm in arms.items():
        report[name] = _summary(arm, wall) | {"run_dir": arm["run_dir"]} | ({"sft": arm["sft"]} if "sft" in arm else {})
    emit(report, dtype=args.dtype)


def _trl_saver(budget_s: float, val_every: int, save):
    """A ``TrainerCallback`` that times each TRL optimizer step (``on_step_begin`` -> ``on_step_end``,
    generation and reward included), calls ``save(model, step, train_s)`` before training, every
    ``val_every`` steps and after the last step, and stops training once the steps' total reaches
    ``budget_s``. When that last step ends past ``budget_s``, the weights of the step before it
    (the last one ending within the budget, kept in memory) are saved too."""
    from transformers import TrainerCallback

    class TrlSaver(TrainerCallback):
        def __init__(self):
            self.elapsed, self.step_s, self.within = 0.0, [], None  # within: (step, train_s, weights or None if saved)

        def on_train_begin(self, args, state, control, model=None, **_):
            save(model, 0, 0.0)

        def on_step_begin(self, args, state, control, **_):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **_):
            self.step_s.append(time.perf_counter() - self.start)
            self.elapsed += self.step_s[-1]
            step, last = state.global_step, self.elapsed >= budget_s or state.global_step >= args.max_steps
            saved = step % val_every == 0 or last
            if saved:
                save(model, step, self.elapsed)
            if last:
                control.should_training_stop = True
                if self.elapsed > budget_s and self.within is not None and self.within[2] is not None:
                    model.load_state_dict(self.within[2])
                    save(model, *self.within[:2])
            else:
                weights = None if saved else {k: v.detach().clone() for k, v in model.state_dict().items()}
                self.within = (step, self.elapsed, weights)
            return control

    return TrlSaver()


def trl_worker(args: argparse.Namespace) -> None:
    """The TRL arm (run by ``--trl-python``): TRL's GRPOTrainer on the packrl arm's model, prompts
    in the same order, reward and hyperparameters, for ``--steps`` steps or until its step times
    add up to ``--trl-budget-s``; saves the policy and packrl's tokenizer into ``--trl-worker``.
    ``--dtype`` is the parent's resolved one (``bf16`` or ``fp32``): TRL's ``bf16=`` follows it."""
    from importlib.metadata import version

    import torch

    from packrl.models.loading import load_tokenizer
    from packrl.models.resolve import resolve_model

    torch.set_num_threads(THREADS)
    out = Path(args.trl_worker)
    cfg = packrl_config("demo", args.steps, str(out / "trainer"), args.overrides, dtype=args.dtype)
    tokenizer = load_tokenizer(resolve_model(cfg.model.path), cfg.model.path)
    scores: list[float] = []
    saves: list[dict] = []

    def save(model, step: int, train_s: float) -> None:
        path = out / f"step_{step}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        saves.append({"step": step, "train_s": train_s, "path": str(path)})

    saver = _trl_saver(args.trl_budget_s, args.val_every, save)
    trainer = trl_trainer(cfg, str(out / "trainer"), prompt_schedule(cfg, tokenizer, args.steps), args.trl_micro_batch,
                          [saver], on_reward=lambda _, rewards: scores.append(statistics.mean(rewards)))
    trainer.train()
    print("RESULT " + json.dumps({
        "scores": scores, "step_s": saver.step_s, "train_s": saver.elapsed, "saves": sorted(saves, key=lambda s: s["step"]),
        "versions": {name: version(name) for name in ("torch", "transformers", "trl")},
        "param_dtype": str(next(trainer.model.parameters()).dtype), "bf16": bool(trainer.args.bf16)}), flush=True)


def _score(preset: str, overrides: list[str], model_dir: str) -> float:
    """Held-out greedy accuracy of the model saved in ``model_dir``, by packrl's `validate` (the
    val set, decoding and scorer of the packrl arm)."""
    cfg = load_config(preset, [*overrides, f"model.path={model_dir}"])
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    return validate(workers, val_set, cfg.rollout, cfg.reward)["val/accuracy"]


def compare_trl(args: argparse.Namespace) -> None:
    """The packrl arm, then the TRL arm for the packrl arm's training time, each saved TRL model
    scored by packrl's evaluator; both arms' reward rise and accuracy at equal training time. The
    dtype is resolved once, here (`resolve_arms_dtype`): packrl's arm and the scoring get it as
    ``model.dtype``, TRL's as ``bf16=``."""
    import torch

    torch.set_num_threads(THREADS)
    dtype = resolve_arms_dtype(args.dtype)
    overrides = [f"model.dtype={dtype}", *args.overrides]
    packrl = _arm(args.preset, args.steps, args.val_every, overrides)
    with tempfile.TemporaryDirectory(prefix="packrl-vs-trl-") as out:
        res = run_worker([args.trl_python, str(Path(__file__).resolve()), "--trl-worker", out, "--trl-budget-s", repr(packrl["train_s"]),
                          "--steps", str(args.steps), "--val-every", str(args.val_every), "--dtype", dtype,
                          "--trl-micro-batch", str(args.trl_micro_batch), *args.overrides], "trl")
        curve = [(s["train_s"], _score(args.preset, overrides, s["path"])) for s in res["saves"]]
    trl = {"scores": res["scores"], "step_s": res["step_s"], "train_s": res["train_s"], "curve": curve}
    wall = min(packrl["train_s"], trl["train_s"])
    cfg = packrl_config("demo", args.steps, tempfile.gettempdir(), args.overrides, dtype=dtype)
    report = {"command": "python bench/bench_learning.py --vs-trl " + " ".join(
        [f"--steps {args.steps} --val-every {args.val_every} --trl-micro-batch {args.trl_micro_batch} --dtype {args.dtype}",
         *args.overrides]),
        "versions": res["versions"], "torch_threads": THREADS,
        "arms_dtype": {"packrl": f"model.dtype={dtype}", "trl": f"bf16={res['bf16']}"},
        "config": {"model": cfg.model.path, "digits": cfg.data.arithmetic.digits, "B": cfg.data.batch_size, "n": cfg.rollout.n,
                   "max_response_tokens": cfg.rollout.max_response_tokens, "lr": cfg.train.lr,
                   "val_rows": cfg.data.max_val_rows, "trl_micro_batch": args.trl_micro_batch},
        "equal_wall_s": round(wall, 1),
        "packrl": _summary(packrl, wall) | {"run_dir": packrl["run_dir"]},
        "trl": _summary(trl, wall) | {"saved_steps": [s["step"] for s in res["saves"]], "param_dtype": res["param_dtype"],
                                      "process_wall_s": res["process_wall_s"]}}
    emit(report, dtype=args.dtype)


if __name__ == "__main__":
    main()

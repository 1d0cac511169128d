"""`packrl sft` as a recipe beside RL's: its own update spec and plan (no engine, no RL rules), the
shared sampler, resume and accounting. A resumed run continues on exactly the traces it stopped
at, and a resume on edited traces is refused with the reason, as RL's sampler refuses other prompts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from packrl.algos.policy_losses import PolicyLossInputs, PolicyLossOutput
from packrl.config import load_config
from packrl.config.plan import BatchPlan
from packrl.config.sft_rules import sft_context_problems, sft_problems, trace_budgets
from packrl.distributed import open_worker_group
from packrl.models.loading import load_policy_tokenizer
from packrl.registry import POLICY_LOSSES
from packrl.trainer.resume import resume, trainer_state
from packrl.trainer.run import Run, seed_everything
from packrl.trainer.sft import sft, sft_traces, trace_sampler, update_spec
from tests.invariance.test_sft_invariance import SFT
from tests.same_training import assert_same_training

TRACE = [{"role": "user", "content": "What is 12 * 34?"},
         {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'},
         {"role": "tool", "content": "408"}, {"role": "assistant", "content": "12 * 34 = 408\n#### 408"}]


def _write_traces(path, answers):
    path.write_text("".join(json.dumps({"messages": [*TRACE[:3], {"role": "assistant", "content": a}]}) + "\n" for a in answers))
    return path


def _cfg(model_dir, out, *more):
    return load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={out}", *SFT, *more])


def _lines(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_sft_update_is_its_own_spec_and_plan():
    cfg = load_config("arithmetic_tool", ["sft.batch_size=6", "sft.lr=3e-5", "train.lr=1e-6", "train.ppo_epochs=2",
                                          "train.mini_batch_size=4", "rollout.temperature=0.7", "train.warmup_steps=2"])
    spec = update_spec(cfg.sft, cfg.train)
    assert (spec.policy_loss, spec.loss_agg_mode, spec.loss_metric, spec.rl_metrics) == ("sft", "token-mean", "sft/loss", False)
    assert (spec.optimizer.lr, spec.optimizer.lr_key, spec.optimizer.warmup_steps) == (3e-5, "sft.lr", 2)  # train.lr is RL's
    assert (spec.mini_batch_size, spec.num_epochs, spec.temperature) == (6, 1, 1.0)  # not train.*, not rollout.temperature
    plan = BatchPlan.supervised(cfg, spec, max_response_tokens=256)
    assert (plan.num_prompts, plan.group_size, plan.mini_batch_prompts, plan.num_epochs) == (6, 1, 6, 1)
    assert not (plan.generates or plan.has_reference or plan.has_critic or plan.needs_old_logprobs)
    rl = BatchPlan.from_config(cfg)
    assert rl.generates and (rl.mini_batch_prompts, rl.num_epochs, rl.update.temperature) == (4, 2, 0.7)


def test_the_sft_rules_are_its_own():
    # an RL problem (one response per group under GRPO) is not the SFT recipe's: it never sees rollout.n
    cfg = load_config("arithmetic_tool", ["sft.total_steps=2"])
    assert sft_problems(replace(cfg, rollout=replace(cfg.rollout, n=1))) == []
    problems = {p.key: str(p) for p in sft_problems(load_config("arithmetic_tool", ["sft.total_steps=0"]))}
    assert "leaves packrl sft nothing to train" in problems["sft.total_steps"]
    big = load_config("arithmetic_tool", ["sft.total_steps=1", "sft.max_response_tokens=4000"])
    budget = {p.key: str(p) for p in sft_problems(big)}["train.max_tokens_per_microbatch"]
    assert "smaller than the longest trace packrl sft keeps, sft.max_prompt_tokens + sft.max_response_tokens = 192 + 4,000" in budget
    ranks = load_config("arithmetic_tool", ["sft.total_steps=1", "sft.batch_size=2", "trainer.num_workers=4"])
    assert "more than the sft.batch_size=2 traces of a step" in str(sft_problems(ranks)[0])
    restarts = replace(cfg, trainer=replace(cfg.trainer, max_restarts=2, rollout_mode="separate_async"))  # RL's rule lets it pass
    assert "has no effect in packrl sft with trainer.num_workers=1" in str(sft_problems(restarts)[0])
    budgets = trace_budgets(cfg.data, cfg.rollout, cfg.sft)
    context = sft_context_problems(budgets, max_context_tokens=400)  # 192 + 256 = 448 tokens per trace at most
    assert [p.key for p in context] == ["sft.max_response_tokens"] and "over the model context of 400" in str(context[0])
    assert sft_context_problems(trace_budgets(cfg.data, cfg.rollout, cfg.sft), max_context_tokens=448) == []


def test_an_sft_run_logs_its_own_metrics_and_no_engine(tmp_path, model_dir):
    run = sft(_cfg(model_dir, tmp_path / "run", "sft.total_steps=1", "train.max_tokens_per_microbatch=256"))
    line = _lines(run)[0]
    assert {"sft/loss", "sft/epoch", "sft/num_tokens", "sft/num_loss_tokens", "actor/grad_norm", "actor/lr", "actor/entropy"} <= set(line)
    assert not [k for k in line if k.startswith(("bucket/", "actor/pg_", "actor/ppo_kl", "actor/kl_loss"))]
    assert line["actor/lr"] == pytest.approx(1e-4)  # sft.lr, not train.lr
    assert "generation" not in (run / "model.txt").read_text()
    assert "one sequence per prompt" in (run / "model.txt").read_text()
    written = yaml.safe_load((run / "config.yaml").read_text())  # the config as given, not an RL config rewritten for SFT
    assert (written["algorithm"]["policy_loss"], written["rollout"]["n"], written["sft"]["total_steps"]) == ("ppo_clip", 4, 1)
    accounting = json.loads((run / "data_accounting.json").read_text())["sft"]
    assert accounting["totals"]["num_kept"] == 6 and accounting["rows"][0]["source"] == "task:tool_traces"


def test_a_resume_on_edited_traces_is_refused_with_the_reason(tmp_path, model_dir):
    traces = _write_traces(tmp_path / "traces.jsonl", [f"#### {k}" for k in range(5)])
    out = tmp_path / "run"
    common = [f"sft.train_files=[{traces}]", "sft.batch_size=2", "train.max_tokens_per_microbatch=256"]
    sft(_cfg(model_dir, out, *common, "sft.total_steps=1"))
    _write_traces(traces, ["#### 0", "#### 1", "#### 22", "#### 3", "#### 4"])  # one answer edited: 5 traces still
    with pytest.raises(ValueError, match=r"the traces of sft.train_files differ from the checkpoint's \(5 traces either way, "
                                         r"fingerprint [0-9a-f]{16} != [0-9a-f]{16}\): the saved data position would point at other "
                                         r"traces; resume with the same sft.train_files"):
        sft(_cfg(model_dir, out, *common, "sft.total_steps=2", "train.resume=auto"))
    _write_traces(traces, [f"#### {k}" for k in range(4)])  # a trace removed
    with pytest.raises(ValueError, match=r"sampler state is for 5 traces but sft.train_files now gives 4"):
        sft(_cfg(model_dir, out, *common, "sft.total_steps=2", "train.resume=auto"))
    assert [line["step"] for line in _lines(out)] == [1]  # nothing trained on the edited traces


@pytest.mark.slow
def test_a_resumed_sft_run_trains_as_an_uninterrupted_one(tmp_path, model_dir):
    """Three steps of 4 over 6 traces (steps 2 and 3 span epochs): stopped after step 2 and resumed,
    the run draws the same traces and ends with the same weights and AdamW moments (float64)."""
    common = ["train.max_tokens_per_microbatch=256", "train.save_every=1"]
    straight = sft(_cfg(model_dir, tmp_path / "straight", *common, "sft.total_steps=3"))
    sft(_cfg(model_dir, tmp_path / "resumed", *common, "sft.total_steps=2"))
    resumed = sft(_cfg(model_dir, tmp_path / "resumed", *common, "sft.total_steps=3", "train.resume=auto"))
    assert "after step 2" in (resumed / "resumed.txt").read_text()
    a, b = _lines(straight), _lines(resumed)
    assert [line["step"] for line in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert (x["sft/epoch"], x["sft/num_tokens"]) == (y["sft/epoch"], y["sft/num_tokens"])
        assert x["sft/loss"] == pytest.approx(y["sft/loss"], rel=1e-10)
    assert a[-1]["sft/epoch"] == pytest.approx(2.0)
    assert_same_training(straight / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")


@POLICY_LOSSES.register("test_doubled_nll")
def doubled_nll(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Twice the supervised NLL: a second supervised objective for the recipe below."""
    return PolicyLossOutput(-2.0 * inputs.logprobs)


def doubled_sft(cfg) -> tuple:
    """A second supervised recipe in one file, on the shared parts: its own update spec (its
    registered loss and metric name), the supervised plan, the shared sampler, resume,
    accounting and worker update."""
    spec = replace(update_spec(cfg.sft, cfg.train), algorithm=replace(cfg.algorithm, policy_loss="test_doubled_nll",
                                                                         loss_agg_mode="token-mean"), loss_metric="test/doubled_nll")
    plan = BatchPlan.supervised(cfg, spec, max_response_tokens=cfg.rollout.max_response_tokens)
    with Run(cfg, total_steps=cfg.sft.total_steps) as run:
        traces = sft_traces(cfg, load_policy_tokenizer(cfg.model))
        run.write_accounting("sft_accounting.txt", {"sft": traces})
        with open_worker_group(cfg, run.dir, plan=plan) as workers:
            sampler = trace_sampler(traces, cfg.sft.batch_size, cfg.train.seed)
            done = resume(run, workers, cfg.train, {"sampler": sampler}, total_steps=cfg.sft.total_steps, total_key="sft.total_steps")
            for step in range(done + 1, cfg.sft.total_steps + 1):
                seed_everything(cfg.train.seed * 1_000_003 + step)
                run.log_step(step, workers.update(traces.train_batch(sampler.next_indices()), step=step))
            workers.save_checkpoint(run.dir, cfg.sft.total_steps, trainer_state({"sampler": sampler}))
    return run.dir


def test_a_second_supervised_objective_is_one_recipe_on_the_shared_parts(tmp_path, model_dir):
    common = ["sft.total_steps=1", "train.max_tokens_per_microbatch=256"]
    ours = _lines(doubled_sft(_cfg(model_dir, tmp_path / "doubled", *common)))[0]
    theirs = _lines(sft(_cfg(model_dir, tmp_path / "sft", *common)))[0]
    assert ours["test/doubled_nll"] == pytest.approx(2 * theirs["sft/loss"], rel=1e-10)  # the same traces, twice the NLL
    assert ours["actor/grad_norm"] == pytest.approx(2 * theirs["actor/grad_norm"], rel=1e-8)
    assert "sft/loss" not in ours and not [k for k in ours if k.startswith("bucket/")]

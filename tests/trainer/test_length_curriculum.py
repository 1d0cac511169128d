"""A length curriculum (`rollout.max_response_tokens_schedule`): the budget of each step, the
config checks (each naming its key and stage), the per-request multi-turn limits, and a tiny run
whose budget switches at step 3 and resumes across the switch to the same metrics."""

from __future__ import annotations

import json
import re

import pytest

from packrl.config.budgets import budget_problems, budgets_of, budgets_table, response_schedule
from packrl.config.load import check_config
from packrl.config.schema import RolloutConfig
from packrl.diagnostics.report import write_report
from packrl.rollout.engine import SamplingParams
from packrl.rollout.multi_turn import TurnLimits
from packrl.seqlen.curriculum import ResponseBudgetSchedule
from tests.builders import CALL, calculator_prompt_ids, metric_lines, scripted_engine
from tests.diagnostics.tiny_run import tiny_run

KEY = "rollout.max_response_tokens_schedule"


def _problems(*overrides: str) -> list:
    """The problems of the demo preset with ``overrides`` (rollout.max_response_tokens=64)."""
    _, problems, _ = check_config("demo", ["rollout.max_response_tokens=64", *overrides])
    return problems


def _about(problems, key: str) -> list[str]:
    return [str(p) for p in problems if p.key == key]


@pytest.mark.parametrize("stages, step, budget", [
    (((1, 6), (3, 12)), 1, 6), (((1, 6), (3, 12)), 2, 6), (((1, 6), (3, 12)), 3, 12), (((1, 6), (3, 12)), 9, 12),
    (((1, 512),), 1, 512), (((1, 512),), 1000, 512), (((1, 8), (2, 4), (5, 16)), 4, 4),
])
def test_the_budget_of_a_step_is_its_stage(stages, step, budget):
    schedule = ResponseBudgetSchedule(stages)
    assert schedule.at(step) == budget
    assert schedule.metrics(step) == {"rollout/max_response_tokens": float(budget)}


def test_steps_count_from_one_and_stages_are_described():
    schedule = ResponseBudgetSchedule(((1, 256), (101, 512)))
    with pytest.raises(ValueError, match="steps count from 1"):
        schedule.at(0)
    assert schedule.describe() == "steps 1-100: 256; steps 101+: 512"
    assert schedule.label(0) == "stage 1 (steps 1-100, 256 tokens)"
    assert (schedule.max_response_tokens, schedule.min_response_tokens) == (512, 256)
    with pytest.raises(ValueError, match="must start at step 1"):
        ResponseBudgetSchedule(((2, 256),))


def test_without_a_schedule_every_step_has_the_response_budget():
    cfg, problems, _ = check_config("demo", ["rollout.max_response_tokens=64"])
    assert not _about(problems, KEY)
    schedule = response_schedule(cfg.rollout)
    assert schedule.stages == ((1, 64),) and schedule.at(10_000) == 64


@pytest.mark.parametrize("value, message", [
    ("[[2,32],[5,64]]", "stage 1 starts at step 2; the first stage must start at step 1"),
    ("[[1,32],[5,48],[5,64]]", "stage 3 starts at step 5, not after stage 2's step 5"),
    ("[[1,32],[7,48],[4,64]]", "stage 3 starts at step 4, not after stage 2's step 7"),
    ("[[1,0],[3,64]]", r"stage 1 has max_response_tokens=0, must be >= 1; fix: set rollout.max_response_tokens_schedule\[0\]\[1\]"),
    ("[[1,32],[3,48]]", "its largest stage budget 48 differs from rollout.max_response_tokens=64"),
    ("[[1,32],[3,128]]", "its largest stage budget 128 differs from rollout.max_response_tokens=64"),
    ("[1,64]", r"stage 1 is \[1\], not a \[first_step, max_response_tokens\] pair"),
    ("[[1,32,5]]", r"stage 1 is \[1, 32, 5\], not a \[first_step, max_response_tokens\] pair"),
    ("[]", "must be a non-empty list"),
])
def test_a_bad_schedule_is_refused_naming_the_key(value, message):
    found = _about(_problems(f"{KEY}={value}"), KEY)
    assert found, f"no problem about {KEY}"
    assert any(re.search(message, text) for text in found), found
    assert all("fix:" in text for text in found)


def test_a_valid_schedule_has_no_problem():
    assert not _about(_problems(f"{KEY}=[[1,16],[3,64]]"), KEY)
    assert not _about(_problems(f"{KEY}=[[1,64],[3,16]]"), KEY)  # budgets need not grow; the largest is the key's


def test_every_stage_must_fit_the_model_context_and_the_problem_names_the_stage():
    cfg, problems, _ = check_config("demo", ["data.max_prompt_tokens=100", "rollout.max_response_tokens=64",
                                             f"{KEY}=[[1,16],[3,40],[5,64]]", "train.max_tokens_per_microbatch=4096"])
    assert not _about(problems, KEY)
    found = [str(p) for p in budget_problems(budgets_of(cfg, max_context_tokens=130))]
    assert len(found) == 2, found  # 100 + 16 fits 130; 100 + 40 and 100 + 64 do not
    assert found[0].startswith(f"{KEY}=[3, 40]: in stage 2 (steps 3-4, 40 tokens)") and "= 140 > model context 130" in found[0]
    assert found[1].startswith(f"{KEY}=[5, 64]: in stage 3 (steps 5+, 64 tokens)") and "= 164 > model context 130" in found[1]
    assert f"{KEY}[2][1]" in found[1]
    assert not budget_problems(budgets_of(cfg, max_context_tokens=164))


def test_every_stage_must_fit_the_micro_batch_budgets_at_config_load():
    problems = _problems("data.max_prompt_tokens=100", f"{KEY}=[[1,16],[3,64]]", "train.max_tokens_per_microbatch=140")
    found = _about(problems, "train.max_tokens_per_microbatch")
    assert len(found) == 1 and "in stage 2 (steps 3+, 64 tokens)" in found[0] and "= 164" in found[0], found
    assert "raise train.max_tokens_per_microbatch to >= 164" in found[0]


def test_the_overlong_buffer_must_fit_the_smallest_stage():
    key = "reward.shaping.overlong.buffer_tokens"
    found = _about(_problems(f"{KEY}=[[1,16],[3,64]]", f"{key}=20"), key)
    assert len(found) == 1 and "stage 1 (steps 1-2, 16 tokens)" in found[0] and "<= 16" in found[0], found
    assert not _about(_problems(f"{KEY}=[[1,16],[3,64]]", f"{key}=16"), key)


def test_the_budget_table_lists_the_stages():
    cfg, _, _ = check_config("demo", ["rollout.max_response_tokens=64", f"{KEY}=[[1,16],[3,64]]"])
    plan = budgets_table(budgets_of(cfg, max_context_tokens=2048))
    assert "(the largest stage)" in plan and KEY in plan and "steps 1-2: 16; steps 3+: 64" in plan
    assert "all relations hold" in plan


def test_sampling_params_take_the_steps_budget():
    rollout = RolloutConfig(max_response_tokens=64, max_response_tokens_schedule=[[1, 16], [3, 64]])
    schedule = response_schedule(rollout)
    assert SamplingParams.from_config(rollout, max_response_tokens=schedule.at(2)).max_response_tokens == 16
    assert SamplingParams.from_config(rollout).max_response_tokens == 64  # validation: the largest stage


def test_multi_turn_limits_follow_the_requests_budget(smollm_tokenizer):
    limits = TurnLimits(max_tokens_per_turn=64, max_response_tokens=400, max_trajectory_tokens=10_000, max_context_tokens=10_000)
    assert limits.within(20) == TurnLimits(20, 20, 10_000, 10_000)
    assert limits.within(1000) == limits
    engine, scripted = scripted_engine(smollm_tokenizer, [CALL % "12 * 34", CALL % "1 + 1", "#### 408"])
    [[response]] = engine.generate([calculator_prompt_ids(smollm_tokenizer)], SamplingParams(n=1, max_response_tokens=30), [0])
    assert all(budget <= 30 for _, budget, _ in scripted.requests)
    assert len(response.response_ids) <= 30


# The tiny run: budget 6 tokens for steps 1-2, 12 from step 3; a dense reward and a mini-batch per
# prompt so the parameters move every step (as tests/e2e/test_resume.py).
RUN = ["rollout.max_response_tokens=12", f"{KEY}=[[1,6],[3,12]]", "reward.name=test_letter_e", "train.mini_batch_size=1",
       "train.lr=1e-2", "train.save_every=2", "train.dump_rollouts=true"]
STAGE = {1: 6, 2: 6, 3: 12, 4: 12}


def _response_tokens(run_dir, step):
    return [json.loads(line)["response_tokens"] for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_a_curriculum_run_switches_at_step_3_and_resumes_across_the_switch(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    tok.padding_side = "left"
    straight, _ = tiny_run(tmp_path / "a", tok, ["train.total_steps=4", *RUN])
    lines = metric_lines(straight)
    assert [line["rollout/max_response_tokens"] for line in lines] == [6.0, 6.0, 12.0, 12.0]
    for line in lines:
        budget = STAGE[line["step"]]
        assert line["response_length/max"] <= budget
        assert all(n <= budget for n in _response_tokens(straight, line["step"])), line["step"]
    assert max(_response_tokens(straight, 3) + _response_tokens(straight, 4)) > 6, "the larger stage must take effect"
    assert any(line["actor/grad_norm"] > 0 for line in lines), "the run must actually train"
    budgets = (straight / "budgets.txt").read_text()
    assert KEY in budgets and "steps 1-2: 6; steps 3+: 12" in budgets

    # stop after step 2 (the last of stage 1), then resume in the same run dir for steps 3-4 (stage 2)
    tiny_run(tmp_path / "b", tok, ["train.total_steps=2", *RUN])
    resumed, _ = tiny_run(tmp_path / "b", tok, ["train.total_steps=4", "train.resume=auto", *RUN])
    assert "after step 2" in (resumed / "resumed.txt").read_text()
    b = metric_lines(resumed)
    assert [line["step"] for line in b] == [1, 2, 3, 4]
    assert [line["rollout/max_response_tokens"] for line in b] == [6.0, 6.0, 12.0, 12.0]
    for step in (1, 2, 3, 4):
        assert _response_tokens(resumed, step) == _response_tokens(straight, step), step
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "response_length/max"):
            assert b[step - 1][key] == pytest.approx(lines[step - 1][key], abs=1e-6), (step, key)

    page = write_report(straight).read_text()
    assert f"{KEY}=[[1, 6], [3, 12]]" in page and "budget of the step (length curriculum)" in page

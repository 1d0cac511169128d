"""Rollout modes are registered stages: a new mode is one plugin file with its registration (its
info and its config check), selected by trainer.rollout_mode and run by the loop unchanged."""

from __future__ import annotations

import json

import pytest

from packrl.config import ConfigError, load_config
from packrl.config.rollout_modes import COLOCATE_ASYNC, SEPARATE_ASYNC, SYNC, mode_info
from packrl.registry import ROLLOUT_MODES, import_plugins
from tests.diagnostics.tiny_run import tiny_run

PLUGIN = '''
from functools import partial

from packrl.config.rollout_modes import RolloutModeInfo
from packrl.errors import ConfigProblem
from packrl.registry import ROLLOUT_MODES
from packrl.trainer.stages.rounds import Rounds, one_round


@ROLLOUT_MODES.register("test_counted", info=RolloutModeInfo())
def counted(context):
    """One round per step, as sync, with a metric of its own."""
    inner = partial(one_round, reward=context.cfg.reward, sampler=context.sampler, workers=context.workers)

    def rounds(sampling, timing, spans, step):
        rollout, scored, _ = inner(sampling, timing, spans, step)
        return rollout, scored, {"train/test_mode_prompts": float(len(rollout.prompts))}

    return Rounds(rounds)


@ROLLOUT_MODES.register_check("test_counted")
def counted_problems(cfg):
    if cfg.rollout.n < 2:
        return [ConfigProblem("rollout.n", cfg.rollout.n, "must be >= 2 under trainer.rollout_mode=test_counted", "set rollout.n=2")]
    return []
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("modes") / "modes.py"
    path.write_text(PLUGIN)
    assert import_plugins([str(path)]) == []
    return path


def test_the_built_in_modes_declare_what_they_carry():
    assert mode_info("sync") == SYNC and not SYNC.carries_groups
    assert mode_info("colocate_async") == COLOCATE_ASYNC and COLOCATE_ASYNC.carries_groups and not COLOCATE_ASYNC.rollout_workers
    assert mode_info("separate_async") == SEPARATE_ASYNC and SEPARATE_ASYNC.rollout_workers
    assert {"sync", "colocate_async", "separate_async"} <= set(ROLLOUT_MODES.names())


def test_an_unknown_mode_names_the_nearest():
    with pytest.raises(ConfigError, match=r"trainer.rollout_mode='sinc': is not a registered rollout mode; fix: did you mean "
                                          r"trainer.rollout_mode=sync\?"):
        load_config("demo", ["trainer.rollout_mode=sinc"])


def test_a_plugin_mode_is_checked_at_load_and_runs_in_the_loop(tmp_path, plugin, smollm_tokenizer):
    base = [f"trainer.plugins=[{plugin}]", "trainer.rollout_mode=test_counted"]
    with pytest.raises(ConfigError, match=r"rollout.n=1: must be >= 2 under trainer.rollout_mode=test_counted"):
        load_config("demo", [*base, "rollout.n=1"])
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, ["train.total_steps=2", "reward.name=test_letter_e", *base])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["train/test_mode_prompts"] for line in lines] == [2.0, 2.0]


CARRYING_PLUGIN = '''
from packrl.config.rollout_modes import RolloutModeInfo
from packrl.registry import ROLLOUT_MODES


@ROLLOUT_MODES.register("test_carrying", info=RolloutModeInfo(carries_groups=True, rollout_workers=True))
def carrying(context):
    raise NotImplementedError
'''


def test_the_rules_read_what_a_plugin_mode_declares_in_a_fresh_process(tmp_path):
    """The plugins are imported before the cross-field rules run, so a rule that asks a mode what
    it declares sees a plugin's mode (here: thinking budgets refused for carried groups, restarts
    allowed for its rollout workers) in a process that has not imported the plugin before."""
    import subprocess
    import sys

    path = tmp_path / "carrying.py"
    path.write_text(CARRYING_PLUGIN)
    code = ("from packrl.config import check_config\n"
            f"_, problems, _ = check_config('demo', ['trainer.plugins=[{path}]', 'trainer.rollout_mode=test_carrying', "
            "'rollout.think_budget_tokens=16', 'trainer.max_restarts=1'])\n"
            "print('|'.join(str(p) for p in problems))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "does not apply to responses carried across steps (trainer.rollout_mode=test_carrying)" in out, out
    assert "trainer.max_restarts" not in out and "not a registered" not in out, out


def test_an_unknown_mode_with_a_rule_that_reads_the_mode_is_one_clear_problem():
    with pytest.raises(ConfigError, match=r"trainer.rollout_mode='bogus': is not a registered rollout mode") as caught:
        load_config("demo", ["trainer.rollout_mode=bogus", "rollout.think_budget_tokens=16", "trainer.max_restarts=1"])
    assert "think_budget_tokens" not in str(caught.value)


def test_a_mode_that_declares_something_else_is_named():
    with pytest.raises(ValueError, match=r"trainer.rollout_mode='test_dict_info' registered info=\{'rollout_workers': True\}; "
                                         r"declare a RolloutModeInfo"):
        ROLLOUT_MODES.register("test_dict_info", info={"rollout_workers": True})(lambda context: None)
    assert "test_dict_info" not in ROLLOUT_MODES

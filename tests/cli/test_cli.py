"""The `packrl` command."""

from __future__ import annotations

import subprocess
import sys

from packrl.cli.main import main
from tests.conftest import SMOLLM_DIR


def test_help_runs_as_a_console_command():
    out = subprocess.run([sys.executable, "-m", "packrl.cli.main", "--help"], capture_output=True, text=True, check=True)
    assert "config" in out.stdout


def test_config_prints_resolved_yaml(capsys):
    model = str(SMOLLM_DIR)
    assert main(["config", "gsm8k", "data.max_prompt_tokens=300", f"model.path={model}", "--budgets"]) == 0
    out = capsys.readouterr().out
    assert "max_prompt_tokens: 300" in out and "token budgets" in out and "8,192" in out
    assert "sequences per step" in out and "16 (4 prompts x 4 responses)" in out  # the batch plan, as in budgets.txt


def test_config_overrides_without_preset(capsys):
    assert main(["config", "rollout.n=3"]) == 0
    assert "'n': 3" in capsys.readouterr().out


def test_config_errors_exit_2_with_every_problem(capsys):
    assert main(["config", "data.max_prompt_tokns=3", "rollout.n=0"]) == 2
    err = capsys.readouterr().err
    assert "2 config problem(s)" in err and "did you mean data.max_prompt_tokens" in err and "rollout.n=0" in err


def test_overrides_may_follow_flags(capsys):
    model = str(SMOLLM_DIR)
    assert main(["config", "gsm8k", "--budgets", "rollout.n=4", f"model.path={model}"]) == 0
    assert "'n': 4" in capsys.readouterr().out


def test_unreadable_model_config_is_not_a_silent_pass(tmp_path, capsys):
    assert main(["config", f"model.path={tmp_path}", "--budgets"]) == 2
    captured = capsys.readouterr()
    assert "NOT checked" in captured.err and "not checked" in captured.out


def test_train_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert main(["train", "reward.name=nope"]) == 2
    assert "reward.name='nope'" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["train", f"train.out_dir={a_file}"]) == 2
    assert "train.out_dir=" in capsys.readouterr().err


def test_train_refuses_to_mix_two_runs_in_one_dir(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", f"train.out_dir={tmp_path}"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_an_interrupt_says_which_steps_were_kept(tmp_path, capsys, monkeypatch):
    from packrl.config import load_config
    from packrl.trainer import loop
    from packrl.trainer.run import Run
    from packrl.worker.checkpoint import STATE_FILE

    def interrupted_after(steps: int):
        def fake_train(cfg):
            with Run(cfg) as run:
                for step in range(1, steps + 1):
                    run.log_step(step, {"x": 1.0})
                raise KeyboardInterrupt
        return fake_train

    from packrl.cli.training import train_and_report

    (tmp_path / "3" / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "3" / "checkpoints" / "step_3" / STATE_FILE).write_text("x")
    for steps, says in ((0, "before any step completed"), (2, "after step 2; its metrics are in"),
                        (3, "after step 3; its metrics are in")):
        monkeypatch.setattr(loop, "train", interrupted_after(steps))
        cfg = load_config(None, [f"train.out_dir={tmp_path / str(steps)}", "train.loggers=[]"])
        assert train_and_report(cfg, "packrl train") == 130
        err = capsys.readouterr().err
        assert f"packrl train: interrupted {says}" in err and str(tmp_path / str(steps)) in err
        assert ("no checkpoint was saved (train.save_every=0)" in err) == (steps == 2)
        assert ("the newest checkpoint is" in err and "train.resume=auto" in err) == (steps == 3)


def test_an_interrupt_outside_a_run_is_one_line(monkeypatch, capsys):
    import packrl.cli.main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_config", interrupted)
    assert main(["config", "rollout.n=2"]) == 130
    assert capsys.readouterr().err == "packrl config: interrupted\n"


def test_sft_is_checked_by_its_own_rules_not_rls(tmp_path, capsys):
    """`packrl sft` loads the config without RL's cross-field rules: a setting RL refuses with RL's
    fix (restarts need separate_async) gets the supervised recipe's reason and fix instead."""
    argv = ["sft", "arithmetic_tool", "sft.total_steps=1", "trainer.max_restarts=1", f"train.out_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no effect in packrl sft with trainer.num_workers=1" in err and "separate_async" not in err, err
    assert not (tmp_path / "run").exists(), "refused before anything is written"

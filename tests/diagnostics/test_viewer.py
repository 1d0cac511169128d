"""`packrl view`: dump loading, sorting and filtering, and the app driven by Textual's pilot."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from packrl.cli.main import main
from packrl.diagnostics.viewer import (
    FINISH_FILTERS,
    RolloutViewer,
    Sample,
    filter_samples,
    find_step_files,
    load_run,
    next_filter,
    parse_sample,
    read_step,
    sort_samples,
    view_samples,
)

# (index, response_tokens, finish_reason, reward) per step; the rest of each row is derived.
STEP_1 = [(0, 12, "eos", 1.0), (1, 64, "length", 0.0), (2, 30, "stop", 0.5), (3, 64, "context", -1.0)]
STEP_2 = [(0, 5, "eos", 0.0), (1, 40, "eos", 1.0), (2, 64, "length", 0.25)]


def _row(step: int, index: int, response_tokens: int, finish_reason: str, reward: float) -> dict:
    """One dump line in the format of RUN_DIR/rollouts/step_N.jsonl."""
    return {
        "step": step, "index": index, "prompt_index": index // 2, "sample_index": index % 2, "row": 100 + index,
        "data_source": "arithmetic", "prompt": f"What is {index} + [1]?", "response": f"answer {index} " * 3,
        "prompt_tokens": 10 + index, "response_tokens": response_tokens, "finish_reason": finish_reason,
        "truncated": finish_reason in ("length", "context"), "score": reward, "reward": reward,
        "advantage": reward - 0.5, "ground_truth": str(index + 1), "prompt_truncated": index == 3,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A RUN_DIR with dumps of steps 1 and 2; step 1 holds one malformed line and one blank line."""
    folder = tmp_path / "run" / "rollouts"
    folder.mkdir(parents=True)
    lines = [json.dumps(_row(1, *r)) for r in STEP_1]
    lines.insert(2, '{"step": 1, "index": 9, "prompt": "cut off mid-wri')
    lines.insert(3, "")
    (folder / "step_1.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "step_2.jsonl").write_text("".join(json.dumps(_row(2, *r)) + "\n" for r in STEP_2))
    (folder / "notes.txt").write_text("not a dump")
    return tmp_path / "run"


def _sample(index: int, response_tokens: int, finish_reason: str, reward: float) -> Sample:
    return parse_sample(_row(1, index, response_tokens, finish_reason, reward))


# ------------------------------------------------------------------ loading


def test_find_step_files_orders_by_step_number(run_dir: Path) -> None:
    (run_dir / "rollouts" / "step_10.jsonl").write_text("")
    assert list(find_step_files(run_dir)) == [1, 2, 10]


def test_missing_rollouts_dir_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no rollouts/ folder.*train\.dump_rollouts=true"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "rollouts").mkdir()
    with pytest.raises(ValueError, match="holds no step_N.jsonl files"):
        load_run(tmp_path)


def test_read_step_skips_and_counts_malformed_lines(run_dir: Path) -> None:
    steps = load_run(run_dir)
    assert [s.step for s in steps] == [1, 2]
    first = steps[0]
    assert [s.index for s in first.samples] == [0, 1, 2, 3]
    assert first.num_malformed == 1
    assert first.malformed[0][0] == 3 and first.malformed[0][1].startswith("not JSON")
    assert steps[1].num_malformed == 0


def test_step_summaries(run_dir: Path) -> None:
    first = load_run(run_dir)[0]
    assert first.num_samples == 4
    assert first.mean_reward == pytest.approx(0.125)
    assert first.mean_response_tokens == pytest.approx(42.5)
    assert first.truncated_fraction == pytest.approx(0.5)


def test_empty_step_has_nan_means(tmp_path: Path) -> None:
    path = tmp_path / "step_3.jsonl"
    path.write_bytes(b"[1, 2]\n\xff\xfe not utf-8\n")
    step = read_step(path, 3)
    assert step.num_samples == 0 and step.num_malformed == 2
    assert "expected a JSON object" in step.malformed[0][1]
    assert math.isnan(step.mean_reward) and math.isnan(step.truncated_fraction)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": "high"}, "reward should be a number"),
        ({"response_tokens": 3.5}, "response_tokens should be an integer"),
        ({"index": True}, "index should be an integer"),
        ({"prompt_truncated": 1}, "prompt_truncated should be true or false"),
        ({"finish_reason": None}, "finish_reason should be a string"),
    ],
)
def test_parse_sample_rejects_wrong_types(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sample({**_row(1, 0, 5, "eos", 1.0), **change})


def test_parse_sample_names_missing_fields_and_allows_optional_ones() -> None:
    row = _row(1, 0, 5, "eos", 1)
    del row["reward"], row["advantage"]
    with pytest.raises(ValueError, match="missing field.*reward, advantage"):
        parse_sample(row)
    row = _row(1, 0, 5, "eos", 1)
    del row["ground_truth"], row["data_source"], row["score"]
    sample = parse_sample(row)
    assert sample.reward == 1.0 and isinstance(sample.reward, float) and sample.ground_truth == ""


# ------------------------------------------------------------------ sorting and filtering

# The module docstring's table: index, response_tokens, finish_reason, reward.
TABLE = [_sample(0, 12, "eos", 1.0), _sample(1, 64, "length", 0.0), _sample(2, 30, "stop", 0.5)]


def _indices(samples: list[Sample]) -> list[int]:
    return [s.index for s in samples]


def test_sort_samples_matches_docstring_table() -> None:
    assert _indices(sort_samples(TABLE, "length")) == [1, 2, 0]
    assert _indices(sort_samples(TABLE, "length", descending=False)) == [0, 2, 1]
    assert _indices(sort_samples(TABLE, "reward")) == [0, 2, 1]
    assert _indices(sort_samples(TABLE[::-1], "original")) == [0, 1, 2]
    assert _indices(filter_samples(TABLE, "eos")) == [0]


def test_sort_ties_keep_batch_order_and_nan_reward_goes_last() -> None:
    samples = [_sample(0, 8, "eos", math.nan), _sample(1, 8, "eos", 0.5), _sample(2, 9, "eos", 0.5)]
    assert _indices(sort_samples(samples[::-1], "length")) == [2, 0, 1]
    assert _indices(sort_samples(samples, "reward")) == [1, 2, 0]
    assert _indices(sort_samples(samples, "reward", descending=False)) == [1, 2, 0]
    with pytest.raises(ValueError, match="unknown sort key"):
        sort_samples(samples, "size")  # type: ignore[arg-type]


def test_filter_cycle_and_view(run_dir: Path) -> None:
    cycle, current = [], None
    for _ in range(len(FINISH_FILTERS)):
        current = next_filter(current)
        cycle.append(current)
    assert cycle == ["eos", "stop", "length", "context", None]
    assert next_filter("abort") is None  # an unknown filter resets to all
    first = load_run(run_dir)[0]
    assert filter_samples(first.samples, None) == list(first.samples)
    assert _indices(view_samples(first, "reward", True, "eos")) == [0]
    assert _indices(view_samples(first, "length", True, None)) == [1, 3, 2, 0]


# ------------------------------------------------------------------ the app, through Textual's pilot


def test_app_opens_sorts_and_filters(run_dir: Path) -> None:
    async def drive() -> None:
        app = RolloutViewer(load_run(run_dir), run_dir)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            assert app.current_step.step == 1
            assert app.shown_indices() == [0, 1, 2, 3]
            status = str(app.query_one("#status").render())
            assert "1 malformed line(s) skipped" in status
            steps = app.query_one("#steps")
            assert steps.get_row_at(0)[-1] == "1"  # the step list shows the skipped-line count

            await pilot.press("l")  # longest first; ties keep batch order
            assert app.shown_indices() == [1, 3, 2, 0]
            await pilot.press("l")  # again: shortest first
            assert app.shown_indices() == [0, 2, 1, 3]
            await pilot.press("r")
            assert app.shown_indices() == [0, 2, 1, 3]
            await pilot.press("o")
            assert app.shown_indices() == [0, 1, 2, 3]

            await pilot.press("f")  # eos
            assert app.shown_indices() == [0]
            await pilot.press("f")  # stop
            assert app.shown_indices() == [2]
            await pilot.press("f")  # length
            assert app.shown_indices() == [1]
            await pilot.press("f")  # context
            assert app.shown_indices() == [3]
            detail = str(app.query_one("#detail").render())
            assert "What is 3 + [1]?" in detail and "prompt truncated" in detail
            await pilot.press("f")  # all
            assert app.shown_indices() == [0, 1, 2, 3]

            steps.focus()  # open step 2: the sort carries over
            await pilot.press("r", "down")
            await pilot.pause()
            assert app.current_step.step == 2
            assert app.shown_indices() == [1, 2, 0]
            await pilot.press("f")
            assert app.shown_indices() == [1, 0]
            await pilot.press("f")  # no "stop" sample in step 2
            assert app.shown_indices() == []
            assert "no sample of step 2 finished with 'stop'" in str(app.query_one("#detail").render())

            await pilot.press("enter")  # back to the samples table
            assert app.focused is app.query_one("#samples")
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(drive())


def test_app_detail_follows_the_cursor_and_starts_at_step(run_dir: Path) -> None:
    async def drive() -> None:
        app = RolloutViewer(load_run(run_dir), run_dir, initial_step=2)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            assert app.current_step.step == 2 and app.shown_indices() == [0, 1, 2]
            await pilot.press("down")
            await pilot.pause()
            detail = str(app.query_one("#detail").render())
            assert "step 2 · sample 1" in detail and "answer 1" in detail and "ground truth '2'" in detail

    asyncio.run(drive())


def test_app_rejects_unknown_step(run_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--step 7 has no dump.*steps with dumps: 1-2"):
        RolloutViewer(load_run(run_dir), run_dir, initial_step=7)


# ------------------------------------------------------------------ the command


def test_cli_missing_rollouts_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(tmp_path)]) == 2
    assert "train.dump_rollouts=true" in capsys.readouterr().err


def test_cli_unknown_step_and_stray_argument_exit_2(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(run_dir), "--step", "9"]) == 2
    assert "--step 9 has no dump" in capsys.readouterr().err
    assert main(["view", str(run_dir), "a.b=1"]) == 2
    assert "unexpected argument" in capsys.readouterr().err


def test_cli_without_a_terminal_refuses_instead_of_spinning(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(run_dir)]) == 2  # pytest captures stdin/stdout: not a terminal
    assert "needs an interactive terminal" in capsys.readouterr().err


def test_a_multi_turn_sample_shows_each_turn_with_its_role_and_loss_membership() -> None:
    from packrl.diagnostics.viewer import describe_sample

    turns = [{"role": "assistant", "text": "<tool_call>{...}</tool_call>", "tokens": 9, "in_loss": True},
             {"role": "tool", "text": "<|im_start|>tool\n408<|im_end|>", "tokens": 6, "in_loss": False},
             {"role": "assistant", "text": "#### 408", "tokens": 4, "in_loss": True}]
    sample = parse_sample({**_row(1, 0, 19, "eos", 1.0), "turns": turns, "ended_by": "answer"})
    assert sample.turns[1] == ("tool", "<|im_start|>tool\n408<|im_end|>", 6, False) and sample.ended_by == "answer"
    text = describe_sample(1, sample).plain
    assert "ended by answer" in text and "[tool · 6 tokens · not in the loss]" in text
    assert text.index("[assistant · 9 tokens · in the loss]") < text.index("[tool") < text.index("#### 408")
    with pytest.raises(ValueError, match="turns should be a list"):
        parse_sample({**_row(1, 0, 19, "eos", 1.0), "turns": [{"role": "tool"}]})

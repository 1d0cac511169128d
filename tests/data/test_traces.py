"""Chat traces for `packrl sft`: rendered token for token as a multi-turn rollout builds them,
tool messages out of the loss, every row accounted for, and the built-in calculator traces."""

from __future__ import annotations

import json

import pytest

from packrl.chat.render import ToolRenderer
from packrl.cli.main import main
from packrl.config import ConfigError, load_config
from packrl.data.dataset import PromptDataset
from packrl.data.tool_traces import tool_trace_rows
from packrl.data.traces import render_traces
from packrl.rollout.tools import parse_tool_calls, run_tool
from packrl.trainer.sft import sft_traces, trace_options

TRACE = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 * 34?"},
         {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'},
         {"role": "tool", "content": "408"}, {"role": "assistant", "content": "#### 408"}]


def _cfg(*more):
    return load_config("arithmetic_tool", ["sft.num_rows=16", *more])


def _render(rows, tokenizer, *more):
    return render_traces(rows, tokenizer, trace_options(_cfg(*more)))


def test_a_trace_is_the_prompt_then_the_rollout_segments(smollm_tokenizer):
    traces = _render([{"messages": TRACE}], smollm_tokenizer)
    prompt = smollm_tokenizer.apply_chat_template(TRACE[:2], add_generation_prompt=True, tokenize=False)
    assert list(traces.prompt_ids[0]) == smollm_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    renderer = ToolRenderer(smollm_tokenizer, "tool")
    call = smollm_tokenizer(TRACE[2]["content"], add_special_tokens=False)["input_ids"] + list(renderer.close)
    answer = renderer.after_close(["408"])
    final = smollm_tokenizer("#### 408", add_special_tokens=False)["input_ids"] + list(renderer.close)
    assert list(traces.response_ids[0]) == call + answer + final
    assert list(traces.response_masks[0]) == [True] * len(call) + [False] * len(answer) + [True] * len(final)
    # the whole sequence is the conversation as the chat template renders it
    whole = smollm_tokenizer.decode([*traces.prompt_ids[0], *traces.response_ids[0]])
    assert whole.startswith(smollm_tokenizer.apply_chat_template(TRACE, tokenize=False).rstrip("\n"))


@pytest.mark.parametrize(("messages", "reason"), [
    (None, "'messages' is not a non-empty list"),
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "message 0 is not an object"),
    ([{"role": "assistant", "content": "x"}], "must be system/user messages ending with a user message"),
    ([*TRACE[:3], {"role": "user", "content": "more"}, TRACE[4]], "a 'user' message after the first assistant turn"),
    (TRACE[:4], "ends with a tool message"),
    ([*TRACE[:3], TRACE[4]], "two assistant turns in a row"),
])
def test_bad_traces_are_rejected_with_the_reason(smollm_tokenizer, messages, reason):
    traces = _render([{"messages": TRACE}, {"messages": messages}, "not a row"], smollm_tokenizer)
    assert len(traces) == 1 and traces.rows == (0,)
    outcomes = traces.accounting.outcomes
    assert [o.status for o in outcomes] == ["kept", "rejected", "rejected"]
    assert reason in outcomes[1].reason and outcomes[2].reason == "no 'messages' list"


def test_traces_over_a_budget_are_filtered_never_cut(smollm_tokenizer):
    long_answer = [*TRACE[:4], {"role": "assistant", "content": "so " * 300 + "#### 408"}]
    traces = _render([{"messages": TRACE}, {"messages": long_answer}], smollm_tokenizer)
    assert traces.rows == (0,)  # the budgets default to RL's: data.max_prompt_tokens=192, rollout.max_response_tokens=256
    assert traces.accounting.outcomes[1].status == "filtered" and "sft.max_response_tokens=256" in traces.accounting.outcomes[1].reason
    short = _render([{"messages": TRACE}], smollm_tokenizer, "data.max_prompt_tokens=8")
    assert not len(short) and "> sft.max_prompt_tokens=8" in short.accounting.outcomes[0].reason
    with pytest.raises(ValueError, match=r"no trace can be trained: .*; raise sft.max_prompt_tokens / sft.max_response_tokens "
                       r"for the filtered ones \(their sum at most the model context\)$"):
        sft_traces(_cfg("data.max_prompt_tokens=8", "sft.train_files=[task:tool_traces]"), smollm_tokenizer)


def test_the_trace_budgets_are_their_own_keys(smollm_tokenizer):
    """sft.max_prompt_tokens / sft.max_response_tokens bound the traces whatever the RL budgets are."""
    full = _render([{"messages": TRACE}], smollm_tokenizer)
    prompt, rest = len(full.prompt_ids[0]), len(full.response_ids[0])
    tight = _render([{"messages": TRACE}], smollm_tokenizer, f"sft.max_response_tokens={rest - 1}")
    assert not len(tight) and f"{rest} tokens after the prompt > sft.max_response_tokens={rest - 1}" in tight.accounting.outcomes[0].reason
    exact = _render([{"messages": TRACE}], smollm_tokenizer, f"sft.max_response_tokens={rest}", f"sft.max_prompt_tokens={prompt}",
                    f"data.max_prompt_tokens={prompt - 1}", f"rollout.max_response_tokens={rest - 1}",
                    f"rollout.multi_turn.max_tokens_per_turn={rest - 1}")
    assert exact.response_ids == full.response_ids and exact.prompt_ids == full.prompt_ids  # the RL budgets do not apply
    short = _render([{"messages": TRACE}], smollm_tokenizer, f"sft.max_prompt_tokens={prompt - 1}")
    assert f"{prompt} prompt tokens > sft.max_prompt_tokens={prompt - 1}" in short.accounting.outcomes[0].reason
    with pytest.raises(ConfigError, match=r"sft.max_response_tokens=0: must be >= 1"):
        _cfg("sft.max_response_tokens=0")


def test_the_fingerprint_tells_edited_traces_apart(smollm_tokenizer):
    edited = [*TRACE[:4], {"role": "assistant", "content": "#### 409"}]
    a, b = _render([{"messages": TRACE}], smollm_tokenizer), _render([{"messages": TRACE}], smollm_tokenizer)
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    assert _render([{"messages": edited}], smollm_tokenizer).fingerprint() != a.fingerprint()
    assert _render([{"messages": TRACE}, {"messages": edited}], smollm_tokenizer).fingerprint() != \
        _render([{"messages": edited}, {"messages": TRACE}], smollm_tokenizer).fingerprint()  # the order counts


def test_calculator_traces_answer_right_in_the_rl_prompt_format(smollm_tokenizer):
    cfg = _cfg()
    rows = tool_trace_rows(cfg.data, cfg.sft.num_rows, cfg.train.seed)
    assert len(rows) == 16
    val = PromptDataset.build(["task:arithmetic"], smollm_tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    train = PromptDataset.build(["task:arithmetic"], smollm_tokenizer, cfg.data, seed=cfg.train.seed, split="train", key="data.train_files")
    traces = render_traces(rows, smollm_tokenizer, trace_options(cfg))
    val_prompts = {tuple(p.prompt_ids) for p in val.prompts}
    train_prompts = {tuple(p.prompt_ids) for p in train.prompts}
    for row, prompt in zip(rows, traces.prompt_ids):
        assert prompt in train_prompts and prompt not in val_prompts  # RL's own prompt ids, never a validation question
        messages = row["messages"]
        call = parse_tool_calls(messages[2]["content"], {"calculator"})
        assert len(call) == 1 and call[0].error is None
        assert run_tool(call[0]) == (messages[3]["content"], False)
        question = messages[1]["content"].split("?")[0].removeprefix("What is ")
        assert messages[4]["content"].endswith(f"#### {eval(question)}")  # noqa: S307 - digits and + * only


def test_tool_traces_command_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "traces.jsonl"
    assert main(["data", "tool-traces", "arithmetic_tool", "sft.num_rows=5", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(r["messages"][2]["role"] == "assistant" for r in rows)
    assert "packrl sft arithmetic_tool sft.num_rows=5" in capsys.readouterr().out


def test_tool_traces_refuses_a_folder_an_unwritable_path_and_more_rows_than_problems(tmp_path, capsys):
    assert main(["data", "tool-traces", "arithmetic_tool", "sft.num_rows=5", "--out", str(tmp_path)]) == 2
    assert "is a folder; give the jsonl file to write" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["data", "tool-traces", "arithmetic_tool", "sft.num_rows=5", "--out", str(tmp_path / "file" / "x.jsonl")]) == 2
    assert "cannot be written" in capsys.readouterr().err
    assert main(["data", "tool-traces", "arithmetic_tool", "data.arithmetic.digits=1", "data.arithmetic.operators=+",
                 "sft.num_rows=101", "--out", str(tmp_path / "t.jsonl")]) == 2
    assert "sft.num_rows=101 is more than the 100 distinct problems of data.arithmetic" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_the_sft_loss_is_refused_in_rl():
    with pytest.raises(ConfigError, match="is the supervised loss of packrl sft"):
        load_config("demo", ["algorithm.policy_loss=sft"])


def test_the_progress_bar_shows_the_sft_loss_not_rollout_fields(capsys):
    from packrl.diagnostics.loggers import ConsoleLogger

    bar = ConsoleLogger(total_steps=2)
    bar.log(1, {"sft/loss": 0.6116, "sft/num_tokens": 1234.0})
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.6116" in err and "tokens=1234" in err and "resp_len" not in err


def test_unreadable_lines_keep_their_reason_and_every_reason_is_counted(tmp_path, smollm_tokenizer):
    path = tmp_path / "traces.jsonl"
    bad = [[{"role": "user", "content": "hi"}], TRACE[:4], [*TRACE[:3], TRACE[4]], [{"role": "assistant", "content": "x"}],
           [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]]
    path.write_text("{not json\n" + "".join(json.dumps({"messages": m}) + "\n" for m in [TRACE, *bad]))
    traces = sft_traces(_cfg(f"sft.train_files=[{path}]"), smollm_tokenizer)
    assert traces.accounting.outcomes[0].reason.startswith("line 1: invalid JSON")
    summary = traces.accounting.summary()
    assert "6 rejected" in summary and "and 1 more reason(s)" in summary
    with pytest.raises(ValueError, match="or use task:char_count_traces, task:tool_traces"):
        sft_traces(_cfg(f"sft.train_files=[{tmp_path / 'nope.jsonl'}]"), smollm_tokenizer)


def test_the_accounting_names_each_rows_file_and_line(tmp_path, smollm_tokenizer):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [TRACE, TRACE[:4]]))
    traces = sft_traces(_cfg(f"sft.train_files=[task:tool_traces,{path}]", "sft.num_rows=3"), smollm_tokenizer)
    rows = traces.accounting_dict()["rows"]
    assert [(r["source"], r["source_row"], r["status"]) for r in rows] == [
        ("task:tool_traces", 0, "kept"), ("task:tool_traces", 1, "kept"), ("task:tool_traces", 2, "kept"),
        (str(path), 0, "kept"), (str(path), 1, "rejected")]


def test_a_batch_over_the_traces_is_warned_about():
    from packrl.trainer.sft import repeat_warning

    assert repeat_warning(4, 4) is None
    assert "sft.batch_size=8 > 4 trace(s)" in repeat_warning(8, 4) and "2.0 epochs" in repeat_warning(8, 4)

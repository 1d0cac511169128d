"""task:char_count: distinct seeded rows with right counts, validation apart from training, the
three trace styles (rendered as RL renders its prompts), the shortest correct response, the gsm8k
reward on its answers and the config checks of its knobs."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from packrl.config import ConfigError, load_config
from packrl.config.schema import CharCountConfig, DataConfig, RewardConfig
from packrl.data import load_rows
from packrl.data.char_count import (
    CHAR_COUNT_SOURCE,
    STYLES,
    char_count_rows,
    guess_floor,
    parse_question,
    pseudo_word,
    shortest_correct_response,
    split_rows,
    worked_answer,
)
from packrl.data.char_count_traces import char_count_trace_rows
from packrl.data.dataset import PromptDataset
from packrl.data.examples import to_example
from packrl.reward import gsm8k_reward
from packrl.trainer.sft import sft_traces

_QUESTION = re.compile(r"How many ([a-z]) are in ((?:[a-z]-)*[a-z])\?")
_LINE = re.compile(r"([a-z]) - (yes|no) \((\d+)\)")


def _word_letter(row: dict) -> tuple[str, str]:
    """The word and letter of a row, read with this test's own pattern."""
    letter, dashed = _QUESTION.fullmatch(row["question"]).groups()
    return dashed.replace("-", ""), letter


def _check_lines(lines: list[str], word: str, letter: str) -> None:
    """One line per letter of ``word`` in order, each with the right yes/no and running count."""
    assert len(lines) == len(word)
    for k, (line, c) in enumerate(zip(lines, word)):
        got, verdict, running = _LINE.fullmatch(line).groups()
        assert got == c and verdict == ("yes" if c == letter else "no") and int(running) == word[: k + 1].count(letter), line


def test_rows_are_distinct_and_their_counts_right():
    cfg = CharCountConfig(min_letters=5, max_letters=20)
    rows = char_count_rows(1500, cfg, seed=3)
    assert len({r["question"] for r in rows}) == 1500
    counts = set()
    for row in rows:
        assert set(row) == {"question", "answer", "data_source", "reward_model"} and row["data_source"] == CHAR_COUNT_SOURCE
        assert row["reward_model"] == {"ground_truth": row["answer"]}
        word, letter = _word_letter(row)
        assert 5 <= len(word) <= 20 and word.isalpha() and word.islower()
        *lines, final = row["answer"].split("\n")
        assert final == f"#### {word.count(letter)}"
        _check_lines(lines, word, letter)
        counts.add(word.count(letter))
    assert counts == {0, 1, 2, 3}  # data.char_count.max_count=3
    assert {len(_word_letter(r)[0]) for r in rows} == set(range(5, 21))


def test_deterministic_for_a_seed_and_knobs_respected():
    cfg = CharCountConfig(min_letters=7, max_letters=9)
    assert char_count_rows(50, cfg, seed=1) == char_count_rows(50, cfg, seed=1) != char_count_rows(50, cfg, seed=2)
    assert {len(_word_letter(r)[0]) for r in char_count_rows(200, cfg, seed=1)} == {7, 8, 9}
    absent = char_count_rows(300, CharCountConfig(max_count=0), seed=0)
    assert all(w.count(c) == 0 for w, c in map(_word_letter, absent))
    assert {w.count(c) for w, c in map(_word_letter, char_count_rows(300, CharCountConfig(max_count=1), seed=0))} == {0, 1}
    assert len(pseudo_word(__import__("random").Random(0), 13)) == 13


def test_validation_uses_its_own_seed_and_no_training_question():
    cfg = CharCountConfig(num_rows=400)
    train = load_rows("task:char_count", data=DataConfig(char_count=cfg), seed=5, split="train")
    val = load_rows("task:char_count", data=DataConfig(char_count=cfg), seed=5, split="val")
    assert train == split_rows(cfg, 5, "train") == char_count_rows(400, cfg, 5)
    assert len(val) == 400 and len({r["question"] for r in val}) == 400
    assert not {r["question"] for r in train} & {r["question"] for r in val}


def test_the_counts_are_drawn_first_near_uniform_and_the_guess_floor_says_so():
    rows = char_count_rows(2000, CharCountConfig(min_letters=5, max_letters=12), seed=0)
    shares = Counter(int(r["answer"].rsplit("#### ", 1)[1]) for r in rows)
    assert set(shares) == {0, 1, 2, 3} and all(0.2 < n / len(rows) < 0.3 for n in shares.values())
    assert guess_floor(rows) == max(shares.values()) / len(rows) and guess_floor([]) == 0.0


def test_a_count_no_drawn_word_holds_is_placed_by_hand():
    rows = char_count_rows(40, CharCountConfig(min_letters=3, max_letters=3, max_count=3), seed=0)
    assert {w.count(c) for w, c in map(_word_letter, rows)} == {0, 1, 2, 3}
    for row in rows:
        word, letter = _word_letter(row)
        assert row["answer"] == worked_answer(word, letter)


def test_a_tiny_space_repeats_rows_and_says_so(caplog):
    cfg = CharCountConfig(min_letters=1, max_letters=1, max_count=1)  # 26 * 25 + 26 = 676 questions at most
    rows = char_count_rows(700, cfg, seed=0)
    assert len(rows) == 700 and len({r["question"] for r in rows}) <= 676
    assert "rows repeat" in caplog.text and "data.char_count.max_letters" in caplog.text
    assert "a constant guess of the count is right for" in caplog.text  # 26 of the 676 questions have count 1
    with pytest.raises(ValueError, match="drew no question outside the 6.. excluded"):
        char_count_rows(10, cfg, seed=1, exclude={r["question"] for r in rows})


@pytest.mark.parametrize("style", STYLES)
def test_every_style_is_correct_and_ends_in_the_count(style):
    for row in char_count_rows(200, CharCountConfig(), seed=11):
        word, letter = _word_letter(row)
        text = worked_answer(word, letter, style)
        assert text.endswith(f"\n#### {word.count(letter)}")
        lines = text.split("\n")
        if style == "concise":
            assert text == row["answer"]
            _check_lines(lines[:-1], word, letter)
        elif style == "thinking":
            assert lines[0] == "<think>" and lines[-2] == "</think>"
            _check_lines(lines[1:-2], word, letter)
        else:  # every concise line is there, in order, each restated right after it with the same count
            steps = [k for k, line in enumerate(lines) if _LINE.fullmatch(line)]
            _check_lines([lines[k] for k in steps], word, letter)
            for k in steps:
                c, verdict, running = _LINE.fullmatch(lines[k]).groups()
                said = f"{c} is {letter}; now {running}." if verdict == "yes" else f"{c} is not {letter}; still {running}."
                assert lines[k + 1] == said
        assert worked_answer(word, letter, style) == text  # deterministic per row


def test_verbose_is_longer_than_concise_for_every_row(smollm_tokenizer):
    def length(text):
        return len(smollm_tokenizer(text, add_special_tokens=False)["input_ids"])

    ratios = []
    for row in char_count_rows(300, CharCountConfig(), seed=2):
        word, letter = _word_letter(row)
        concise, verbose, thinking = (length(worked_answer(word, letter, s)) for s in ("concise", "verbose", "thinking"))
        assert verbose > 2 * concise and thinking > concise
        ratios.append(verbose / concise)
    assert 2.5 < sum(ratios) / len(ratios) < 3.2


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="sft.trace_style='terse' is not one of concise, verbose, thinking"):
        worked_answer("abc", "a", "terse")


def test_shortest_correct_response_is_the_concise_answer(smollm_tokenizer):
    row = char_count_rows(1, CharCountConfig(), seed=4)[0]
    word, letter = _word_letter(row)
    message = f"{row['question']} Check each letter, then give the count after \"####\"."
    text, num_tokens = shortest_correct_response(message, smollm_tokenizer)
    assert text == row["answer"] and parse_question(message) == (word, letter)
    assert num_tokens == len(smollm_tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # + the EOS a finished response ends with
    assert shortest_correct_response("How many r are in s-t-r-a-w-b-e-r-r-y?", smollm_tokenizer)[0].endswith("y - no (3)\n#### 3")
    with pytest.raises(ValueError, match="no task:char_count question"):
        shortest_correct_response("What is 2 + 3?", smollm_tokenizer)


@pytest.mark.parametrize("extraction", ["strict", "flexible"])
def test_the_gsm8k_reward_scores_right_answers_1_and_wrong_counts_0(extraction):
    cfg = RewardConfig(extraction=extraction)
    for row in char_count_rows(100, CharCountConfig(), seed=6):
        word, letter = _word_letter(row)
        example = to_example(row, row=0, instruction="", system_prompt=None)
        assert example.ground_truth == row["answer"] and example.data_source == CHAR_COUNT_SOURCE  # the reference worked answer
        for style in STYLES:
            text = worked_answer(word, letter, style)
            assert gsm8k_reward(text, example.ground_truth, data_source=CHAR_COUNT_SOURCE, cfg=cfg) == 1.0
            wrong = text.rsplit("#### ", 1)[0] + f"#### {word.count(letter) + 1}"
            assert gsm8k_reward(wrong, example.ground_truth, data_source=CHAR_COUNT_SOURCE, cfg=cfg) == 0.0


@pytest.mark.parametrize("style", STYLES)
def test_traces_render_as_rl_prompts_and_end_in_the_count(smollm_tokenizer, style):
    cfg = load_config("char_count", ["sft.num_rows=24", f"sft.trace_style={style}", "sft.redundancy=1"])
    traces = sft_traces(cfg, smollm_tokenizer)
    assert len(traces) == 24 and traces.accounting.num_rejected == traces.accounting.num_filtered == 0
    build = dict(tokenizer=smollm_tokenizer, data_cfg=cfg.data, seed=cfg.train.seed)
    train = PromptDataset.build(["task:char_count"], split="train", key="data.train_files", **build)
    val = PromptDataset.build(["task:char_count"], split="val", key="data.val_files", **build)
    train_prompts, val_prompts = {tuple(p.prompt_ids) for p in train.prompts}, {tuple(p.prompt_ids) for p in val.prompts}
    rows = char_count_trace_rows(cfg.data, cfg.sft, cfg.train.seed)
    for row, prompt, response, mask in zip(rows, traces.prompt_ids, traces.response_ids, traces.response_masks):
        assert prompt in train_prompts and prompt not in val_prompts  # RL's own prompt ids, never a validation question
        word, letter = _word_letter({"question": row["messages"][-2]["content"].split("?")[0] + "?"})
        text = smollm_tokenizer.decode(list(response))
        assert text == worked_answer(word, letter, style) + "<|im_end|>" and text.endswith(f"#### {word.count(letter)}<|im_end|>")
        assert all(mask)  # one assistant turn: every token after the prompt is the policy's
        whole = smollm_tokenizer.decode([*prompt, *response])
        assert whole.startswith(smollm_tokenizer.apply_chat_template(row["messages"], tokenize=False).rstrip("\n"))


def test_redundancy_drops_redundant_lines_only_and_reproducibly():
    from packrl.reward.char_count import reads_right

    cfg = load_config("char_count", ["sft.num_rows=100", "sft.redundancy=0.85"])
    rows = char_count_trace_rows(cfg.data, cfg.sft, cfg.train.seed)
    kept = total = 0
    for row in rows:
        word, letter = _word_letter({"question": row["messages"][-2]["content"].split("?")[0] + "?"})
        answer, full = row["messages"][-1]["content"].split("\n"), worked_answer(word, letter, "verbose").split("\n")
        position = iter(full)
        assert all(line in position for line in answer)  # the full verbose answer's lines, in order
        concise = worked_answer(word, letter, "concise").split("\n")
        assert [line for line in answer if line in concise] == concise  # every worked line and the final count
        assert reads_right("\n".join(answer), worked_answer(word, letter, "concise"), "strict")
        kept, total = kept + len(answer) - len(concise), total + len(full) - len(concise)
    assert 0.8 < kept / total < 0.9  # about 1,000 redundant lines, each kept with 0.85
    assert rows == char_count_trace_rows(cfg.data, cfg.sft, cfg.train.seed)  # the same traces every time
    plain = char_count_trace_rows(cfg.data, load_config("char_count", ["sft.num_rows=100", "sft.redundancy=1"]).sft, cfg.train.seed)
    assert [r["messages"][:-1] for r in plain] == [r["messages"][:-1] for r in rows]  # the same questions


def test_the_preset_fits_the_longest_verbose_answer(smollm_tokenizer):
    from packrl.data.char_count import _FILLERS

    def length(text):
        return len(smollm_tokenizer(text, add_special_tokens=False)["input_ids"])

    cfg = load_config("char_count", ["sft.num_rows=512"])
    traces = sft_traces(cfg, smollm_tokenizer)
    assert len(traces) == 512 and max(map(len, traces.response_ids)) <= cfg.rollout.max_response_tokens
    # the worst case: 12 letters, the longest filler after every 4th letter, each letter's line as long as it gets
    worst = 1 + 3 * max(length(f + "\n") for f in _FILLERS) + max(
        length("\n".join(line for line in worked_answer(word, "a", "verbose").split("\n") if line not in _FILLERS))
        for word in ("aaabbbbbbbbb", "bbbbbbbbbaaa", "abababbbbbbb"))
    assert worst + 16 <= cfg.rollout.max_response_tokens, worst


@pytest.mark.parametrize(("overrides", "key", "message"), [
    (["data.char_count.max_letters=4"], "data.char_count.max_letters", "is below data.char_count.min_letters=5"),
    (["data.char_count.min_letters=0"], "data.char_count.min_letters", "must be"),
    (["data.char_count.max_count=-1"], "data.char_count.max_count", "must be an integer >= 0"),
    (["data.char_count.max_count=13"], "data.char_count.max_count", "is above data.char_count.max_letters=12"),
    (["sft.train_files=[task:tool_traces]"], "sft.trace_style", "has no effect"),
    (["sft.trace_style=terse"], "sft.trace_style", "terse"),
    (["sft.redundancy=1.5"], "sft.redundancy", "must be in [0, 1]"),
    (["sft.trace_style=concise"], "sft.redundancy", "has no effect"),
])
def test_bad_knobs_are_refused_with_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        load_config("char_count", overrides)
    assert key in str(err.value) and message in str(err.value)


def test_the_audit_cache_key_follows_the_knobs():
    from packrl.inspect.audit import cache_key

    def key(*overrides):
        return cache_key(["task:char_count"], "tok", load_config("char_count", list(overrides)))

    assert key() == key() != key("data.char_count.max_letters=11") != key("data.char_count.max_count=2")

"""PromptDataset and PromptSampler: every row accounted for, bad rows named or counted, the
prompt policy applied once, and a sampler that resumes exactly."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packrl.config.schema import ArithmeticConfig, DataConfig
from packrl.data import DatasetPrompt, Example, PromptDataset, PromptSampler
from packrl.seqlen.prompt_policy import PromptAccounting, RowOutcome

LONG_QUESTION = "Tom has " + "many apples and " * 60 + "one pear. How many fruits?"


def _write_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _gsm8k(question: str, answer: str = "so\n#### 4") -> bytes:
    return json.dumps({"question": question, "answer": answer}).encode()


@pytest.fixture
def two_files(tmp_path):
    """Row 0-4 in a.jsonl (rows 1, 2, 3 bad; row 4 overlong), rows 5-7 in b.jsonl (row 6 bad)."""
    a = _write_jsonl(tmp_path / "a.jsonl", [
        _gsm8k("What is 2 + 2?"),
        _gsm8k("What is 3 + 3?", "#### six"),
        b'{"question": "caf\xe9?", "answer": "#### 1"}',
        b'"just a string"',
        _gsm8k(LONG_QUESTION),
    ])
    b = _write_jsonl(tmp_path / "b.jsonl", [
        _gsm8k("What is 1 + 1?", "#### 2"),
        json.dumps({"question": ["not", "text"], "answer": "#### 1"}).encode(),
        _gsm8k("What is 5 + 5?", "#### 10"),
    ])
    return [a, b]


def _build(sources, tok, split="train", room=None, **cfg):
    cfg = {"batch_size": 1, "max_prompt_tokens": 96} | cfg
    key = "data.train_files" if split == "train" else "data.val_files"
    return PromptDataset.build(sources, tok, DataConfig(**cfg), seed=0, split=split, key=key, room=room)


def test_bad_rows_stop_the_build_with_row_numbers(smollm_tokenizer, two_files):
    with pytest.raises(ValueError) as err:
        _build(two_files, smollm_tokenizer)
    msg = str(err.value)
    assert msg.startswith("data.train_files: 4 bad row(s) of 8 (rows count from 0, jsonl lines from 1): row 1 (")
    assert "row 1 (" in msg and "a.jsonl line 2): non-numeric answer: 'six'" in msg
    assert "row 2 (" in msg and "line 3: invalid UTF-8" in msg
    assert "row 3 (" in msg and "row is of type str, not an object" in msg
    assert "row 6 (" in msg and "b.jsonl line 2): field 'question' is of type list, expected a string" in msg
    assert msg.endswith("set data.skip_bad_rows=true to skip and count them")


def test_more_than_ten_bad_rows_are_summarised(smollm_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [b"{oops"] * 12 + [_gsm8k("What is 2 + 2?")])
    with pytest.raises(ValueError, match=r"12 bad row\(s\) of 13 \(rows count from 0, jsonl lines from 1\): "
                                         r"row 0 .* row 9 \([^)]*\): line 10: invalid JSON [^;]*; and 2 more"):
        _build([path], smollm_tokenizer)


def test_skipped_bad_rows_and_filtered_prompts_are_all_counted(smollm_tokenizer, two_files, caplog):
    with caplog.at_level(logging.INFO, logger="packrl.data"):
        ds = _build(two_files, smollm_tokenizer, skip_bad_rows=True)
    acc = ds.accounting
    assert acc.num_rows == 8
    assert acc.num_kept + acc.num_truncated + acc.num_filtered + acc.num_rejected == 8
    assert (acc.num_kept, acc.num_filtered, acc.num_rejected) == (3, 1, 4)
    assert [o.row for o in acc.outcomes] == list(range(8))
    assert {o.row for o in acc.outcomes if o.status == "rejected"} == {1, 2, 3, 6}
    assert acc.outcomes[4].status == "filtered" and acc.outcomes[4].num_tokens > 96
    assert acc.outcomes[1].reason == "non-numeric answer: 'six'"
    assert len(ds) == 3
    batch = ds.batch(range(3))
    assert batch.rows == (0, 5, 7)  # global rows across the two files
    assert batch.ground_truths == ("4", "2", "10")
    assert batch.data_sources == ("openai/gsm8k",) * 3
    assert all(len(ids) <= 96 for ids in batch.prompt_ids)
    assert "data.train_files: 8 rows: 3 kept, 0 truncated (0 tokens removed), 1 filtered, 4 rejected" in caplog.text


def test_truncating_policy_shortens_instead_of_filtering(smollm_tokenizer, two_files):
    ds = _build(two_files, smollm_tokenizer, skip_bad_rows=True, overlong_prompt="left")
    assert (ds.accounting.num_truncated, ds.accounting.num_filtered) == (1, 0)
    batch = ds.batch(range(len(ds)))
    assert batch.rows == (0, 4, 5, 7)
    assert batch.prompt_truncated == (False, True, False, False)
    assert len(batch.prompt_ids[1]) <= 96


def test_prompts_are_the_rendered_chat(smollm_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "one.jsonl", [_gsm8k("What is 2 + 2?")])
    ds = _build([path], smollm_tokenizer, system_prompt="Be brief.", instruction="Say ####.")
    expected = smollm_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? Say ####."}],
        add_generation_prompt=True, tokenize=True,
    )["input_ids"]
    assert list(ds.prompts[0].prompt_ids) == expected


def test_verl_parquet_prompt_is_used_unchanged(smollm_tokenizer, tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = _build([str(path)], smollm_tokenizer, instruction="NOT APPENDED")
    assert len(ds) == 3 and ds.accounting.num_kept == 3
    text = smollm_tokenizer.decode(ds.prompts[2].prompt_ids)
    assert "<|im_start|>user\nWhat is 2 + 1? Let's think step by step.<|im_end|>" in text
    assert "NOT APPENDED" not in text
    assert ds.prompts[2].example.extra_info == {"split": "train", "index": 2}
    assert ds.batch([2]).ground_truths == ("3",)


def test_task_rows_carry_their_data_source(smollm_tokenizer):
    arith = ArithmeticConfig(num_rows=20, digits=2)
    ds = _build(["task:arithmetic"], smollm_tokenizer, arithmetic=arith, batch_size=4)
    assert len(ds) == 20 and set(ds.batch(range(20)).data_sources) == {"packrl/arithmetic"}


def test_too_few_prompts_for_a_batch(smollm_tokenizer, two_files):
    match = r"data.train_files: 3 usable prompt\(s\) < data.batch_size=4 \(8 rows: 3 kept.*lower data.batch_size"
    with pytest.raises(ValueError, match=match):
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, batch_size=4)


def test_no_usable_prompt(smollm_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [_gsm8k(LONG_QUESTION)])
    with pytest.raises(ValueError, match=r"data.val_files: no usable prompt \(1 rows: 0 kept.*1 filtered"):
        _build([path], smollm_tokenizer, split="val")


def test_max_val_rows_reads_only_the_first_rows(smollm_tokenizer):
    arith = ArithmeticConfig(num_rows=30, digits=2)
    ds = _build(["task:arithmetic"], smollm_tokenizer, split="val", arithmetic=arith, max_val_rows=7, batch_size=64)
    assert len(ds) == 7 and ds.accounting.num_rows == 7
    assert [b.rows for b in ds.iter_batches(3)] == [(0, 1, 2), (3, 4, 5), (6,)]


# -- sampler: built on a hand-made dataset, no tokenizer needed ------------------------------------


def _dataset(n: int) -> PromptDataset:
    prompts = [
        DatasetPrompt(Example([{"role": "user", "content": str(i)}], str(i), "s", row=i), (i,), False) for i in range(n)
    ]
    return PromptDataset(prompts, PromptAccounting(tuple(RowOutcome(i, "kept") for i in range(n))))


def _rows(sampler: PromptSampler, k: int) -> list[tuple[int, ...]]:
    return [sampler.next_batch().rows for _ in range(k)]


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    ds = _dataset(10)
    a, b = _rows(PromptSampler(ds, 3, True, seed=1), 9), _rows(PromptSampler(ds, 3, True, seed=1), 9)
    assert a == b
    assert a != _rows(PromptSampler(ds, 3, True, seed=2), 9)
    epochs = [a[0:3], a[3:6], a[6:9]]  # 10 prompts, batch 3: three batches per epoch, one prompt dropped
    for epoch in epochs:
        flat = [r for batch in epoch for r in batch]
        assert len(set(flat)) == 9
    assert epochs[0] != epochs[1]


def test_sampler_without_shuffle_goes_in_order_and_warns_about_the_tail(caplog):
    with caplog.at_level(logging.WARNING, logger="packrl.data"):
        sampler = PromptSampler(_dataset(5), 2, False, seed=0)
    assert "1 prompt(s) at the end" in caplog.text and "data.shuffle=true" in caplog.text
    assert _rows(sampler, 4) == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_sampler_resumes_exactly_from_its_state():
    ds = _dataset(11)
    reference = PromptSampler(ds, 4, True, seed=3)
    _rows(reference, 5)  # into the third epoch
    state = reference.state_dict()
    assert state == {"epoch": 2, "index": 4, "seed": 3, "num_prompts": 11, "fingerprint": ds.fingerprint()}
    resumed = PromptSampler(ds, 4, True, seed=99)
    resumed.load_state_dict(dict(state))
    assert _rows(resumed, 7) == _rows(reference, 7)


def test_sampler_state_from_other_data_is_refused():
    sampler = PromptSampler(_dataset(6), 2, True, seed=0)
    with pytest.raises(ValueError, match="sampler state is for 9 prompts but data.train_files now gives 6"):
        sampler.load_state_dict({"epoch": 0, "index": 2, "seed": 0, "num_prompts": 9})
    # as many prompts, other prompts: the fingerprint tells
    other = PromptDataset([DatasetPrompt(Example([{"role": "user", "content": "x"}], "7", "s", row=i), (i + 100,), False)
                           for i in range(6)], PromptAccounting(tuple(RowOutcome(i, "kept") for i in range(6))))
    state = PromptSampler(other, 2, True, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"the prompts of data.train_files differ from the checkpoint's \(6 prompts"):
        sampler.load_state_dict(state)
    sampler.load_state_dict({k: v for k, v in state.items() if k != "fingerprint"})  # a state saved before fingerprints


def test_sampler_needs_a_full_batch():
    with pytest.raises(ValueError, match=r"2 usable prompt\(s\) < data.batch_size=3"):
        PromptSampler(_dataset(2), 3, True, seed=0)


def test_iter_batches_visits_every_prompt_once_in_order():
    ds = _dataset(7)
    assert [b.rows for b in ds.iter_batches(3)] == [(0, 1, 2), (3, 4, 5), (6,)]
    with pytest.raises(ValueError, match="batch_size=0"):
        next(ds.iter_batches(0))


def test_overlong_error_names_rows_by_their_number_in_the_data(smollm_tokenizer, two_files):
    # Rows 1-3 and 6 are bad and skipped; the overlong row is row 4 of the data, index 1 of the
    # rows the policy sees.
    with pytest.raises(ValueError, match=r"1 prompt\(s\) exceed data.max_prompt_tokens=96: row 4 \("):
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, overlong_prompt="error")


def test_a_row_with_a_key_twice_is_named_or_counted_like_other_bad_rows(smollm_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "dup.jsonl", [_gsm8k("What is 2 + 2?"),
                                                 b'{"question": "What is 1 + 1?", "answer": "#### 2", "answer": "#### 3"}'])
    with pytest.raises(ValueError) as err:
        _build([path], smollm_tokenizer)
    assert str(err.value) == (
        f"data.train_files: 1 bad row(s) of 2 (rows count from 0, jsonl lines from 1): row 1 ({path} line 2): line 2: key "
        "'answer' appears twice in one object (\"#### 2\", then \"#### 3\"); JSON keys must be unique, and which value the "
        "row meant is unknown: keep one. Fix the rows, or set data.skip_bad_rows=true to skip and count them")
    ds = _build([path], smollm_tokenizer, skip_bad_rows=True)
    assert (ds.accounting.num_kept, ds.accounting.num_rejected) == (1, 1) and len(ds) == 1


def test_overlong_fixes_propose_only_prompt_budgets_the_model_context_holds(smollm_tokenizer, two_files):
    """The long row needs N > 200 tokens; a 200-token context with 100-token responses leaves 100."""
    import re

    from packrl.config.budgets import PromptRoom

    with pytest.raises(ValueError) as roomy:
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, overlong_prompt="error", room=PromptRoom(100_000, 200))
    needed = int(re.search(r"row 4 \([^)]*\): (\d+) tokens", str(roomy.value)).group(1))
    assert needed > 200
    assert str(roomy.value).endswith(f"Set data.overlong_prompt to filter, left, right or middle, or raise data.max_prompt_tokens "
                                     f"to >= {needed:,} (the model context 100,000 - rollout.max_response_tokens=200 leaves "
                                     "99,800)")
    with pytest.raises(ValueError) as tight:
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, overlong_prompt="error", room=PromptRoom(200, 100))
    assert str(tight.value).endswith(
        f"Set data.overlong_prompt to filter, left, right or middle; no data.max_prompt_tokens fits a {needed:,}-token "
        "prompt (the model context 200 - rollout.max_response_tokens=100 leaves 100): set data.max_prompt_tokens <= 100 "
        "with data.overlong_prompt=filter (drop the longer prompts) or left/right/middle (cut them to the budget), or "
        f"use a model whose context holds {needed + 100:,} tokens")
    with pytest.raises(ValueError) as few:  # 3 usable of 4 wanted: raising the budget cannot keep the filtered row
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, batch_size=4, room=PromptRoom(200, 100))
    assert str(few.value).endswith(
        "add rows or lower data.batch_size, or no data.max_prompt_tokens the model context holds keeps the 1 filtered rows "
        f"(the shortest has {needed:,} tokens; the model context 200 - rollout.max_response_tokens=100 leaves 100): set "
        "data.overlong_prompt=left, right or middle to cut them to the budget, or use a model with a longer context")
    with pytest.raises(ValueError) as roomy_few:
        _build(two_files, smollm_tokenizer, skip_bad_rows=True, batch_size=4, room=PromptRoom(100_000, 200))
    assert str(roomy_few.value).endswith("or raise data.max_prompt_tokens up to 99,800 (the model context 100,000 - "
                                         "rollout.max_response_tokens=200 leaves 99,800) (it filtered 1 rows) or set "
                                         "data.overlong_prompt=left")

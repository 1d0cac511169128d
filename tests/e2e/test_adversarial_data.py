"""An adversarial data file trains under every truncating or filtering policy, fails before training
under ``error`` naming the rows, and RUN_DIR/data_accounting.json has the expected outcome of every row."""

from __future__ import annotations

import json

import pytest

from packrl.config import load_config
from packrl.data.examples import to_example
from packrl.data.prompts import budget_examples
from tests.conftest import SMOLLM_DIR
from tests.diagnostics.tiny_run import tiny_run

BUDGET = 96  # data.max_prompt_tokens of these runs
INSTRUCTION = load_config("demo", []).data.instruction


def _rendered_tokens(tok, question: str) -> int:
    """Prompt tokens of a GSM8K row with ``question`` as training renders it (template + instruction)."""
    example = to_example({"question": question, "answer": "#### 1"}, row=0, instruction=INSTRUCTION, system_prompt=None)
    _, outcomes = budget_examples([example], tok, max_prompt_tokens=10**6, policy="filter")
    return outcomes[0].num_tokens


def _question_of(tok, num_tokens: int) -> str:
    """A question whose rendered prompt is exactly ``num_tokens`` tokens."""
    for k in range(1, 4 * num_tokens):
        question = "Count the apples:" + " apple" * k
        if _rendered_tokens(tok, question) == num_tokens:
            return question
    raise AssertionError(f"no question renders to {num_tokens} tokens")


def _gsm8k(question, answer="#### 3") -> bytes:
    return json.dumps({"question": question, "answer": answer}).encode()


def _adversarial_rows(tok) -> list[tuple[bytes, dict[str, str]]]:
    """(jsonl line, expected status per policy) for every row; ``*`` is the status under every policy."""
    truncated = {"filter": "filtered", "left": "truncated", "right": "truncated", "middle": "truncated"}
    return [
        (_gsm8k("What is 1 + 2?"), {"*": "kept"}),
        (_gsm8k(""), {"*": "rejected"}),                                      # empty prompt
        (_gsm8k("   \n\t  "), {"*": "rejected"}),                             # whitespace only
        (_gsm8k("Add these up: " + "one plus one, " * (3 * BUDGET)), truncated),  # ~10x the budget
        (_gsm8k(_question_of(tok, BUDGET - 1)), {"*": "kept"}),
        (_gsm8k(_question_of(tok, BUDGET)), {"*": "kept"}),
        (_gsm8k(_question_of(tok, BUDGET + 1)), truncated),
        (b'{"question": "caf\xe9 au lait?", "answer": "#### 2"}', {"*": "rejected"}),  # invalid UTF-8
        (json.dumps({"question": "What is 2 + 2?"}).encode(), {"*": "rejected"}),      # missing answer
        (json.dumps({"question": 42, "answer": "#### 42"}).encode(), {"*": "rejected"}),  # wrong type
        (json.dumps({"question": "What is 2 + 5?", "answer": 7}).encode(), {"*": "rejected"}),  # wrong type
        (b"[1, 2, 3]", {"*": "rejected"}),                                    # not an object
        (b'{"question": "What is 1 + 1?", "answer": ', {"*": "rejected"}),  # cut-off JSON
        (json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": " "}],
                     "reward_model": {"ground_truth": "1"}}).encode(), {"*": "rejected"}),  # verl, blank message
        (_gsm8k("What is 4 + 4?", "#### 8"), {"*": "kept"}),
        (_gsm8k("What is 4 + 4?", "#### 8"), {"*": "kept"}),                 # duplicate of the row above
        (_gsm8k("What is 3 + 4?", "Think. " * 15_000 + "#### 7"), {"*": "kept"}),  # a 100 kB answer
        (_gsm8k("What is 5 + 1?", "#### 6"), {"*": "kept"}),
    ]


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory, smollm_tokenizer):
    tok = smollm_tokenizer
    tok.padding_side = "left"
    rows = _adversarial_rows(tok)
    assert len(rows[16][0]) > 100_000
    path = tmp_path_factory.mktemp("data") / "adversarial.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in rows) + b"\n\n")  # a trailing blank line is not a row
    return path, [expected for _, expected in rows]


@pytest.mark.parametrize("policy", ["filter", "left", "right", "middle"])
def test_adversarial_rows_train_and_are_each_accounted(tmp_path, smollm_tokenizer, adversarial, policy):
    path, expected = adversarial
    run_dir, _ = tiny_run(tmp_path, smollm_tokenizer, [
        f"data.train_files=[{path}]", f"data.max_prompt_tokens={BUDGET}", f"data.overlong_prompt={policy}",
        "data.skip_bad_rows=true", "train.total_steps=2", "train.save_every=0",
    ])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    accounting = json.loads((run_dir / "data_accounting.json").read_text())["train"]
    statuses = [row["status"] for row in accounting["rows"]]
    assert statuses == [e.get(policy, e.get("*")) for e in expected]
    totals = accounting["totals"]
    assert totals["num_rows"] == len(expected) == 18
    assert totals["num_kept"] + totals["num_truncated"] + totals["num_filtered"] + totals["num_rejected"] == 18
    rows = accounting["rows"]
    # cutting the centre token of row 6 (budget + 1, all "apple"s) gives exactly row 5's prompt
    duplicates = {15: 14} | ({6: 5} if policy == "middle" else {})
    assert {r["row"]: r["duplicate_of"] for r in rows if r["duplicate_of"] is not None} == duplicates
    assert totals["num_duplicates"] == len(duplicates)
    assert rows[1]["reason"] == rows[2]["reason"] == "empty question"
    assert "invalid UTF-8" in rows[7]["reason"] and rows[8]["reason"] == "missing field 'answer'"
    assert (rows[7]["source"], rows[7]["source_row"]) == (str(path), 7)
    assert [rows[i]["num_tokens"] for i in (4, 5, 6)] == [BUDGET - 1, BUDGET, BUDGET + 1]
    if policy != "filter":
        assert rows[3]["num_tokens"] > 9 * BUDGET and rows[3]["num_tokens_removed"] == rows[3]["num_tokens"] - BUDGET
        assert rows[6]["num_tokens_removed"] == 1
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert all(d["prompt_tokens"] <= BUDGET for d in dumped)


def test_error_policy_fails_before_training_naming_every_problem_row(tmp_path, smollm_tokenizer, adversarial):
    path, _ = adversarial
    with pytest.raises(ValueError) as err:
        tiny_run(tmp_path, smollm_tokenizer, [f"data.train_files=[{path}]", f"data.max_prompt_tokens={BUDGET}",
                                              "data.overlong_prompt=error", "train.total_steps=2"])
    message = str(err.value)
    assert message.startswith("data.train_files: 9 bad row(s) of 18 (rows count from 0, jsonl lines from 1): row 1 (")
    for row in (1, 2, 7, 8, 9, 10, 11, 12, 13):
        assert f"row {row} (" in message
    assert f"2 prompt(s) exceed data.max_prompt_tokens={BUDGET}: row 3 (" in message
    assert f"row 6 ({path} line 7): {BUDGET + 1} tokens" in message
    assert "data.skip_bad_rows=true" in message and "data.overlong_prompt to filter, left, right or middle" in message
    assert not list(tmp_path.rglob("metrics.jsonl")) and not list(tmp_path.rglob("checkpoints"))


def test_data_errors_come_before_the_model_loads(tmp_path, adversarial, smollm_tokenizer):
    """SMOLLM_DIR holds the tokenizer and config but no weights: the data error must come first."""
    from packrl.trainer.loop import train

    path, _ = adversarial
    cfg = load_config("demo", [f"train.out_dir={tmp_path}", f"model.path={SMOLLM_DIR}", f"data.train_files=[{path}]",
                               "data.val_files=[]", "data.overlong_prompt=error", f"data.max_prompt_tokens={BUDGET}"])
    with pytest.raises(ValueError, match=r"data.train_files: 9 bad row\(s\) of 18"):
        train(cfg)

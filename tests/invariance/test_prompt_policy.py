"""Invariant 6 (every row accounted for) and the template-aware prompt policy, on the real
SmolLM2 chat template: truncation keeps the system message and ends with the generation prompt."""

from __future__ import annotations

import pytest

from packrl.seqlen.prompt_policy import apply_prompt_policy

SYSTEM = "You are a careful math tutor. Answer with a number."
GENERATION_PROMPT = "<|im_start|>assistant\n"


def _render_len(tok, chat) -> int:
    return len(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])


def _chat_of_length(tok, target: int) -> list[dict]:
    """A system + user chat whose rendered prompt has exactly ``target`` tokens."""
    words = []
    for i in range(400):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(words)}]
        n = _render_len(tok, chat)
        if n == target:
            return chat
        assert n < target, "overshot: word boundaries merged"
        words.append(f"w{i % 10}")
    raise AssertionError("could not build the chat")


@pytest.fixture(scope="module")
def long_chat(smollm_tokenizer):
    chat = _chat_of_length(smollm_tokenizer, 114)
    assert _render_len(smollm_tokenizer, chat) == 114
    return chat


@pytest.mark.parametrize("policy", ["left", "right", "middle"])
def test_truncation_keeps_system_and_generation_prompt(smollm_tokenizer, long_chat, policy):
    tok = smollm_tokenizer
    result = apply_prompt_policy([long_chat], tok, 64, policy)
    (prompt,) = result.prompts
    text = tok.decode(prompt.prompt_ids)
    assert prompt.num_tokens <= 64
    assert prompt.num_tokens >= 62, "truncation should use the budget, not leave it half empty"
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(GENERATION_PROMPT)
    assert prompt.num_tokens_removed == 114 - prompt.num_tokens
    acc = result.accounting
    assert (acc.num_truncated, acc.num_kept, acc.num_filtered, acc.num_rejected) == (1, 0, 0, 0)
    assert acc.num_tokens_removed == 114 - prompt.num_tokens
    # canonical ids: re-rendering the decoded chat gives the same ids
    user = text.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    rerendered = tok.apply_chat_template(
        [long_chat[0], {"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert list(prompt.prompt_ids) == rerendered


def test_truncation_sides_keep_the_right_part(smollm_tokenizer, long_chat):
    words = long_chat[1]["content"].split()
    texts = {}
    for policy in ("left", "right", "middle"):
        (prompt,) = apply_prompt_policy([long_chat], smollm_tokenizer, 64, policy).prompts
        user = smollm_tokenizer.decode(prompt.prompt_ids).split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>", 1)[0]
        texts[policy] = user.split()
    assert texts["right"][:3] == words[:3] and len(texts["right"]) < len(words)
    assert texts["left"][-3:] == words[-3:]
    assert texts["middle"][:2] == words[:2] and texts["middle"][-2:] == words[-2:]


def test_filter_drops_and_counts(smollm_tokenizer, long_chat):
    short = [{"role": "user", "content": "What is 2 + 2?"}]
    result = apply_prompt_policy([short, long_chat, short], smollm_tokenizer, 64, "filter")
    assert [p.row for p in result.prompts] == [0, 2]
    acc = result.accounting
    assert (acc.num_kept, acc.num_filtered, acc.num_truncated, acc.num_rejected) == (2, 1, 0, 0)
    assert acc.outcomes[1].status == "filtered" and acc.outcomes[1].num_tokens == 114
    assert acc.metrics()["prompt/filtered"] == 1
    want = smollm_tokenizer.apply_chat_template(short, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(result.prompts[0].prompt_ids) == want


def test_error_names_the_row(smollm_tokenizer, long_chat):
    short = [{"role": "user", "content": "What is 2 + 2?"}]
    with pytest.raises(ValueError) as err:
        apply_prompt_policy([short, short, long_chat], smollm_tokenizer, 64, "error")
    message = str(err.value)
    assert "row 2 (114 tokens)" in message and "data.max_prompt_tokens=64" in message and "data.overlong_prompt" in message


def test_bad_rows_are_rejected_and_counted_never_crash(smollm_tokenizer):
    rows = [
        [{"role": "user", "content": "ok?"}],
        [],
        "not a chat",
        [{"role": "user", "content": "   "}],
        [{"role": "user", "content": 42}],
        [{"content": "no role"}],
        [{"role": "system", "content": "only a system message"}],
        None,
    ]
    result = apply_prompt_policy(rows, smollm_tokenizer, 64, "left")
    acc = result.accounting
    assert acc.num_rows == len(rows)
    assert acc.num_kept == 1 and acc.num_rejected == len(rows) - 1
    assert acc.num_kept + acc.num_truncated + acc.num_filtered + acc.num_rejected == acc.num_rows
    assert all(o.reason for o in acc.outcomes if o.status == "rejected")


def test_budget_too_small_for_the_template_rejects(smollm_tokenizer, long_chat):
    result = apply_prompt_policy([long_chat], smollm_tokenizer, 10, "middle")
    assert result.prompts == () and result.accounting.num_rejected == 1
    assert "template" in result.accounting.outcomes[0].reason


@pytest.mark.parametrize(("budget", "policy", "match"), [(0, "left", "max_prompt_tokens=0"), (64, "chop", "overlong_prompt='chop'")])
def test_bad_arguments(smollm_tokenizer, budget, policy, match):
    with pytest.raises(ValueError, match=match):
        apply_prompt_policy([[{"role": "user", "content": "x"}]], smollm_tokenizer, budget, policy)


@pytest.mark.parametrize("policy", ["left", "right", "middle"])
def test_truncation_never_adds_replacement_characters(smollm_tokenizer, policy):
    chat = [{"role": "user", "content": "👨‍👩‍👧‍👦🇫🇷é漢字" * 50}]
    (prompt,) = apply_prompt_policy([chat], smollm_tokenizer, 60, policy).prompts
    assert prompt.num_tokens <= 60
    assert "\ufffd" not in smollm_tokenizer.decode(prompt.prompt_ids)


@pytest.mark.parametrize("chats", ["hello", None, 42])
def test_chats_must_be_a_list(smollm_tokenizer, chats):
    with pytest.raises(ValueError, match="list of chats"):
        apply_prompt_policy(chats, smollm_tokenizer, 64, "left")

"""`packrl verl` answers a misspelled verl key with the known key nearest in meaning: the sections
and name parts they share (max, token, len, micro, batch, ...) before edit distance."""

from __future__ import annotations

import re

import pytest

from packrl.compat.verl import translate
from packrl.compat.verl.keys import VERL_KEYS, nearest_key, rule_of
from packrl.compat.verl.nearest import name_parts, nearest
from packrl.config import ConfigError

AR = "actor_rollout_ref"
ACTOR_BUDGET = f"{AR}.actor.ppo_max_token_len_per_gpu"


@pytest.mark.parametrize(("misspelled", "meant"), [
    # token budgets as tuning guides print them; by edit distance alone the first five get
    # pad_to_length, pad_to_length, pad_to_length, qat and critic.ppo_max_token_len_per_gpu
    (f"{AR}.actor.max_token_len", ACTOR_BUDGET),
    (f"{AR}.actor.max_token_length", ACTOR_BUDGET),
    (f"{AR}.actor.max_seq_len", ACTOR_BUDGET),
    (f"{AR}.actor.max_token", ACTOR_BUDGET),
    ("actor.ppo_max_token_len_per_gpu", ACTOR_BUDGET),
    (f"{AR}.actor.ppo_max_tokens_len_per_gpu", ACTOR_BUDGET),
    (f"{AR}.actor.ppo_max_token_length_per_gpu", ACTOR_BUDGET),
    (f"{AR}.ppo_max_token_len_per_gpu", ACTOR_BUDGET),
    (f"{AR}.ref.max_token_len_per_gpu", f"{AR}.ref.log_prob_max_token_len_per_gpu"),
    (f"{AR}.rollout.log_prob_max_tokens", f"{AR}.rollout.log_prob_max_token_len_per_gpu"),
    ("critic.max_token_len", "critic.ppo_max_token_len_per_gpu"),
    # prompt and response lengths
    ("data.max_prompt_len", "data.max_prompt_length"),
    ("data.max_prompt_lenght", "data.max_prompt_length"),
    ("data.max_resp_length", "data.max_response_length"),
    (f"{AR}.rollout.max_response_length", f"{AR}.rollout.response_length"),
    # batch sizes
    ("data.train_bsz", "data.train_batch_size"),
    (f"{AR}.actor.ppo_mini_batchsize", f"{AR}.actor.ppo_mini_batch_size"),
    (f"{AR}.actor.ppo_micro_bsz_per_gpu", f"{AR}.actor.ppo_micro_batch_size_per_gpu"),
    (f"{AR}.actor.micro_batch_size_per_gpu", f"{AR}.actor.ppo_micro_batch_size_per_gpu"),
    (f"{AR}.rollout.log_prob_micro_bsz_per_gpu", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu"),
    ("critic.micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu"),
    ("data.ppo_mini_batch_size", f"{AR}.actor.ppo_mini_batch_size"),  # the right name under the wrong section
    # other keys keep their spelling fix
    ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
    (f"{AR}.actor.use_dynamic_batch_size", f"{AR}.actor.use_dynamic_bsz"),
])
def test_a_misspelled_key_is_pointed_at_the_key_it_means(misspelled, meant):
    assert rule_of(misspelled) is None
    assert nearest_key(misspelled) == meant


def _is_length_key(key: str) -> bool:
    return bool({"len", "token"} & set(name_parts(key.rsplit(".", 1)[-1])))


def _is_batch_key(key: str) -> bool:
    return "batch" in name_parts(key.rsplit(".", 1)[-1])


def _misspellings(key: str) -> set[str]:
    """How tuning guides respell a length or batch key: len <-> length, tokens, bsz, batchsize,
    per_device, no per_gpu, no ppo_/log_prob_/forward_ prefix."""
    out = {re.sub(r"\.(ppo_|log_prob_|forward_)", ".", key), key.replace("_per_gpu", ""), key.replace("_per_gpu", "_per_device")}
    if _is_length_key(key):
        out |= {re.sub(r"_len(?=_|$)", "_length", key), key.replace("_length", "_len"), key.replace("token", "tokens")}
    if _is_batch_key(key):
        out |= {key.replace("batch_size", "bsz"), key.replace("batch_size", "batchsize")}
    return {k for k in out if k != key and rule_of(k) is None}


@pytest.mark.parametrize("key", [k for k in VERL_KEYS if _is_length_key(k) or _is_batch_key(k)])
def test_every_misspelled_length_or_batch_key_is_pointed_at_one(key):
    for misspelled in _misspellings(key):
        hint = nearest_key(misspelled)
        assert hint is not None and (_is_length_key(hint) if _is_length_key(key) else _is_batch_key(hint)), (misspelled, hint)


def test_the_error_names_the_token_budget_for_a_misspelled_one():
    with pytest.raises(ConfigError) as err:
        translate([f"{AR}.actor.use_dynamic_bsz=True", f"{AR}.actor.max_token_len=24576"], num_train_rows=100)
    assert f"{AR}.actor.max_token_len=24576: is not a verl config key; fix: did you mean {ACTOR_BUDGET}?" in str(err.value)


def test_a_key_sharing_nothing_gets_no_hint():
    assert nearest_key("data.qwerty") is None and nearest_key("foo.bar") is None
    with pytest.raises(ConfigError, match=r"data.qwerty=1: is not a verl config key; fix: see docs/verl.md"):
        translate(["data.qwerty=1"], num_train_rows=100)


def test_sections_and_shared_words_come_before_spelling():
    names = ["a.pad_to_length", "a.ppo_max_token_len_per_gpu", "b.max_token_len", "a.rollout.max_tool_response_len"]
    assert nearest("a.max_token_len", names) == "a.ppo_max_token_len_per_gpu"  # 2 shared words more than pad_to_length
    assert nearest("c.max_token_len", names) == "b.max_token_len"  # no section shared: the same words, spelled alike
    assert nearest("a.max_response_len", ["a.rollout.max_tool_response_len", "a.response_len"]) == "a.response_len"
    assert nearest("a.ppo_mini_batch_size", ["b.ppo_mini_batch_size", "c.ppo_mini_batch_size"]) == "b.ppo_mini_batch_size"
    assert name_parts("ppo_micro_bsz_per_gpus") == ("ppo", "micro", "batch", "size", "per", "gpu")

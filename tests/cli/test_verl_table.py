"""The verl key table and the translation agree, both ways.

(a) Table -> code: every executable rule, given alone, produces exactly its packrl key with the
    value its converter gives; every relational rule, given alone, reaches only packrl keys its
    rule names, and is used or named with a reason by its function (never left to the generic
    "no effect" fallback, which would mean no code reads it).
(b) Code -> table: over realistic verl scripts, every packrl key `translate` sets is named by
    the rule of each verl key it came from (given or at verl's default), or is one of the
    `BEHAVIOUR` keys set with no verl key behind them.

`test_the_checks_catch_a_table_that_disagrees_with_the_code` runs the same checks on tables
with one entry dropped or changed, so a table that drifts from the code fails here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import pytest

from packrl.compat.verl import relational, translate
from packrl.compat.verl.convert import Converted
from packrl.compat.verl.keys import ACTOR, AR, BEHAVIOUR, DEFAULTS, FAMILIES, REF, ROLLOUT, VERL_KEYS, KeyRule
from packrl.compat.verl.overrides import Translation, format_value
from packrl.config import ConfigError
from tests.cli.test_verl import GRPO, LORA, PPO, SEQ_BALANCE, SMALL
from tests.cli.test_verl_09 import GEO_RS, GRPO_09

ROWS = 7473
COV = f"{ACTOR}.policy_loss"
MT = f"{ROLLOUT}.multi_turn"
RC = "algorithm.rollout_correction"
OB, OBC, OB9 = "reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg", "reward.reward_kwargs.overlong_buffer_cfg"
SAMPLES: dict[str, Any] = {
    # executable keys verl gives no default here
    "data.seed": 7, f"{AR}.model.path": "Qwen/Qwen2.5-0.5B-Instruct", f"{AR}.nccl_timeout": 120,
    f"{AR}.model.override_config.rope_scaling.factor": 2.0, f"{AR}.model.enable_gradient_checkpointing": False,
    f"{AR}.model.enable_activation_offload": True, f"{ACTOR}.use_torch_compile": False, f"{ACTOR}.loss_scale_factor": 2048,
    f"{ACTOR}.fsdp_config.dtype": "float32", f"{ROLLOUT}.name": "hf", f"{ROLLOUT}.max_num_seqs": 64,
    "trainer.logger": ["console", "swanlab"], "trainer.rollout_data_dir": "/tmp/dumps", "trainer.max_actor_ckpt_to_keep": 2,
    "ray_kwargs.timeline_json_file": "/tmp/timeline.json", "ray_init.timeline_json_file": "/tmp/timeline.json",
    # executable keys with a default: a value other than it
    f"{ROLLOUT}.n": 5, f"{ROLLOUT}.temperature": 0.7, f"{ROLLOUT}.top_k": -1, f"{ACTOR}.policy_loss.loss_mode": "gspo",
    "algorithm.adv_estimator": "grpo", "trainer.save_freq": -1, "data.train_batch_size": 512,
    # relational keys
    "data.gen_batch_size": 12, f"{AR}.model.override_config.rope_scaling.type": "yarn",
    f"{AR}.model.override_config.rope_scaling.rope_type": "dynamic", f"{ACTOR}.ppo_micro_batch_size": 8,
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": 4, f"{ACTOR}.use_dynamic_bsz": True,
    f"{ACTOR}.clip_ratio_low": 0.2, f"{ACTOR}.clip_ratio_high": 0.28,
    f"{COV}.clip_cov_ratio": 0.0002, f"{COV}.clip_cov_lb": 1.0, f"{COV}.clip_cov_ub": 5.0, f"{COV}.kl_cov_ratio": 0.0002,
    f"{COV}.ppo_kl_coef": 0.1, f"{ACTOR}.optim.clip_grad": 0.5, f"{ACTOR}.tis_imp_ratio_cap": 2.0,
    f"{ACTOR}.fsdp_config.param_offload": True, f"{ACTOR}.fsdp_config.optimizer_offload": True,
    f"{ACTOR}.fsdp_config.offload_policy": True, f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size": 1,
    f"{REF}.ulysses_sequence_parallel_size": 1, f"{ROLLOUT}.prompt_length": 512, f"{ROLLOUT}.response_length": 512,
    **{f"{role}.{name}": value for role in (ROLLOUT, REF) for name, value in (
        ("log_prob_micro_batch_size", 8), ("log_prob_micro_batch_size_per_gpu", 4), ("log_prob_use_dynamic_bsz", True),
        ("log_prob_max_token_len_per_gpu", 8192))},
    f"{MT}.enable": True, f"{MT}.max_assistant_turns": 3, f"{MT}.max_tool_response_length": 256,
    f"{MT}.tool_response_truncate_side": "left", f"{MT}.tool_config_path": "tools.yaml",
    f"{ROLLOUT}.gpu_memory_utilization": 0.6, f"{ROLLOUT}.enable_chunked_prefill": True, f"{ROLLOUT}.enable_prefix_caching": True,
    f"{ROLLOUT}.max_num_batched_tokens": 8192, f"{ROLLOUT}.enforce_eager": True, f"{ROLLOUT}.disable_log_stats": True,
    f"{ROLLOUT}.engine_kwargs.vllm.disable_cascade_attn": True,
    "critic.enable": True, "critic.optim.weight_decay": 0.01, "critic.optim.clip_grad": 0.5, "critic.model.path": "Qwen/Qwen2.5-0.5B",
    "critic.ppo_mini_batch_size": 256, "critic.ppo_micro_batch_size": 8, "critic.ppo_micro_batch_size_per_gpu": 4,
    "critic.use_dynamic_bsz": True, "critic.ppo_epochs": 1, "critic.loss_agg_mode": "token-mean",
    "reward_model.reward_kwargs.max_resp_len": 512, f"{OBC}.enable": True, f"{OBC}.len": 64, f"{OBC}.penalty_factor": 1.0,
    f"{OB}.enable": True, f"{OB}.len": 64, f"{OB}.penalty_factor": 1.0, "reward_model.reward_manager": "dapo",
    "reward_manager.name": "dapo", "reward.reward_manager.name": "dapo", "reward.reward_kwargs.max_resp_len": 512,
    f"{OB9}.enable": True, f"{OB9}.len": 64, f"{OB9}.penalty_factor": 1.0, "critic.loss_scale_factor": 2048,
    f"{ACTOR}.clip_ratio_c": 10.0,
    "algorithm.gamma": 0.99, "algorithm.lam": 0.95, "algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
    "algorithm.filter_groups.max_num_gen_batches": 10, f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": 2.0,
    f"{RC}.rollout_rs": "geometric", f"{RC}.rollout_rs_threshold": 1.001, f"{RC}.rollout_rs_threshold_lower": 0.999,
    "trainer.total_training_steps": 10, "trainer.default_local_dir": "/tmp/run", "trainer.nnodes": 2,
    f"{ACTOR}.use_kl_loss": True, "algorithm.use_kl_in_reward": True, f"{ACTOR}.optim.lr_warmup_steps": 5,
}
"""A representative value per mapped verl key (else verl's default, `DEFAULTS`)."""

DAPO = [*GRPO, *SMALL, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10", "data.gen_batch_size=12", f"{ACTOR}.clip_ratio_low=0.2",
        f"{ACTOR}.clip_ratio_high=0.28", f"{ACTOR}.loss_agg_mode=token-mean", f"{ACTOR}.use_kl_loss=False",
        "reward_model.reward_manager=dapo", f"+{OB}.enable=True", f"+{OB}.len=256", f"+{OB}.penalty_factor=1.0",
        f"{ACTOR}.optim.lr_warmup_steps=10", f"{ACTOR}.optim.clip_grad=1.0", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"]
"""A DAPO-recipe script: dynamic sampling, clip-higher, the overlong buffer, token TIS."""
CLUSTER = [*PPO, "trainer.nnodes=2", "trainer.default_local_dir=/tmp/run", "trainer.resume_mode=auto", "trainer.max_actor_ckpt_to_keep=3",
           f"{ACTOR}.optim.lr_warmup_steps_ratio=0.1", "critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=16384",
           "critic.optim.clip_grad=0.5", "algorithm.gamma=1.0", "algorithm.lam=0.95", "algorithm.use_kl_in_reward=True",
           "algorithm.kl_penalty=low_var_kl", "algorithm.kl_ctrl.kl_coef=0.002", f"{ACTOR}.fsdp_config.param_offload=True",
           f"{ACTOR}.fsdp_config.dtype=bfloat16", f"{ACTOR}.use_torch_compile=False", f"{ROLLOUT}.temperature=0.9",
           f"{ROLLOUT}.top_k=-1", f"{ROLLOUT}.val_kwargs.do_sample=True", f"{ROLLOUT}.val_kwargs.temperature=0.6",
           f"+{ROLLOUT}.engine_kwargs.vllm.disable_cascade_attn=True", "trainer.rollout_data_dir=/tmp/dumps",
           "ray_kwargs.timeline_json_file=/tmp/timeline.json", "data.seed=3", f"{RC}.rollout_rs=geometric",
           f"{RC}.rollout_rs_threshold=1.001",
           f"{AR}.model.override_config.rope_scaling.type=yarn", f"{AR}.model.override_config.rope_scaling.factor=2.0"]
"""A multi-node PPO script: resume, warmup ratio, KL in the reward, a dynamic critic budget, rejection sampling."""
SCRIPTS = {
    "ppo": PPO + SMALL, "grpo": GRPO, "grpo_small": GRPO + SMALL, "seq_balance": SEQ_BALANCE + SMALL + ["trainer.n_gpus_per_node=2"],
    "lora": LORA + SMALL, "dapo": DAPO, "cluster": CLUSTER,
    "verl09": GRPO_09 + SMALL + GEO_RS + ["reward.reward_manager.name=dapo", f"+{OB9}.enable=True", f"+{OB9}.len=256",
                                          f"{ACTOR}.optim.lr_warmup_steps_ratio=0.1", f"{ACTOR}.clip_ratio_c=5.0",
                                          "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"],
    "clip_cov": GRPO + SMALL + [f"{COV}.loss_mode=clip_cov", f"{COV}.clip_cov_ratio=0.0004", f"{COV}.kl_cov_ratio=0.002"],
    "micro_global": GRPO + SMALL + ["trainer.n_gpus_per_node=4", f"{ACTOR}.ppo_micro_batch_size=8",
                                    f"{ACTOR}.ppo_micro_batch_size_per_gpu=null"],
    "no_micro": [a for a in GRPO if "micro_batch" not in a] + SMALL + ["trainer.total_training_steps=3", "trainer.logger=[console,foo]"],
}


def _sources(translation: Translation) -> list[tuple[str, str | None]]:
    """``(packrl key, verl key)`` for every source of every mapping; None for a sourceless one."""
    pairs: list[tuple[str, str | None]] = []
    for m in translation.mappings:
        keys = [s.split("=", 1)[0].lstrip("+") for s in m.sources if s != "(verl behaviour)"]
        pairs += [(m.key, k) for k in keys] or [(m.key, None)]
    return pairs


def _rule(verl_key: str, rules: Mapping[str, KeyRule], families: Mapping[str, KeyRule]) -> tuple[KeyRule | None, bool]:
    """The rule of ``verl_key`` in the given tables, and whether it is a family's (a sub-tree)."""
    if verl_key in rules:
        return rules[verl_key], False
    prefixes = [p for p in families if verl_key.startswith(p)]
    return (families[max(prefixes, key=len)], True) if prefixes else (None, False)


def unnamed(translation: Translation, rules: Mapping[str, KeyRule] = VERL_KEYS,
            families: Mapping[str, KeyRule] = FAMILIES) -> list[str]:
    """Every ``packrl key <- verl key`` of ``translation`` the verl key's rule does not name
    (a family's target names its sub-keys), and every sourceless key not in `BEHAVIOUR`."""
    missing = []
    for key, verl_key in _sources(translation):
        if verl_key is None:
            if key not in BEHAVIOUR:
                missing.append(f"{key} <- (no verl key)")
            continue
        rule, family = _rule(verl_key, rules, families)
        targets = rule.targets if rule else ()
        if key not in targets and not (family and any(key.startswith(t + ".") for t in targets)):
            missing.append(f"{key} <- {verl_key}" + ("" if rule else " (no rule)"))
    return missing


def _functions(verl_key: str) -> tuple[str, ...]:
    rule, _ = _rule(verl_key, VERL_KEYS, FAMILIES)
    return rule.functions if rule else ()


def _sample(key: str) -> Any:
    return SAMPLES[key] if key in SAMPLES else DEFAULTS[key]


def _alone(key: str) -> tuple[Translation | None, list[str]]:
    """The translation of ``key=<sample>`` alone, or None and the keys of its problems."""
    try:
        return translate([f"{key}={format_value(_sample(key))}"], num_train_rows=ROWS), []
    except ConfigError as err:
        return None, [p.key for p in err.problems]


def executable_problems(key: str, rule: KeyRule) -> list[str]:
    """How the translation of ``key`` alone differs from what executable ``rule`` states."""
    translation, refused = _alone(key)
    if translation is None:
        return [f"{key}={_sample(key)!r} is refused ({refused})"]
    reached = {k for k, v in _sources(translation) if v == key}
    stated = set(rule.targets) if rule.functions else {rule.targets[0]}  # relational too: its functions reach the others
    if rule.targets[0] not in reached or not reached <= stated:
        return [f"{key} reaches {sorted(reached)}, the table says {', '.join(sorted(stated))}"]
    expected = rule.convert(_sample(key)) if rule.convert else None
    expected = expected.value if isinstance(expected, Converted) else expected
    value = next(m.value for m in translation.mappings if m.key == rule.targets[0])
    return [] if value == expected else [f"{key}: {rule.targets[0]}={value!r}, the converter gives {expected!r}"]


def test_every_rule_is_executable_or_relational_and_names_real_functions():
    steps = {step.__name__ for step in relational.STEPS}
    for key, rule in [*VERL_KEYS.items(), *FAMILIES.items()]:
        assert rule.mapped == (rule.executable or bool(rule.functions)), key
        assert set(rule.functions) <= steps, f"{key}: {rule.by} is not a step of packrl.compat.verl.relational"
        assert not rule.executable or key in VERL_KEYS, f"{key}: a family's rule cannot be executable"
    assert [k for k, r in VERL_KEYS.items() if r.mapped and k not in {*SAMPLES, *DEFAULTS}] == []  # each needs a sample value


@pytest.mark.parametrize("key", [k for k, r in VERL_KEYS.items() if r.executable])
def test_an_executable_rule_alone_produces_exactly_its_packrl_key(key):
    assert executable_problems(key, VERL_KEYS[key]) == []


@pytest.mark.parametrize("key", [k for k, r in VERL_KEYS.items() if r.functions] + [f"{ROLLOUT}.engine_kwargs.vllm.disable_cascade_attn"])
def test_a_relational_rule_alone_reaches_only_its_packrl_keys_and_is_read(key):
    translation, refused = _alone(key)
    if translation is None:  # refused by its function (this key or one it needs with it), with the reason and the fix
        assert refused and all(set(_functions(key)) & set(_functions(k)) for k in refused), refused
        return
    assert unnamed(translation) == []
    used = any(v == key for _, v in _sources(translation))
    reason = next((i.reason for i in translation.ignored if i.key == key), "")
    assert used or (reason and not reason.startswith("no effect in this configuration")), f"{key}: {reason or 'dropped'}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_packrl_key_a_script_sets_is_named_by_the_rule_of_its_verl_keys(name):
    translation = translate(SCRIPTS[name], num_train_rows=ROWS)
    assert unnamed(translation) == []
    assert len(translation.mappings) >= 15


def test_the_scripts_reach_every_relational_function():
    reached = {f for name in SCRIPTS for _, v in _sources(translate(SCRIPTS[name], num_train_rows=ROWS)) if v for f in _functions(v)}
    assert reached == {step.__name__ for step in relational.STEPS} - {"_multi_turn"}  # verl's tool loop is refused


def test_the_checks_catch_a_table_that_disagrees_with_the_code():
    translation = translate(DAPO, num_train_rows=ROWS)
    batch = "data.train_batch_size"
    dropped = {**VERL_KEYS, batch: dataclasses.replace(VERL_KEYS[batch], packrl="data.batch_size")}
    assert f"train.total_steps <- {batch}" in unnamed(translation, dropped)
    deleted = {k: r for k, r in VERL_KEYS.items() if k != f"{ROLLOUT}.n"}
    assert f"rollout.n <- {ROLLOUT}.n (no rule)" in unnamed(translation, deleted)
    vllm_arg = f"{ROLLOUT}.engine_kwargs.vllm.disable_cascade_attn"
    no_families = unnamed(translate(CLUSTER, num_train_rows=ROWS), VERL_KEYS, {})
    assert no_families == [f"rollout.engine_kwargs.disable_cascade_attn <- {vllm_arg} (no rule)"]
    wrong = dataclasses.replace(VERL_KEYS[f"{ROLLOUT}.n"], packrl="rollout.top_k")
    assert executable_problems(f"{ROLLOUT}.n", wrong) == [f"{ROLLOUT}.n reaches ['rollout.n'], the table says rollout.top_k"]
    off_by_one = dataclasses.replace(VERL_KEYS[f"{ROLLOUT}.n"], convert=lambda v: v + 1)
    assert executable_problems(f"{ROLLOUT}.n", off_by_one) == [f"{ROLLOUT}.n: rollout.n=5, the converter gives 6"]

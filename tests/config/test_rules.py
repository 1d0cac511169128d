"""Every cross-field rule in `packrl.config.relations.RULES`, and every registered part's config
check, triggered at least once by a config that breaks it, and passed by every shipped preset.
A new rule without a case here fails `test_every_rule_has_a_case`."""

from __future__ import annotations

import inspect

import pytest

from packrl.config import check_config, load_config
from packrl.config.load import preset_names
from packrl.config.relations import RULES
from packrl.registry import CONFIG_REGISTRIES, call_with_sections

CASES: list[tuple[str, list[str], str, str]] = [  # (rule, overrides on the demo preset, the problem's key, a fragment of it)
    ("critic", ["algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable", "needs the critic's values"),
    ("critic", ["critic.cliprange_value=0.2"], "critic.cliprange_value", "has no effect: this run has no critic"),
    ("critic", ["algorithm.lam=0.9"], "algorithm.lam", "has no effect with algorithm.adv_estimator=grpo"),
    ("critic", ["algorithm.adv_estimator=gae", "trainer.num_workers=2", "trainer.sequence_parallel_size=2"], "critic.enable",
     "does not run under sequence parallelism"),
    ("critic", ["algorithm.adv_estimator=gae", "critic.warmup_steps=50", "train.total_steps=5"], "critic.warmup_steps",
     "leaves no step"),
    ("shared_prompts", ["train.share_prompts=true", "model.packed_attention=position_ids"], "train.share_prompts",
     "position-id detection"),
    ("shared_prompts", ["train.share_prompts=true", "trainer.num_workers=2", "trainer.sequence_parallel_size=2"],
     "train.share_prompts", "under sequence parallelism"),
    ("token_budgets", ["train.max_tokens_per_microbatch=100"], "train.max_tokens_per_microbatch", "longest possible sequence"),
    ("multi_turn_off", ["rollout.multi_turn.max_turns=3"], "rollout.multi_turn.max_turns", "has no effect: multi-turn is off"),
    ("mini_batches", ["train.mini_batch_size=3"], "train.mini_batch_size", "does not divide data.batch_size=8"),
    ("ranks_have_work", ["trainer.num_workers=64"], "trainer.num_workers", "more than the 32 sequences of a mini-batch"),
    ("sequence_parallel_attention", ["trainer.num_workers=2", "trainer.sequence_parallel_size=2", "model.packed_attention=block_mask"],
     "trainer.sequence_parallel_size", "not model.packed_attention=block_mask"),
    ("parameter_offload", ["model.param_offload=true"], "model.param_offload", "trainer.num_workers=1 runs one process"),
    ("compiled_layers", ["model.compile=true", "trainer.num_workers=2"], "model.compile", "cannot run with trainer.num_workers=2"),
    ("group_size", ["rollout.n=1"], "rollout.n", "gives every response advantage 0 under grpo"),
    ("sft_loss", ["algorithm.policy_loss=sft"], "algorithm.policy_loss", "supervised loss of packrl sft"),
    ("kl_in_reward", ["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward", "has no effect with algorithm.kl_coef=0"),
    ("restarts", ["trainer.max_restarts=2"], "trainer.max_restarts", "trains in this process with none"),
    ("filters", ["algorithm.filters.dynamic_sampling={}", "trainer.rollout_mode=colocate_async"], "algorithm.filters.dynamic_sampling",
     "does not run under trainer.rollout_mode=colocate_async"),
    ("filters", ["algorithm.filters.rollout_correction={}"], "algorithm.filters.rollout_correction",
     "is set by algorithm.rollout_correction"),
    ("thinking_budgets", ["rollout.think_budget_tokens=8", "rollout.answer_budget_tokens=8", "trainer.rollout_mode=colocate_async"],
     "rollout.think_budget_tokens", "does not apply to responses carried across steps"),
    ("length_targets", ["data.length_target.min_tokens=8", "data.length_target.max_tokens=65"], "data.length_target.max_tokens",
     "> rollout.max_response_tokens=64"),
    ("length_targets", ["data.length_target.min_tokens=8", "data.length_target.max_tokens=40",
                        "rollout.max_response_tokens_schedule=[[1,32],[3,64]]"], "data.length_target.max_tokens",
     "> 32, the response budget of the length curriculum's stage from step 1"),
    ("task_sources", ["data.train_files=[task:char_cont]"], "data.train_files", "is not a registered task; fix: did you mean "
     "task:char_count?"),
    ("task_sources", ["data.val_files=[task:char_count_traces]"], "data.val_files", "is a task that makes traces"),
]

PART_CHECKS: list[tuple[str, list[str], str, str]] = [  # a registered part's own config check (checks= in packrl.registry)
    ("trainer.rollout_mode=sync", ["algorithm.rollout_correction.rollout_is_threshold=3.0"],
     "algorithm.rollout_correction.rollout_is_threshold", "has no effect: algorithm.rollout_correction.rollout_is is null"),
    ("trainer.rollout_mode=sync", ["trainer.num_rollout_workers=2"], "trainer.num_rollout_workers",
     "has no effect: trainer.rollout_mode=sync runs no rollout workers"),
    ("trainer.rollout_mode=sync", ["rollout.max_staleness=3"], "rollout.max_staleness", "has no effect: trainer.rollout_mode=sync"),
    ("trainer.rollout_mode=separate_async", ["trainer.num_rollout_workers=0"], "trainer.num_rollout_workers", "must be >= 1"),
    ("trainer.rollout_mode=separate_async", ["rollout.max_staleness=1"], "rollout.max_staleness", "must be >= 2"),
    ("trainer.rollout_mode=colocate_async", ["rollout.over_provision=0"], "rollout.over_provision", "must be in [1, data.batch_size=8]"),
    ("trainer.rollout_mode=colocate_async", ["rollout.over_provision=9"], "rollout.over_provision", "must be in [1, data.batch_size=8]"),
    ("trainer.rollout_mode=colocate_async", ["rollout.partial_chunk_tokens=32"], "rollout.partial_chunk_tokens",
     "has no effect: rollout.engine=hf on one rank"),
    ("trainer.rollout_mode=colocate_async", ["rollout.multi_turn.tools=[calculator]"], "trainer.rollout_mode",
     "does not carry multi-turn"),
    ("trainer.rollout_mode=colocate_async", ["trainer.num_rollout_workers=2"], "trainer.num_rollout_workers",
     "runs no rollout workers of its own"),
    ("algorithm.policy_loss=gspo", ["trainer.num_workers=2", "trainer.sequence_parallel_size=2"], "algorithm.policy_loss",
     "needs each sequence on one rank"),
    ("algorithm.policy_loss=gspo", ["rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.context_policy=rolling"],
     "algorithm.policy_loss", "trains a trajectory as several step-wise samples"),
    ("algorithm.filters.dynamic_sampling", ["algorithm.filters.dynamic_sampling={}", "rollout.n=1",
                                            "algorithm.adv_estimator=reinforce_plus_plus"],
     "algorithm.filters.dynamic_sampling", "every group would be dropped"),
    ("algorithm.filters.gfpo", ["algorithm.filters.gfpo.keep=5"], "algorithm.filters.gfpo.keep", "> rollout.n=4"),
    ("algorithm.filters.gfpo", ["algorithm.filters.gfpo.keep=4"], "algorithm.filters.gfpo.keep", "has no effect: it keeps all"),
    ("algorithm.filters.gfpo", ["algorithm.filters.gfpo.keep=1"], "algorithm.filters.gfpo.keep", "leaves a group of one"),
    ("reward.shaping.overlong", ["reward.shaping.overlong.buffer_tokens=65"], "reward.shaping.overlong.buffer_tokens",
     "> rollout.max_response_tokens=64"),
    ("reward.shaping.tool_format", ["reward.shaping.tool_format.weight=0.2"], "reward.shaping.tool_format",
     "has no effect: multi-turn is off"),
    ("reward.shaping.group_length", ["reward.shaping.group_length.warmup_steps=9"], "reward.shaping.group_length.warmup_steps",
     "leaves no step of train.total_steps=5"),
    ("reward.shaping.efficiency", ["reward.shaping.efficiency={}", "reward.format_score=1.0"], "reward.format_score",
     "would count formatted wrong answers as correct"),
    ("reward.shaping.shortest_correct", ["reward.shaping.shortest_correct={}", "reward.format_score=2.0"], "reward.format_score",
     ">= the correct score 1"),
    ("reward.shaping.target_length", ["reward.shaping.target_length={}"], "reward.shaping.target_length",
     "data.length_target sets none"),
]


def _problems(overrides: list[str]) -> list:
    return check_config("demo", overrides)[1]


def test_every_rule_has_a_case():
    assert {rule.__name__ for rule in RULES} == {name for name, *_ in CASES}


@pytest.mark.parametrize(("rule", "overrides", "key", "fragment"), CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_a_config_that_breaks_the_rule_is_refused_with_its_key(rule, overrides, key, fragment):
    cfg, problems, _ = check_config("demo", overrides)
    by_rule = call_with_sections(next(r for r in RULES if r.__name__ == rule), cfg)
    assert any(p.key == key and fragment in str(p) for p in by_rule), [str(p) for p in by_rule]
    assert any(p.key == key and fragment in str(p) for p in problems), "load_config reports the rule's problem"
    assert all(p.fix for p in by_rule), "every problem names its fix"


@pytest.mark.parametrize(("selector", "overrides", "key", "fragment"), PART_CHECKS, ids=[f"{c[0]}:{c[2]}" for c in PART_CHECKS])
def test_a_registered_parts_check_runs_when_the_part_is_chosen(selector, overrides, key, fragment):
    extra = [selector] if "=" in selector else []
    assert any(p.key == key and fragment in str(p) for p in _problems([*extra, *overrides])), [str(p) for p in _problems(overrides)]


def test_every_registry_with_checks_is_covered():
    checked = {f"{registry.key}={name}" if registry.args_key != registry.key else f"{registry.key}.{name}"
               for registry in CONFIG_REGISTRIES.values() for name in registry._checks
               if not name.startswith("test_")}  # not the plugins other tests register
    covered = {selector for selector, *_ in PART_CHECKS}
    missing_optional = {"rollout.engine=vllm", "reward.name=math_verify"}  # their checks are about installed packages
    assert checked - missing_optional <= covered, checked - covered


@pytest.mark.parametrize("preset", preset_names())
def test_no_rule_fires_on_a_shipped_preset(preset):
    cfg = load_config(preset)
    for rule in RULES:
        assert call_with_sections(rule, cfg) == [], (preset, rule.__name__)


def test_every_rule_names_the_sections_it_reads():
    """A rule's parameters are config sections: what it depends on is in its signature, and a
    rule that reads a section it does not name fails at its first call (the name is not in scope)."""
    from dataclasses import fields

    from packrl.config.schema import RunConfig
    from packrl.config.sft_rules import SFT_RULES

    sections = {f.name for f in fields(RunConfig)}
    for rule in (*RULES, *SFT_RULES):
        names = set(inspect.signature(rule).parameters)
        assert names and names <= sections, (rule.__name__, names - sections)


def test_a_check_naming_no_section_is_a_clear_error():
    cfg = load_config("demo")

    def check(rollout, steps):
        return []

    with pytest.raises(ValueError, match=r"takes parameter 'steps', which is not a section of the config; name sections"):
        call_with_sections(check, cfg)
    with pytest.raises(ValueError, match=r"takes parameter 'extra', which is not a section"):
        call_with_sections(lambda train, **extra: [], cfg)
    assert call_with_sections(lambda train, /, limit=3: (train.seed, limit), cfg) == (cfg.train.seed, 3)
    assert call_with_sections(lambda cfg: [cfg.rollout.n], cfg) == [cfg.rollout.n]
    assert call_with_sections(lambda train, data: (train.seed, data.batch_size), cfg) == (cfg.train.seed, cfg.data.batch_size)


def test_a_plugin_check_that_returns_no_problem_list_or_replaces_a_built_in_is_refused_by_name():
    from packrl.registry import POLICY_LOSSES, ROLLOUT_MODES

    with pytest.raises(ValueError, match=r"trainer.rollout_mode='colocate_async' already has a config check|rollout mode "
                                         r"'colocate_async' already has a config check"):
        ROLLOUT_MODES.register_check("colocate_async")(lambda cfg: [])

    @POLICY_LOSSES.register_check("test_returns_text")
    def returns_text(algorithm):
        return "not a list"

    POLICY_LOSSES._checks["ppo_clip"], saved = returns_text, POLICY_LOSSES._checks.get("ppo_clip")
    try:
        with pytest.raises(ValueError, match=r"the config check of algorithm.policy_loss=ppo_clip \('test_a_plugin_check.*returns_text'\) "
                                             r"returned str 'not a list'; a config check returns a list of packrl.errors.ConfigProblem"):
            load_config("demo")
    finally:
        if saved is None:
            POLICY_LOSSES._checks.pop("ppo_clip")
        else:
            POLICY_LOSSES._checks["ppo_clip"] = saved
        POLICY_LOSSES._checks.pop("test_returns_text")


def test_dynamic_sampling_on_the_score_with_a_length_part_is_a_warning_naming_metric_reward(caplog):
    """The all-correct groups carry only the length signal; ``metric=score`` drops them (a warning,
    not an error: the run is valid), ``metric=reward`` keeps them. Every warning rule is covered here."""
    from packrl.config.length_control import LENGTH_PARTS
    from packrl.config.relations import WARNINGS, config_warnings
    from packrl.registry import REWARD_SHAPING
    from packrl.reward.length.common import LengthGateOptions

    assert [rule.__name__ for rule in WARNINGS] == ["filter_warnings"]
    assert {n for n in REWARD_SHAPING.names() if issubclass(REWARD_SHAPING.options_class(n) or object, LengthGateOptions)} \
        == set(LENGTH_PARTS)
    over = ["algorithm.filters.dynamic_sampling={}", "reward.shaping.shortest_correct.beta=0.001"]
    with caplog.at_level("WARNING", logger="packrl.config"):
        cfg = load_config("demo", over)
    assert ("algorithm.filters.dynamic_sampling.metric='score': drops every group whose task scores are all equal, the all-correct "
            "ones included, whose rewards differ only by the length term of reward.shaping.shortest_correct; fix: set "
            "algorithm.filters.dynamic_sampling.metric=reward") in caplog.text
    assert [w.keys for w in config_warnings(cfg)] == [("algorithm.filters.dynamic_sampling.metric", "algorithm.filters.dynamic_sampling",
                                                       "reward.shaping.shortest_correct")]
    assert config_warnings(load_config("demo", [*over[1:], "algorithm.filters.dynamic_sampling.metric=reward"])) == []
    assert config_warnings(load_config("demo", over[:1])) == []  # no length part
    assert config_warnings(load_config("demo", over[1:])) == []  # no dynamic sampling
    for preset in preset_names():
        assert config_warnings(check_config(preset)[0]) == [], preset

"""Reward shaping as registered parts: a new part is one plugin file with its own knobs, checked at
load, summed by score_rollout and reported as reward/<part>/mean; a part that breaks the contract
is named."""

from __future__ import annotations

import json

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.config.schema import RewardConfig, RolloutConfig
from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.reward import score_rollout
from packrl.testing import write_plugin
from packrl.types import PromptBatch, Response, RolloutBatch
from tests.diagnostics.tiny_run import tiny_run

PLUGIN = '''
from dataclasses import dataclass

import torch

from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.reward.shaping import ShapingOutput


@dataclass(frozen=True)
class BrevityOptions:
    per_token: float = 0.01

    def problems(self, prefix):
        return [] if self.per_token > 0 else [ConfigProblem(f"{prefix}.per_token", self.per_token, "must be > 0",
                                                            f"set {prefix}.per_token=0.01")]


@REWARD_SHAPING.register("test_brevity", options=BrevityOptions)
def brevity(inputs):
    lengths = torch.tensor([len(r.response_ids) for r in inputs.rollout.responses], dtype=torch.float32)
    return ShapingOutput(-inputs.options.per_token * lengths, {"tokens": lengths})


@REWARD_SHAPING.register("test_bad_shape")
def bad(inputs):
    return ShapingOutput(torch.zeros(1))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    return write_plugin(tmp_path_factory.mktemp("plugin"), "brevity.py", PLUGIN)


def _rollout(lengths: list[int]) -> RolloutBatch:
    prompts = PromptBatch(((1, 2),), ("1",), ("t",), (0,), (False,))
    return RolloutBatch(prompts, len(lengths), tuple(Response(tuple([5] * n), "eos") for n in lengths))


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * len(i) for i in ids]


def test_a_plugin_part_with_its_own_knobs_is_checked_at_load(plugin):
    base = [f"trainer.plugins=[{plugin}]"]
    cfg = load_config("demo", [*base, "reward.shaping.test_brevity.per_token=0.5"])
    assert cfg.reward.shaping == {"test_brevity": {"per_token": 0.5}}
    assert load_config("demo", [*base, "reward.shaping.test_brevity={}"]).reward.shaping_parts() == {"test_brevity": {}}
    with pytest.raises(ConfigError, match=r"reward.shaping.test_brevity.per_tokn=1: unknown key; fix: did you mean "
                                          r"reward.shaping.test_brevity.per_token\?"):
        load_config("demo", [*base, "reward.shaping.test_brevity.per_tokn=1"])
    with pytest.raises(ConfigError, match=r"reward.shaping.test_brevity.per_token=-1.0: must be > 0"):
        load_config("demo", [*base, "reward.shaping.test_brevity.per_token=-1"])
    with pytest.raises(ConfigError, match=r"reward.shaping.test_brevty=.*is not a registered reward-shaping part; fix: did you mean "
                                          r"reward.shaping.test_brevity\?"):
        load_config("demo", [*base, "reward.shaping.test_brevty.per_token=1"])
    with pytest.raises(ConfigError, match=r"reward.shaping.test_bad_shape=.*has no effect: reward-shaping part test_bad_shape reads "
                                          r"no options"):
        load_config("demo", [*base, "reward.shaping.test_bad_shape.x=1"])


def _brevity_problems(reward: RewardConfig, rollout: RolloutConfig) -> list[ConfigProblem]:
    """A check of the test part: its penalty at the response budget stays <= 50."""
    per_token = (reward.shaping.get("test_brevity") or {}).get("per_token", 0.01)
    budget = rollout.max_response_tokens
    if per_token * budget <= 50:
        return []
    return [ConfigProblem("reward.shaping.test_brevity.per_token", per_token, f"x rollout.max_response_tokens={budget} > 50",
                          "lower reward.shaping.test_brevity.per_token",
                          keys=("reward.shaping.test_brevity.per_token", "rollout.max_response_tokens"))]


def test_a_plugin_parts_check_reads_the_sections_it_gets(plugin, monkeypatch):
    """A part's registered check (`REWARD_SHAPING.register_check`) gets the sections its parameters
    name, as every other config check (`packrl.registry.call_with_sections`), not the whole config,
    and its problems stop the load."""
    checks = REWARD_SHAPING._checks | {"test_brevity": _brevity_problems}  # as register_check would, for this test only
    monkeypatch.setattr(REWARD_SHAPING, "_checks", checks)
    base = [f"trainer.plugins=[{plugin}]"]
    with pytest.raises(ConfigError, match=r"reward.shaping.test_brevity.per_token=1: x rollout.max_response_tokens=64 > 50"):
        load_config("demo", [*base, "reward.shaping.test_brevity.per_token=1", "rollout.max_response_tokens=64"])
    assert load_config("demo", [*base, "reward.shaping.test_brevity.per_token=1", "rollout.max_response_tokens=32"])
    cfg = load_config("demo", base)
    seen = []
    checks["test_seen_sections"] = lambda data, train: seen.append((data, train)) or []
    assert REWARD_SHAPING.config_problems("test_seen_sections", cfg) == [] and seen == [(cfg.data, cfg.train)]
    checks["test_bad_parameter"] = lambda inputs: []
    with pytest.raises(ValueError, match=r"takes parameter 'inputs', which is not a section of the config"):
        REWARD_SHAPING.config_problems("test_bad_parameter", cfg)


def test_score_rollout_sums_the_parts_and_reports_each(plugin):
    cfg = RewardConfig(name="test_letter_e", shaping={"test_brevity": {"per_token": 0.1}, "overlong": {"buffer_tokens": 4}})
    scored = score_rollout(_rollout([2, 7, 10]), _Tok(), cfg, max_response_tokens=10)
    # overlong: ramp over tokens 7-10 (budget 10, buffer 4): 2 -> 0, 7 -> -0.25, 10 -> -1
    assert scored.parts["overlong"].tolist() == pytest.approx([0.0, -0.25, -1.0])
    assert scored.parts["test_brevity"].tolist() == pytest.approx([-0.2, -0.7, -1.0])
    assert scored.parts["test_brevity/tokens"].tolist() == [2.0, 7.0, 10.0]  # a term: reported, not added
    torch.testing.assert_close(scored.rewards, scored.scores + scored.parts["overlong"] + scored.parts["test_brevity"])
    # a part set to null is off
    off = score_rollout(_rollout([2]), _Tok(), RewardConfig(name="test_letter_e", shaping={"test_brevity": None}), 10)
    assert off.parts == {} and torch.equal(off.rewards, off.scores)


def test_a_part_that_breaks_the_contract_is_named(plugin):
    with pytest.raises(ValueError, match=r"reward.shaping part 'test_bad_shape' returned torch.Size\(\[1\]\) for 3 responses"):
        score_rollout(_rollout([1, 2, 3]), _Tok(), RewardConfig(name="test_letter_e", shaping={"test_bad_shape": {}}), 10)
    assert "test_bad_shape" in REWARD_SHAPING


def test_a_run_reports_every_part(tmp_path, plugin, smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=1", "reward.name=test_letter_e", f"trainer.plugins=[{plugin}]", "reward.shaping.test_brevity.per_token=0.01",
        "reward.shaping.overlong.buffer_tokens=8"])
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["reward/test_brevity/mean"] == pytest.approx(-0.01 * line["reward/test_brevity/tokens/mean"])
    assert line["reward/overlong/mean"] <= 0
    assert line["critic/rewards/mean"] == pytest.approx(
        line["critic/score/mean"] + line["reward/test_brevity/mean"] + line["reward/overlong/mean"], abs=1e-5)


def test_the_module_names_every_built_in_part():
    """`packrl.reward.shaping`'s list of built-ins is the registry's."""
    import packrl.reward.shaping as shaping

    built_in = REWARD_SHAPING._builtins
    assert len(built_in) == 6 and [name for name in built_in if f"``{name}``" not in (shaping.__doc__ or "")] == []

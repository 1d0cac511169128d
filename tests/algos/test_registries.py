"""Open registries: a policy loss and a token-level advantage estimator registered from this file
train by name; unknown names fail at config load naming the nearest registered one; a plugin file
named in trainer.plugins registers its parts before the names are checked."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from packrl.algos.advantages import AdvantageInputs
from packrl.algos.policy_losses import PolicyLossInputs, PolicyLossOutput
from packrl.config import ConfigError, load_config
from packrl.registry import ADVANTAGE_ESTIMATORS, CONFIG_REGISTRIES, POLICY_LOSSES
from tests.diagnostics.tiny_run import tiny_policy, tiny_run  # noqa: F401  (also registers reward test_letter_e)

CALLS = {"loss": 0, "estimator": 0}


@POLICY_LOSSES.register("test_reinforce")
def reinforce(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """REINFORCE without a ratio: -A log pi per token, and the share of tokens with A > 0."""
    CALLS["loss"] += 1
    positive = (inputs.advantages > 0).float()
    return PolicyLossOutput(-inputs.advantages * inputs.logprobs,
                            metrics={"actor/test_positive_frac": inputs.denominators.token_share(positive, inputs.loss_mask)})


@ADVANTAGE_ESTIMATORS.register("test_discounted")
def discounted(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """Token-level: the group-centred reward discounted by 0.9 per token before the response's end."""
    CALLS["estimator"] += 1
    rewards = inputs.rewards.view(-1, inputs.group_size)
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).view(-1)
    out = []
    for value, mask in zip(centred, inputs.response_masks):
        n = len(mask)
        out.append(value * 0.9 ** torch.arange(n - 1, -1, -1, dtype=torch.float32))
    return tuple(out)


def test_a_registered_loss_and_token_level_estimator_train_two_steps(tmp_path, smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    CALLS.update(loss=0, estimator=0)
    run_dir, workers = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=2", "reward.name=test_letter_e", "algorithm.policy_loss=test_reinforce",
        "algorithm.adv_estimator=test_discounted", "train.dump_rollouts=true", "train.lr=1e-2",
    ])
    assert CALLS["estimator"] == 2 and CALLS["loss"] >= 2
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert 0.0 <= line["actor/test_positive_frac"] <= 1.0  # summed shares: a fraction of the mini-batch's tokens
        assert line["actor/pg_clipfrac"] == 0.0  # the loss has no clip
        assert line["critic/advantages/max"] != line["critic/advantages/min"]
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert any(d["advantage"] != 0.0 for d in dumped)


@pytest.mark.parametrize("key, typo, nearest", [
    ("algorithm.policy_loss", "test_reinfroce", "test_reinforce"),
    ("algorithm.adv_estimator", "grop", "grpo"),
    ("rollout.engine", "hff", "hf"),
    ("reward.name", "gsm8", "gsm8k"),
])
def test_an_unknown_name_fails_at_config_load_with_the_nearest(key, typo, nearest):
    with pytest.raises(ConfigError, match=rf"{key}='{typo}': is not a registered .*did you mean {key}={nearest}\?"):
        load_config("demo", [f"{key}={typo}"])


def test_every_builtin_module_registers_the_names_it_is_listed_under():
    for registry in CONFIG_REGISTRIES.values():
        for name in registry._builtins:
            assert callable(registry.lookup(name)), f"{registry.key}={name}"


def test_a_plugin_file_registers_before_names_are_checked(tmp_path):
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(textwrap.dedent('''
        from packrl.algos.policy_losses import PolicyLossOutput, ppo_clip
        from packrl.registry import POLICY_LOSSES

        @POLICY_LOSSES.register("test_plugin_clip")
        def plugin_clip(inputs):
            return ppo_clip(inputs)
    '''))
    with pytest.raises(ConfigError, match="algorithm.policy_loss='test_plugin_clip': is not a registered policy loss"):
        load_config("demo", ["algorithm.policy_loss=test_plugin_clip"])
    cfg = load_config("demo", ["algorithm.policy_loss=test_plugin_clip", f"trainer.plugins=[{plugin}]"])
    assert POLICY_LOSSES.lookup(cfg.algorithm.policy_loss).__name__ == "plugin_clip"
    load_config("demo", ["algorithm.policy_loss=test_plugin_clip", f"trainer.plugins=[{plugin}]"])  # a second import is harmless
    with pytest.raises(ConfigError, match=r"trainer.plugins='.*nope.py': cannot be imported \(FileNotFoundError"):
        load_config("demo", [f"trainer.plugins=[{tmp_path / 'nope.py'}]"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half-written plugin')\n")
    with pytest.raises(ConfigError, match=r"cannot be imported \(RuntimeError: half-written plugin\)"):
        load_config("demo", [f"trainer.plugins=[{broken}]"])


def test_a_name_registered_twice_for_another_part_is_refused():
    with pytest.raises(ValueError, match="policy loss 'ppo_clip' is already registered"):
        POLICY_LOSSES.register("ppo_clip")(lambda inputs: None)


@POLICY_LOSSES.register("test_bare_tensor")
def _bare_tensor(inputs):
    return -inputs.advantages * inputs.logprobs


@POLICY_LOSSES.register("test_detached")
def _detached(inputs):
    return PolicyLossOutput(-inputs.advantages * inputs.logprobs.detach())


@POLICY_LOSSES.register("test_short_clip")
def _short_clip(inputs):
    return PolicyLossOutput(-inputs.advantages * inputs.logprobs, clipped=inputs.loss_mask[:3])


@pytest.mark.parametrize("name, what", [
    ("test_bare_tensor", "returned a Tensor, not a PolicyLossOutput"),
    ("test_detached", "returned a token loss without a gradient"),
    ("test_short_clip", r"returned clipped of Shape \(3,\)"),
])
def test_a_loss_that_breaks_the_contract_is_named(name, what, smollm_tokenizer):
    from types import SimpleNamespace

    from packrl.distributed.local import local_group
    from packrl.trainer.batch import build_train_batch
    from tests.builders import scored_batch
    from tests.conftest import tiny_llama

    cfg = load_config("demo", ["model.dtype=fp32", "data.batch_size=2", f"algorithm.policy_loss={name}"])
    workers = local_group(cfg, tiny_llama(), SimpleNamespace(eos_token_id=2, pad_token_id=0))
    batch, _ = build_train_batch(scored_batch(), None, None, cfg.algorithm)
    with pytest.raises(ValueError, match=rf"algorithm.policy_loss='{name}' {what}.*return PolicyLossOutput"):
        workers.update(batch)


def test_an_engine_factory_that_returns_no_engine_is_named():
    from types import SimpleNamespace

    from packrl.distributed.local import local_group
    from packrl.registry import ROLLOUT_ENGINES
    from tests.conftest import tiny_llama

    ROLLOUT_ENGINES.register("test_not_an_engine")(lambda context: object())
    cfg = load_config("demo", ["model.dtype=fp32", "rollout.engine=test_not_an_engine"])
    with pytest.raises(ValueError, match=r"rollout.engine='test_not_an_engine': its factory returned a object without generate"):
        local_group(cfg, tiny_llama(), SimpleNamespace(eos_token_id=2, pad_token_id=0))


PLUGIN_WITH_OPTIONS = '''
from dataclasses import dataclass

import torch

from packrl.algos.policy_losses import PolicyLossOutput
from packrl.errors import ConfigProblem
from packrl.registry import POLICY_LOSSES


@dataclass(frozen=True)
class ScaledOptions:
    beta: float = 1.0
    """Weight of -A log pi."""

    def problems(self, prefix):
        return [] if self.beta > 0 else [ConfigProblem(f"{prefix}.beta", self.beta, "must be > 0", f"set {prefix}.beta=1.0")]


@POLICY_LOSSES.register("test_scaled_reinforce", options=ScaledOptions)
def scaled(inputs):
    beta = inputs.options.beta
    share = inputs.denominators.token_share(torch.full_like(inputs.logprobs, beta), inputs.loss_mask)
    return PolicyLossOutput(-beta * inputs.advantages * inputs.logprobs, metrics={"actor/test_beta": share})
'''


def test_a_plugin_loss_with_its_own_knobs_is_checked_at_load_and_reads_them(tmp_path, smollm_tokenizer):
    """The newcomer's task of docs/design.md: one file registers a loss and its options; the
    config sets them under algorithm.policy_loss_args, checked at load; the loss reads them."""
    plugin = tmp_path / "scaled_loss.py"
    plugin.write_text(PLUGIN_WITH_OPTIONS)
    base = ["algorithm.policy_loss=test_scaled_reinforce", f"trainer.plugins=[{plugin}]"]
    with pytest.raises(ConfigError, match=r"policy_loss_args.bta=2: unknown key; fix: did you mean algorithm.policy_loss_args.beta\?"):
        load_config("demo", [*base, "algorithm.policy_loss_args.bta=2"])
    with pytest.raises(ConfigError, match=r"policy_loss_args.beta=-1.0: must be > 0; fix: set algorithm.policy_loss_args.beta=1.0"):
        load_config("demo", [*base, "algorithm.policy_loss_args.beta=-1"])
    with pytest.raises(ConfigError, match=r"policy_loss_args.beta='x': must be a number"):
        load_config("demo", [*base, "algorithm.policy_loss_args.beta=x"])
    with pytest.raises(ConfigError, match=r"has no effect: algorithm.policy_loss=ppo_clip reads no options"):
        load_config("demo", [f"trainer.plugins=[{plugin}]", "algorithm.policy_loss_args.beta=2"])
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=1", "reward.name=test_letter_e", *base, "algorithm.policy_loss_args.beta=2.5"])
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["actor/test_beta"] == pytest.approx(2.5)  # summed token shares of a constant: the constant

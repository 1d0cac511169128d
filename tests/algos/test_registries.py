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
    with pytest.raises(ConfigError, match=r"policy_loss_args.beta=2: unknown key: algorithm.policy_loss=ppo_clip does not read it, "
                                          r"test_scaled_reinforce does; fix: set algorithm.policy_loss=test_scaled_reinforce, or remove"):
        load_config("demo", [f"trainer.plugins=[{plugin}]", "algorithm.policy_loss_args.beta=2"])
    with pytest.raises(ConfigError, match=r"has no effect: algorithm.policy_loss=gspo reads no options"):
        load_config("demo", [f"trainer.plugins=[{plugin}]", "algorithm.policy_loss=gspo", "algorithm.policy_loss_args.beta=2"])
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=1", "reward.name=test_letter_e", *base, "algorithm.policy_loss_args.beta=2.5"])
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["actor/test_beta"] == pytest.approx(2.5)  # summed token shares of a constant: the constant


PLUGIN_WITH_INFO = '''
from packrl.algos.policy_losses import ppo_clip
from packrl.capabilities import LossInfo
from packrl.registry import POLICY_LOSSES


def count_minibatches(batch, minibatches, cfg, seed):
    """A controller-side prepare: the batch as it is, and what it was called with as metrics."""
    return batch, {"actor/test_minibatches": float(len(minibatches)), "actor/test_seed": float(seed)}


POLICY_LOSSES.register("test_old_reader", info=LossInfo(reads_old_logprobs=True, prepare=f"{__name__}:count_minibatches"))(
    lambda inputs: ppo_clip(inputs))
POLICY_LOSSES.register("test_lost_prepare", info=LossInfo(prepare=f"{__name__}:no_such_function"))(lambda inputs: ppo_clip(inputs))
'''


def test_a_plugin_loss_declares_what_it_needs_and_the_plan_and_the_update_read_it(tmp_path):
    """A loss's `LossInfo` (registered with it) turns the old-log-prob pass on and names the
    controller-side prepare the worker group runs once per update; a loss that declares nothing
    gets the defaults, and a declaration of another type is refused when it registers."""
    from packrl.algos.policy_losses import prepare_update
    from packrl.capabilities import COV_LOSS, TOKEN_LOSS, LossInfo, RolloutModeInfo
    from packrl.config.plan import BatchPlan

    plugin = tmp_path / "old_reader.py"
    plugin.write_text(PLUGIN_WITH_INFO)
    cfg = load_config("demo", ["algorithm.policy_loss=test_old_reader", f"trainer.plugins=[{plugin}]"])
    plan = BatchPlan.from_config(cfg)
    assert plan.needs_old_logprobs and plan.old_logprobs_reason == "algorithm.policy_loss=test_old_reader reads them"
    batch = object()  # prepare_update hands the batch to the loss's prepare as it is
    assert prepare_update(batch, [[0, 1], [2]], cfg.algorithm, seed=7) == (batch, {"actor/test_minibatches": 2.0, "actor/test_seed": 7.0})
    assert prepare_update(batch, [[0]], load_config("demo").algorithm, seed=7) == (batch, {})  # ppo_clip declares no prepare
    assert not BatchPlan.from_config(load_config("demo")).needs_old_logprobs
    lost = load_config("demo", ["algorithm.policy_loss=test_lost_prepare", f"trainer.plugins=[{plugin}]"])
    assert not BatchPlan.from_config(lost).needs_old_logprobs  # it declared a prepare, not that it reads the old log-probs
    with pytest.raises(ValueError, match=r"algorithm.policy_loss=test_lost_prepare's LossInfo\(prepare=\) names 'packrl_plugin_old_"
                                         r"reader_.*:no_such_function', which cannot be imported \(module"):
        prepare_update(batch, [[0]], lost.algorithm, seed=7)
    assert POLICY_LOSSES.info("test_reinforce") == LossInfo()  # registered above without a declaration
    assert (POLICY_LOSSES.info("ppo_clip"), POLICY_LOSSES.info("kl_cov")) == (TOKEN_LOSS, COV_LOSS)
    with pytest.raises(ValueError, match=r"algorithm.policy_loss='test_misdeclared' registered info=RolloutModeInfo\(.*\); "
                                         r"declare a LossInfo"):
        POLICY_LOSSES.register("test_misdeclared", info=RolloutModeInfo())(reinforce)
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='test_misdeclared' registered info=LossInfo\(.*\); the parts of "
                                         r"ADVANTAGE_ESTIMATORS declare nothing: remove info="):
        ADVANTAGE_ESTIMATORS.register("test_misdeclared", info=LossInfo())(discounted)
    with pytest.raises(ValueError, match=r"LossInfo\(prepare='count_minibatches'\): a 'module:function' string, or None"):
        LossInfo(prepare="count_minibatches")
    with pytest.raises(ValueError, match="is not a registered policy loss"):
        POLICY_LOSSES.info("test_no_such_loss")


def test_a_built_in_losss_declaration_is_read_without_importing_it():
    """The plan reads whether Clip-Cov reads the old log-probs from the registry's listing
    (`packrl.capabilities.COV_LOSS`): planning a run does not import the loss's module."""
    import subprocess
    import sys

    code = ("import sys; from packrl.config.plan import BatchPlan; from packrl.config import load_config; "
            "plan = BatchPlan.from_config(load_config('demo', ['algorithm.policy_loss=clip_cov'])); "
            "assert plan.needs_old_logprobs, plan; "
            "print(sorted(m for m in sys.modules if m.startswith('packrl.algos')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

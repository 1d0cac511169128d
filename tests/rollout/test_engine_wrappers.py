"""Engine wrappers are registered parts: each declares when it applies, its order, the engine
capabilities it keeps and its preflight hooks (`packrl.capabilities.WrapperInfo`); set-up wraps
the run's engine with every wrapper that applies, preflight lists their notes and problems, and
neither names a wrapper. A wrapper of your own is one plugin file."""

from __future__ import annotations

import json
import sys

import pytest

from packrl.capabilities import HF_ENGINE, EngineCapabilities, WrapperInfo
from packrl.config import load_config
from packrl.registry import ENGINE_WRAPPERS
from packrl.rollout.engine import active_wrappers, engine_capabilities, wrapper_notes
from packrl.testing import forget_parts, write_plugin
from tests.diagnostics.tiny_run import tiny_run

PLUGIN = '''
from packrl.capabilities import WrapperInfo
from packrl.registry import ENGINE_WRAPPERS
from packrl.rollout.engine import EngineWrapper

CALLS = []


def applies(rollout):
    return rollout.top_k == 7


def notes(rollout, data):
    return [f"test_counting wraps rollout.engine={rollout.engine} (data.batch_size={data.batch_size})"]


class Counting(EngineWrapper):
    def generate(self, prompt_ids, params, seeds, extra_inputs=None):
        CALLS.append(len(prompt_ids))
        return self.engine.generate(prompt_ids, params, seeds)


@ENGINE_WRAPPERS.register("test_counting", info=WrapperInfo(applies=f"{__name__}:applies", order=5, keeps=("modalities",),
                                                             preflight_notes=f"{__name__}:notes"))
def counting(engine, context):
    return Counting(engine)
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    yield write_plugin(tmp_path_factory.mktemp("plugin"), "counting.py", PLUGIN)
    forget_parts(ENGINE_WRAPPERS, "test_counting")


def _module(path) -> object:
    return next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))


def test_the_built_in_wrappers_declare_when_they_apply_and_keep_nothing():
    assert {n for n in ENGINE_WRAPPERS.names() if not n.startswith("test_")} == {"multi_turn", "thinking"}
    tools = load_config("arithmetic_tool").rollout
    assert active_wrappers(tools) == ["multi_turn"] and engine_capabilities(tools) == EngineCapabilities()
    thinking = load_config("demo", ["rollout.think_budget_tokens=8", "rollout.answer_budget_tokens=8"]).rollout
    assert active_wrappers(thinking) == ["thinking"] and engine_capabilities(thinking) == EngineCapabilities()
    plain = load_config("demo").rollout
    assert active_wrappers(plain) == [] and engine_capabilities(plain) == HF_ENGINE
    assert any("does not hold '</tool_call>'" in n for n in wrapper_notes(load_config("arithmetic_tool", ["rollout.stop=[]"])))


def test_a_plugin_wrapper_applies_keeps_what_it_declares_and_wraps_the_run(tmp_path, plugin, smollm_tokenizer):
    on = load_config("demo", [f"trainer.plugins=[{plugin}]", "rollout.top_k=7"])
    assert active_wrappers(on.rollout) == ["test_counting"]
    assert engine_capabilities(on.rollout) == EngineCapabilities(modalities=HF_ENGINE.modalities)  # kept; the rest dropped
    assert wrapper_notes(on) == ["test_counting wraps rollout.engine=hf (data.batch_size=8)"]
    assert active_wrappers(load_config("demo", [f"trainer.plugins=[{plugin}]"]).rollout) == []
    module = _module(plugin)
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, ["train.total_steps=1", f"trainer.plugins=[{plugin}]", "rollout.top_k=7"])
    assert module.CALLS == [2] and json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


@pytest.mark.parametrize(("declared", "message"), [
    (dict(keeps=("images",)), r"\['images'\] are not EngineCapabilities fields"),
    (dict(applies="no_colon"), r"WrapperInfo\(applies='no_colon'\): a 'module:function' string"),
    (dict(keeps="modalities"), r"WrapperInfo\(keeps='modalities'\): a tuple of EngineCapabilities fields"),
    (dict(order="last"), r"WrapperInfo\(order='last'\): an int"),
])
def test_a_malformed_declaration_is_refused_where_it_is_written(declared, message):
    with pytest.raises(ValueError, match=message):
        WrapperInfo(**declared)


def test_a_wrapper_that_breaks_the_contract_is_named(plugin):
    from packrl.rollout.engine import WrapperContext, wrap_engine

    ENGINE_WRAPPERS.register("test_broken", info=WrapperInfo(applies=f"{__name__}:_top_k_is_9"))(lambda engine, context: object())
    try:
        rollout = load_config("demo", ["rollout.top_k=9"]).rollout
        with pytest.raises(ValueError, match=r"engine wrapper 'test_broken' returned a object without the methods"):
            wrap_engine(object(), WrapperContext(None, rollout, 64, 128))
    finally:
        forget_parts(ENGINE_WRAPPERS, "test_broken")


def test_a_wrapper_whose_predicate_does_not_exist_is_named():
    ENGINE_WRAPPERS.register("test_lost", info=WrapperInfo(applies=f"{__name__}:no_such_function"))(lambda engine, context: engine)
    try:
        with pytest.raises(ValueError, match=r"the engine wrapper test_lost's WrapperInfo\(applies=\) names "
                                             r"'tests.rollout.test_engine_wrappers:no_such_function', which cannot be imported"):
            active_wrappers(load_config("demo").rollout)
    finally:
        forget_parts(ENGINE_WRAPPERS, "test_lost")


def _top_k_is_9(rollout) -> bool:
    return rollout.top_k == 9

"""Engine capabilities are declared with an engine's registration and read by set-up, preflight and
the worker: a plugin engine that declares images serves a vision-language policy through preflight
and set-up alike; one that declares nothing is refused by both with the same keyed problem; one
that declares what it lacks is named at set-up."""

from __future__ import annotations

import pytest

from packrl.config import ConfigError, load_config
from packrl.registry import ROLLOUT_ENGINES, import_plugins
from packrl.rollout.engine import EngineCapabilities, engine_capabilities
from tests.vlm import save_tiny_vlm

PLUGIN = '''
from packrl.registry import ROLLOUT_ENGINES
from packrl.rollout.engine import EngineCapabilities
from packrl.rollout.hf_engine import build_hf_engine


class TextOnly:
    """The hf engine behind a generate() without extra_inputs=."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, prompt_ids, params, seeds):
        return self.inner.generate(prompt_ids, params, seeds)

    def load_weights(self, weights):
        self.inner.load_weights(weights)

    def sleep(self):
        self.inner.sleep()

    def wake_up(self):
        self.inner.wake_up()

    def close(self):
        self.inner.close()


IMAGES = EngineCapabilities(modalities=("image",))
ROLLOUT_ENGINES.register("test_images", info=IMAGES)(build_hf_engine)
ROLLOUT_ENGINES.register("test_text")(lambda context: TextOnly(build_hf_engine(context)))
ROLLOUT_ENGINES.register("test_claims_images", info=IMAGES)(lambda context: TextOnly(build_hf_engine(context)))


def kv_notes(options, *, max_context_tokens, kv_bytes_per_token, dtype, cuda):
    return [f"test_noted engine: {options.max_num_seqs} x {max_context_tokens:,} tokens x {kv_bytes_per_token:,} bytes in {dtype}"]


ROLLOUT_ENGINES.register("test_noted", info=EngineCapabilities(preflight_notes=f"{__name__}:kv_notes"))(build_hf_engine)
ROLLOUT_ENGINES.register("test_stops", info=EngineCapabilities(stop_on_condition=True))(build_hf_engine)
ROLLOUT_ENGINES.register("test_broken_notes", info=EngineCapabilities(preflight_notes="no_such_module_here:notes"))(build_hf_engine)
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("engines") / "engines.py"
    path.write_text(PLUGIN)
    assert import_plugins([str(path)]) == []
    return path


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, smollm_tokenizer):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


def test_the_built_in_engines_declare_what_they_can_do():
    from packrl.config.schema import MultiTurnConfig, RolloutConfig

    assert engine_capabilities(RolloutConfig(engine="hf")) == EngineCapabilities(
        modalities=("image",), stop_on_condition=True, shares_policy_weights=True, packs_cpu_weights=True)
    vllm = engine_capabilities(RolloutConfig(engine="vllm"))
    assert (vllm.modalities, vllm.stop_on_condition, vllm.shares_policy_weights) == ((), False, False)
    assert vllm.preflight_notes == "packrl.rollout.vllm_settings:preflight_notes"
    tools = RolloutConfig(engine="hf", multi_turn=MultiTurnConfig(tools=["calculator"]))
    assert engine_capabilities(tools) == EngineCapabilities()  # trajectories are generated from text, turn by turn
    assert ROLLOUT_ENGINES.info("hf").modalities == ("image",)


def _setup(cfg):
    from packrl.config.plan import BatchPlan
    from packrl.worker.policy import PolicyWorker

    worker = PolicyWorker(cfg, BatchPlan.from_config(cfg))
    try:
        worker.setup()
    finally:
        worker.close()


def test_preflight_and_set_up_read_the_declared_capability(tmp_path, plugin, vlm_dir):
    from packrl.inspect.preflight import preflight

    base = ["vision_demo", f"model.path={vlm_dir}", "model.dtype=fp32", f"trainer.plugins=[{plugin}]"]
    declared = preflight(base[0], [*base[1:], "rollout.engine=test_images"])
    assert not [p for p in declared.problems if p.key == "rollout.engine"]
    _setup(load_config(base[0], [*base[1:], "rollout.engine=test_images", f"train.out_dir={tmp_path / 'a'}"]))

    undeclared = preflight(base[0], [*base[1:], "rollout.engine=test_text"])
    (problem,) = [p for p in undeclared.problems if p.key == "rollout.engine"]
    assert "does not generate from images" in problem.message and problem.fix == "set rollout.engine=hf"
    with pytest.raises(ConfigError, match=r"rollout.engine='test_text': does not generate from images"):
        _setup(load_config(base[0], [*base[1:], "rollout.engine=test_text", f"train.out_dir={tmp_path / 'b'}"]))


def test_an_engine_that_lacks_what_it_declares_is_named_at_set_up(tmp_path, plugin):
    from types import SimpleNamespace

    from packrl.distributed.local import local_group
    from tests.conftest import tiny_llama

    cfg = load_config("demo", ["model.dtype=fp32", "rollout.engine=test_claims_images", f"trainer.plugins=[{plugin}]"])
    with pytest.raises(ValueError, match=r"rollout.engine='test_claims_images' declares EngineCapabilities\(modalities=\('image',\)\) "
                                         r"but its generate\(\) takes no extra_inputs="):
        local_group(cfg, tiny_llama(), SimpleNamespace(eos_token_id=2, pad_token_id=0))


def test_preflight_and_the_rules_read_what_a_plugin_engine_declares(plugin):
    """An engine's own preflight notes (`EngineCapabilities.preflight_notes`) are preflight's, and a
    rule about generating in one stopped call reads ``stop_on_condition``, not the engine's name."""
    from packrl.inspect.preflight import preflight
    from tests.conftest import SMOLLM_DIR, skip_without_shared

    skip_without_shared(SMOLLM_DIR / "config.json")
    base = ["demo", f"model.path={SMOLLM_DIR}", f"trainer.plugins=[{plugin}]"]
    report = preflight(base[0], [*base[1:], "rollout.engine=test_noted", "model.dtype=fp32"])
    assert any(note.startswith("test_noted engine: ") and "bytes in fp32" in note for note in report.notes), report.notes
    with pytest.raises(ValueError, match=r"rollout.engine=test_broken_notes: its EngineCapabilities.preflight_notes="
                                         r"'no_such_module_here:notes' failed \(ModuleNotFoundError"):
        preflight(base[0], [*base[1:], "rollout.engine=test_broken_notes", "model.dtype=fp32"])
    chunked = ["trainer.rollout_mode=colocate_async", "rollout.partial_chunk_tokens=32"]
    with pytest.raises(ConfigError, match=r"rollout.partial_chunk_tokens=32: has no effect: rollout.engine=test_stops on one rank"):
        load_config(base[0], [*base[1:], "rollout.engine=test_stops", *chunked])
    load_config(base[0], [*base[1:], "rollout.engine=test_noted", *chunked])  # chunks serve an engine that cannot stop a call


def test_an_engine_that_declares_something_else_is_refused_when_it_registers():
    """A declaration of another type never reaches a reader: the registry refuses it, naming the
    engine and the class it takes, so every reader takes the declaration as typed."""
    from packrl.capabilities import RolloutModeInfo
    from packrl.rollout.hf_engine import build_hf_engine

    for bad in ({"stop_on_condition": True}, RolloutModeInfo()):
        with pytest.raises(ValueError, match=r"rollout.engine='test_bad_info' registered info=.*; declare an EngineCapabilities"):
            ROLLOUT_ENGINES.register("test_bad_info", info=bad)(build_hf_engine)
    assert "test_bad_info" not in ROLLOUT_ENGINES
    ROLLOUT_ENGINES.register("test_declares_nothing")(build_hf_engine)
    assert ROLLOUT_ENGINES.info("test_declares_nothing") == EngineCapabilities()


def test_an_engine_with_generate_until_that_does_not_declare_it_is_warned(caplog):
    """A subclass of the hf engine registered without its declaration keeps working (partial
    rollouts chunk) and the log says how to declare what it has."""
    import logging

    from packrl.rollout.engine import check_capabilities

    class Stoppable:
        def generate(self, prompt_ids, params, seeds):
            return []

        def generate_until(self, prompt_ids, params, seeds, caps, enough):
            return []

    with caplog.at_level(logging.WARNING, logger="packrl.rollout.engine"):
        check_capabilities(Stoppable(), "test_stoppable", EngineCapabilities())
    assert "rollout.engine=test_stoppable has generate_until() but its registration does not declare stop_on_condition" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="packrl.rollout.engine"):
        check_capabilities(Stoppable(), "test_stoppable", EngineCapabilities(stop_on_condition=True))
    assert caplog.text == ""


@pytest.mark.parametrize(("declared", "message"), [
    ({"modalities": "image"}, r"modalities='image'\): a tuple of modality names"),
    ({"stop_on_condition": "no"}, r"stop_on_condition='no'\): True or False"),
    ({"preflight_notes": "notes"}, r"preflight_notes='notes'\): a 'module:function' string"),
])
def test_a_malformed_declaration_is_refused_where_it_is_written(declared, message):
    with pytest.raises(ValueError, match=message):
        EngineCapabilities(**declared)


def test_a_declared_preflight_hook_that_fails_is_named_with_its_signature():
    """The one call of a part's declared preflight hook (an engine's notes, a modality's checks)."""
    from packrl.inspect.preflight import _call_hook

    with pytest.raises(ValueError, match=r"model.path=m: its Modality.preflight='packrl.capabilities:nothing' failed \(AttributeError.*"
                                         r"taking \(model, data, train, room\)"):
        _call_hook("model.path=m: its Modality.preflight", "packrl.capabilities:nothing", "(model, data, train, room)")
    assert _call_hook("x", "packrl.capabilities:EngineCapabilities", "()") == EngineCapabilities()


def test_the_engine_options_come_from_the_sections_an_engine_reads():
    """`EngineOptions.of_sections` takes the four sections it reads; the engine contract's module
    names no `RunConfig` (components below the trainer take their sections)."""
    from pathlib import Path

    import packrl.rollout.engine as contract
    from packrl.rollout.engine import EngineOptions

    cfg = load_config("demo", ["rollout.max_num_seqs=3", "train.seed=5", "rollout.top_k=4", "rollout.engine_kwargs.x=1",
                               "algorithm.rollout_correction.rollout_is=token"])
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    assert options == EngineOptions(max_num_seqs=3, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                    max_response_tokens=cfg.rollout.max_response_tokens, seed=5, engine_kwargs={"x": 1},
                                    returns_logprobs=True, truncates_sampling=True)
    assert "RunConfig" not in Path(contract.__file__).read_text()

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

    assert engine_capabilities(RolloutConfig(engine="hf")) == EngineCapabilities(modalities=("image",), stop_on_condition=True)
    assert engine_capabilities(RolloutConfig(engine="vllm")) == EngineCapabilities()
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

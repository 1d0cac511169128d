"""A filter of your own is one plugin file: its options are checked at load under
``algorithm.filters.<name>``, it runs in its stage in every rollout mode that runs that stage, and
what it takes out is counted and dumped with its name; a sampling filter is refused under a mode
that runs no sampling filters."""

from __future__ import annotations

import json

import pytest

from packrl.algos.filters import filter_chain
from packrl.config import ConfigError, load_config
from packrl.registry import FILTERS
from packrl.testing import forget_parts, write_plugin
from tests.diagnostics.tiny_run import tiny_run

PLUGIN = '''
from dataclasses import dataclass

from packrl.algos.filters import FilterInputs, FilterOutput
from packrl.capabilities import FilterInfo
from packrl.errors import ConfigProblem
from packrl.registry import FILTERS


@dataclass(frozen=True)
class EveryOther:
    period: int = 2

    def problems(self, prefix):
        return [] if self.period >= 2 else [ConfigProblem(f"{prefix}.period", self.period, "must be >= 2",
                                                          f"set {prefix}.period=2")]


@FILTERS.register("test_every_other", options=EveryOther, info=FilterInfo(stage="loss", order=5))
def every_other(inputs: FilterInputs) -> FilterOutput:
    keep = tuple(i % inputs.options.period != 0 for i in range(len(inputs.masks)))
    return FilterOutput(keep=keep, metrics={"filter/test_every_other/period": float(inputs.options.period)})


@FILTERS.register("test_even_rows", info=FilterInfo(stage="sampling"))
def even_rows(inputs: FilterInputs) -> FilterOutput:
    rollout = inputs.scored.rollout
    return FilterOutput(keep=tuple(rollout.prompts.rows[i // rollout.group_size] % 2 == 0 for i in range(len(rollout.responses))),
                        max_rounds=4)
'''
NAMES = ("test_every_other", "test_even_rows")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    yield write_plugin(tmp_path_factory.mktemp("plugin"), "filters.py", PLUGIN)
    forget_parts(FILTERS, *NAMES)  # the other modules' tests see the built-in filters alone


def test_its_options_and_its_mode_are_checked_at_load(plugin):
    base = [f"trainer.plugins=[{plugin}]"]
    with pytest.raises(ConfigError, match=r"algorithm.filters.test_every_other.period=1: must be >= 2"):
        load_config("demo", [*base, "algorithm.filters.test_every_other.period=1"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.test_every_other.perod=3: unknown key; fix: did you mean "
                                          r"algorithm.filters.test_every_other.period\?"):
        load_config("demo", [*base, "algorithm.filters.test_every_other.perod=3"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.test_even_rows=\{\}: does not run under "
                                          r"trainer.rollout_mode=colocate_async \(it runs under sync\)"):
        load_config("demo", [*base, "algorithm.filters.test_even_rows={}", "trainer.rollout_mode=colocate_async"])
    cfg = load_config("demo", [*base, "algorithm.filters.test_every_other={}", "algorithm.filters.entropy.quantile=0.5"])
    assert [f.name for f in filter_chain(cfg.algorithm, "loss")] == ["test_every_other", "rollout_correction", "entropy"]
    assert filter_chain(cfg.algorithm, "loss")[0].options.period == 2


@pytest.mark.parametrize("mode", [["trainer.rollout_mode=sync"], ["trainer.rollout_mode=colocate_async", "rollout.over_provision=1"]])
def test_a_loss_filter_runs_in_every_mode_and_what_it_takes_is_dumped_with_its_name(tmp_path, plugin, smollm_tokenizer, mode):
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=2", f"trainer.plugins=[{plugin}]", "algorithm.filters.test_every_other.period=3",
        "train.dump_rollouts=true", *mode])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{line['step']}.jsonl").read_text().splitlines()]
        assert [r["filtered"] for r in rows] == ["test_every_other" if r["index"] % 3 == 0 else None for r in rows]
        assert line["filter/test_every_other/dropped"] == len(range(0, len(rows), 3)) and line["filter/test_every_other/period"] == 3


def test_a_sampling_filter_refills_the_batch_from_further_rounds(tmp_path, plugin, smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=1", f"trainer.plugins=[{plugin}]", "algorithm.filters.test_even_rows={}", "train.dump_rollouts=true",
        "data.shuffle=false"])
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    rows = [json.loads(x) for x in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert {r["row"] % 2 for r in rows} == {0} and line["train/num_dropped_prompts/test_even_rows"] >= 1
    assert line["train/num_gen_batches"] >= 2 and line["train/update_batch_prompts"] == 2


def test_a_value_that_is_not_a_mapping_and_a_malformed_declaration_are_refused():
    from packrl.capabilities import FilterInfo

    for value in ("5", "abc", "[1,2]"):
        with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo=.*: must be a mapping of the filter's knobs"):
            load_config("demo", [f"algorithm.filters.gfpo={value}"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo.keep=True"):
        load_config("demo", ["algorithm.filters.gfpo.keep=true"])
    for declared, message in ((dict(modes="sync"), r"FilterInfo\(modes='sync'\): a tuple"),
                              (dict(order="first"), r"FilterInfo\(order='first'\): an int"),
                              (dict(stage="bogus"), r"FilterInfo\(stage='bogus'\): one of"),
                              (dict(reads_old_entropy=1), r"FilterInfo\(reads_old_entropy=1\): True or False")):
        with pytest.raises(ValueError, match=message):
            FilterInfo(**declared)
    with pytest.raises(ValueError, match=r"algorithm.filters.test_misdeclared registered info='loss'; declare a FilterInfo"):
        FILTERS.register("test_misdeclared", info="loss")(lambda inputs: None)


def test_a_declared_hook_that_does_not_exist_is_named_with_its_owner(plugin):
    from packrl.capabilities import FilterInfo

    FILTERS.register("test_lost_warnings", info=FilterInfo(warnings=f"{__name__}:no_such_function"))(lambda inputs: None)
    try:
        with pytest.raises(ValueError, match=r"the filter test_lost_warnings's FilterInfo\(warnings=\) names "
                                             r"'tests.algos.test_filter_plugins:no_such_function', which cannot be imported"):
            load_config("demo", ["algorithm.filters.test_lost_warnings={}"])
    finally:
        forget_parts(FILTERS, "test_lost_warnings")

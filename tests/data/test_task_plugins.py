"""Tasks as registered parts: a task of your own is one plugin file (its rows, its traces, its
options); its options are checked at load under data.task_args; a dataset and SFT's traces load its
rows as they load a file's; a task: source that names no registered task, or a task of the other
kind, is a config error naming the nearest one."""

from __future__ import annotations

import pytest

from packrl.config import ConfigError, load_config
from packrl.config.sft_rules import sft_problems
from packrl.config.tasks import task_names
from packrl.data import PromptDataset, load_examples
from packrl.data.task_sources import TaskRequest, read_task
from packrl.registry import TASKS
from packrl.testing import forget_parts, write_plugin
from packrl.trainer.sft import sft_traces

PLUGIN = '''
import random
from dataclasses import dataclass

from packrl.capabilities import TaskInfo
from packrl.errors import ConfigProblem
from packrl.registry import TASKS


@dataclass(frozen=True)
class SumsOptions:
    num_rows: int = 5
    high: int = 10

    def problems(self, prefix):
        return [] if self.num_rows > 0 else [ConfigProblem(f"{prefix}.num_rows", self.num_rows, "must be > 0",
                                                           f"set {prefix}.num_rows=5")]


def _pairs(request):
    rng = random.Random(request.split_seed)
    return [(rng.randrange(request.options.high), rng.randrange(request.options.high)) for _ in range(request.options.num_rows)]


@TASKS.register("test_sums", options=SumsOptions)
def sums(request):
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\\n#### {a + b}"} for a, b in _pairs(request)]


@TASKS.register("test_sums_traces", info=TaskInfo(makes="traces", options_key="data.task_args.test_sums"))
def sums_traces(request):
    return [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": f"#### {a + b}"}]} for a, b in _pairs(request)]
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    yield write_plugin(tmp_path_factory.mktemp("plugin"), "sums.py", PLUGIN)
    forget_parts(TASKS, "test_sums", "test_sums_traces")  # the other modules' tests see the built-in tasks alone


def test_a_task_source_that_names_no_registered_task_is_refused_at_load_with_the_nearest():
    with pytest.raises(ConfigError, match=r"data.train_files=\['task:arithmetc'\]: holds 'task:arithmetc', which is not a "
                                          r"registered task; fix: did you mean task:arithmetic\? registered tasks that make "
                                          r"prompts: task:arithmetic, task:char_count, task:shapes"):
        load_config("demo", ["data.train_files=[task:arithmetc]"])
    with pytest.raises(ConfigError, match=r"data.val_files=.*'task:tool_traces', which is a task that makes traces, read "
                                          r"from sft.train_files, not prompts; fix: move it to sft.train_files"):
        load_config("demo", ["data.val_files=[task:tool_traces]"])
    with pytest.raises(ConfigError, match=r"register one with @packrl.registry.TASKS.register in a file named in trainer.plugins"):
        load_config("demo", ["data.train_files=[task:test_never_registered]"])


def test_the_built_in_tasks_are_registered_parts():
    built_in = {name for name in TASKS.names() if not name.startswith("test_")}  # not the plugins other tests register
    assert built_in == {"arithmetic", "char_count", "shapes", "tool_traces", "char_count_traces"}
    assert built_in & set(task_names("traces")) == {"tool_traces", "char_count_traces"}
    cfg = load_config("demo", ["data.arithmetic.num_rows=9"])
    rows = read_task("task:arithmetic", cfg.data, seed=3, split="train", key="data.train_files")
    assert rows == TASKS["arithmetic"](TaskRequest(options=cfg.data.arithmetic, data=cfg.data, seed=3)) and len(rows) == 9


def test_a_plugin_task_in_one_file_feeds_a_dataset_with_its_checked_options(plugin, smollm_tokenizer):
    base = [f"trainer.plugins=[{plugin}]", "data.train_files=[task:test_sums]", "data.val_files=[task:test_sums]",
            "data.batch_size=2"]
    with pytest.raises(ConfigError, match=r"data.task_args.test_sums.num_rws=7: unknown key; fix: did you mean "
                                          r"data.task_args.test_sums.num_rows\?"):
        load_config("demo", [*base, "data.task_args.test_sums.num_rws=7"])
    with pytest.raises(ConfigError, match=r"data.task_args.test_sums.num_rows=0: must be > 0"):
        load_config("demo", [*base, "data.task_args.test_sums.num_rows=0"])
    with pytest.raises(ConfigError, match=r"data.task_args.test_sumz=.*is not a registered task; fix: did you mean "
                                          r"data.task_args.test_sums\?"):
        load_config("demo", [*base, "data.task_args.test_sumz.num_rows=3"])
    cfg = load_config("demo", [*base, "data.task_args.test_sums.num_rows=7", "data.task_args.test_sums.high=100"])
    dataset = PromptDataset.build(cfg.data.train_files, smollm_tokenizer, cfg.data, seed=cfg.train.seed, split="train",
                                  key="data.train_files")
    assert len(dataset.prompts) == 7 and dataset.accounting.num_kept == 7
    first = dataset.prompts[0].example
    assert first.data_source == "packrl/test_sums" and first.chat[-1]["content"].startswith("What is ")
    assert first.ground_truth == str(eval(first.chat[-1]["content"].removeprefix("What is ").split("?")[0]))
    val = load_examples(cfg.data.val_files, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    assert len(val.examples) == 7 and [e.chat for e in val.examples] != [p.example.chat for p in dataset.prompts]
    defaults = load_config("demo", base)
    assert len(load_examples(defaults.data.train_files, defaults.data, seed=0, split="train", key="k").examples) == 5


def test_a_plugin_task_that_makes_traces_trains_sft_and_is_refused_as_prompts(plugin, smollm_tokenizer):
    base = [f"trainer.plugins=[{plugin}]", "sft.total_steps=1", "sft.batch_size=2", "data.task_args.test_sums.num_rows=4"]
    cfg = load_config("demo", [*base, "sft.train_files=[task:test_sums_traces]"])
    assert sft_problems(cfg) == []
    traces = sft_traces(cfg, smollm_tokenizer)
    assert len(traces) == 4 and traces.accounting_dict()["rows"][0]["source"] == "task:test_sums_traces"
    prompts_as_traces = load_config("demo", [*base, "sft.train_files=[task:test_sums]"])
    assert [p.key for p in sft_problems(prompts_as_traces)] == ["sft.train_files"]
    with pytest.raises(ValueError, match=r"sft.train_files: 'task:test_sums' is a task that makes prompts"):
        sft_traces(prompts_as_traces, smollm_tokenizer)
    with pytest.raises(ConfigError, match=r"'task:test_sums_traces', which is a task that makes traces"):
        load_config("demo", [*base, "data.train_files=[task:test_sums_traces]"])

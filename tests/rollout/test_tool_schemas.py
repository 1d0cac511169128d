"""Tool schemas through the chat template's own tools= argument: the schema of each tool, the
same kwargs in every render of a run (RL prompts, tool messages, SFT traces, the audit's
rendering), a warning where the template ignores them, and none under tool_schemas=none."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from packrl.chat.render import ToolRenderer
from packrl.chat.tool_schemas import describe_tool, renders_tools, template_kwargs, tool_schema
from packrl.config import load_config
from packrl.data.dataset import PromptDataset
from packrl.data.traces import render_traces
from packrl.registry import TOOLS
from packrl.rollout.engine import SamplingParams
from packrl.rollout.multi_turn import multi_turn_engine
from tests.builders import CALL, ScriptedEngine, calculator_prompt_ids
from tests.conftest import SMOLLM_DIR

# the shape of Qwen2.5's template: the tools' schemas as JSON lines inside <tools></tools> in the system message
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}{%- for message in messages %}{% if not (loop.first and message['role'] == 'system') %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

if "test_undescribed" not in TOOLS:

    @TOOLS.register("test_undescribed")
    def _undescribed(arguments: dict) -> str:
        """Echo the arguments.

        More text that is not the description."""
        return json.dumps(arguments)


@pytest.fixture
def tools_tokenizer(smollm_tokenizer):
    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_each_tool_has_a_schema_in_the_function_format():
    schema = tool_schema("calculator")
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert tool_schema("test_undescribed")["function"] == {
        "name": "test_undescribed", "description": "Echo the arguments.", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(ValueError, match="JSON schema of type 'object'"):
        describe_tool("x", {"type": "string"})


def test_kwargs_follow_the_config():
    assert template_kwargs(load_config("arithmetic_tool").rollout.multi_turn) == {"tools": [tool_schema("calculator")]}
    assert template_kwargs(load_config("arithmetic_tool", ["rollout.multi_turn.tool_schemas=none"]).rollout.multi_turn) == {}
    assert template_kwargs(load_config("demo").rollout.multi_turn) == {}


def test_a_tools_template_gets_the_schemas_in_every_render(tools_tokenizer, smollm_tokenizer):
    cfg = load_config("arithmetic_tool", ["sft.num_rows=4", "data.max_prompt_tokens=512"])  # the schemas take ~150 tokens
    kwargs = template_kwargs(cfg.rollout.multi_turn)
    assert renders_tools(tools_tokenizer, kwargs) and not renders_tools(smollm_tokenizer, kwargs)
    train = PromptDataset.build(["task:arithmetic"], tools_tokenizer, cfg.data, seed=cfg.train.seed, split="train",
                                key="data.train_files", chat_template_kwargs=kwargs)
    text = tools_tokenizer.decode(list(train.prompts[0].prompt_ids))
    assert json.dumps(tool_schema("calculator")) in text and cfg.data.system_prompt.split()[0] in text
    # SFT traces of the same problems start with RL's prompt ids, schemas included
    from packrl.data.tool_traces import tool_trace_rows
    from packrl.trainer.sft import trace_options

    traces = render_traces(tool_trace_rows(cfg.data, cfg.sft.num_rows, cfg.train.seed), tools_tokenizer, trace_options(cfg))
    assert set(traces.prompt_ids) <= {tuple(p.prompt_ids) for p in train.prompts}
    # tool messages render the same with the schemas as without (they sit in the system message only)
    assert ToolRenderer(tools_tokenizer, "tool", kwargs).after_close(["7"]) == ToolRenderer(tools_tokenizer, "tool").after_close(["7"])
    plain = PromptDataset.build(["task:arithmetic"], tools_tokenizer, cfg.data, seed=cfg.train.seed, split="train",
                                key="data.train_files")
    assert "<tools>" not in tools_tokenizer.decode(list(plain.prompts[0].prompt_ids))


def test_a_template_that_ignores_tools_is_warned_about(smollm_tokenizer, tools_tokenizer, caplog):
    mt = load_config("arithmetic_tool").rollout.multi_turn
    scripted = ScriptedEngine(smollm_tokenizer, [CALL % "1 + 1", "#### 2"])
    with caplog.at_level(logging.WARNING, logger="packrl.rollout.multi_turn"):
        engine = multi_turn_engine(scripted, smollm_tokenizer, mt, max_prompt_tokens=192, max_response_tokens=256,
                                   max_context_tokens=2048)
    assert "ignores tools=" in caplog.text and "rollout.multi_turn.tool_schemas=none" in caplog.text
    params = SamplingParams(n=1, max_response_tokens=256, stop=("</tool_call>",))
    [[response]] = engine.generate([calculator_prompt_ids(smollm_tokenizer)], params, [0])
    assert response.trajectory.tool_answers == ("2",)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="packrl.rollout.multi_turn"):
        multi_turn_engine(scripted, tools_tokenizer, mt, max_prompt_tokens=192, max_response_tokens=256, max_context_tokens=2048)
    assert "ignores tools=" not in caplog.text

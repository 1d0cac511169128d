"""JSON schemas of the registered tools, rendered by the chat template's own ``tools=`` argument.

Chat templates that support tools (Qwen2.5/Qwen3, Llama 3.1+, Hermes, Mistral) render a list of
function schemas, in the OpenAI function format that ``transformers``' chat templating takes
(``{"type": "function", "function": {"name", "description", "parameters"}}``), into their system
message. With ``rollout.multi_turn.tool_schemas=template`` (the default) the schemas of the run's
tools (``rollout.multi_turn.tools``) go to every render of the run through `template_kwargs`: RL
prompts, validation prompts, the tool messages of a trajectory, SFT traces and the audit, so all
of them agree token for token.

A template that ignores ``tools=`` (SmolLM2's) renders the same text with or without them
(`renders_tools`); the prompt (``data.system_prompt``, ``data.instruction``) is then what tells the
policy the call format, and building the multi-turn engine warns once that the schemas have no
effect. ``tool_schemas=none`` passes none.

A tool describes its arguments with `describe_tool`; a tool registered without it gets a schema
with its name, the first line of its docstring and no declared parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from packrl.registry import TOOLS

if TYPE_CHECKING:
    from packrl.config.schema import MultiTurnConfig

F = TypeVar("F", bound=Callable[..., str])
_SCHEMA_ATTR = "tool_schema"
_PROBE = [{"role": "user", "content": "packrl probe question"}]


def describe_tool(description: str, parameters: dict[str, Any]) -> Callable[[F], F]:
    """Attach the tool's schema to the decorated tool function (stack it under ``@TOOLS.register``).

    Args:
        description: what the tool does, for the policy (one or two sentences).
        parameters: a JSON schema of the arguments object (``{"type": "object", "properties":
            {...}, "required": [...]}``).

    Raises:
        ValueError: ``parameters`` is not a JSON schema of type ``object``.
    """
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"a tool's parameters must be a JSON schema of type 'object', got {parameters!r}")

    def attach(fn: F) -> F:
        setattr(fn, _SCHEMA_ATTR, {"description": description, "parameters": parameters})
        return fn

    return attach


def tool_schema(name: str) -> dict[str, Any]:
    """The schema of the registered tool ``name`` in the OpenAI function format.

    Raises:
        ValueError: ``name`` is not a registered tool.
    """
    fn = TOOLS.lookup(name)
    described = getattr(fn, _SCHEMA_ATTR, None)
    if described is None:
        lines = (fn.__doc__ or "").strip().splitlines()
        described = {"description": lines[0].strip() if lines else name, "parameters": {"type": "object", "properties": {}}}
    return {"type": "function", "function": {"name": name, **described}}


def template_kwargs(mt: MultiTurnConfig) -> dict[str, Any]:
    """The extra arguments of every ``apply_chat_template`` call of a run: ``{"tools": [schema,
    ...]}`` for a multi-turn run under ``rollout.multi_turn.tool_schemas=template``, else none."""
    if not mt.enabled or mt.tool_schemas == "none":
        return {}
    return {"tools": [tool_schema(name) for name in mt.tools]}


def renders_tools(tokenizer: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the tokenizer's chat template renders ``kwargs["tools"]``: a one-message prompt
    renders differently with them than without."""
    if not kwargs.get("tools"):
        return False
    def render(extra: dict[str, Any]) -> str:
        return tokenizer.apply_chat_template(list(_PROBE), add_generation_prompt=True, tokenize=False, **extra)
    return render(kwargs) != render({})


"""Tools a policy may call inside a multi-turn rollout, and the call format it writes them in.

**The call format** (Hermes-style, as Qwen2.5/Qwen3 and verl's ``hermes`` format use it): a call
is a JSON object inside tags, anywhere in an assistant turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>

A turn may hold several calls; they run in order and their answers come back as one tool message
each. A call whose JSON does not parse, is not an object with a string ``name`` and an object
``arguments``, names no registered tool, or leaves its tag open, is *malformed*: the policy's
mistake, counted (``multi_turn/malformed_calls``) and answered with an error message, never a
crash. A tool that fails on its arguments (`ToolError`) answers with the error text; that is
counted as a tool error (``multi_turn/tool_errors``).

**Tools** are functions ``fn(arguments: dict) -> str`` registered by name
(`packrl.registry.TOOLS`, ``rollout.multi_turn.tools``)::

    from packrl.registry import TOOLS
    from packrl.rollout.tools import ToolError

    @TOOLS.register("echo")
    def echo(arguments: dict) -> str:
        if "text" not in arguments:
            raise ToolError("echo needs a 'text' argument")
        return str(arguments["text"])

Built in: ``calculator``, exact rational arithmetic on one expression (below). A tool's JSON schema
(`packrl.chat.tool_schemas.describe_tool`) reaches the policy through the chat template's
``tools=`` argument where the template renders it.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from packrl.chat.tool_schemas import describe_tool
from packrl.registry import TOOLS

logger = logging.getLogger(__name__)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


class ToolError(Exception):
    """A tool cannot serve a call (bad arguments, a failing computation); its message goes back
    to the policy as the tool's answer."""


class Tool(Protocol):
    def __call__(self, arguments: dict[str, Any]) -> str:
        """The tool's answer to one call, as text.

        Raises:
            ToolError: the call cannot be served; the message is the answer the policy sees.
        """
        ...


@dataclass(frozen=True)
class ToolCall:
    """One call found in an assistant turn.

    Attributes:
        name: the tool's name ('' when the call is malformed and names none).
        arguments: the call's arguments (empty when malformed).
        error: why the call is malformed, or None for a well-formed call.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str, known: frozenset[str] | set[str]) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of an assistant turn, in order.

    Args:
        text: the turn's decoded text.
        known: the tool names this run allows (``rollout.multi_turn.tools``).

    Returns:
        One `ToolCall` per tag pair (an unclosed last tag counts as a malformed call); empty when
        the turn calls no tool.
    """
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), match.group(2) == CALL_CLOSE
        calls.append(_parse_call(body, closed, known))
    return calls


def _parse_call(body: str, closed: bool, known: frozenset[str] | set[str]) -> ToolCall:
    if not closed:
        return ToolCall("", {}, f"the call is not closed with {CALL_CLOSE}")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, f"the call is not valid JSON ({err.msg} at character {err.pos})")
    except RecursionError:
        return ToolCall("", {}, "the call's JSON is nested too deeply")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'the call must be a JSON object with a string "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, '"arguments" must be a JSON object')
    if call["name"] not in known:
        return ToolCall(call["name"], arguments, f"unknown tool {call['name']!r}; available: {', '.join(sorted(known))}")
    return ToolCall(call["name"], arguments)


def run_tool(call: ToolCall, timeout_s: float | None = None) -> tuple[str, bool]:
    """The answer to one parsed call and whether it is an error (malformed call, `ToolError`, or
    no answer within ``timeout_s`` seconds).

    A tool that raises anything other than `ToolError`, or returns something other than a
    string, is a bug in the tool, not the policy's mistake: a RuntimeError names the tool. A tool
    that runs past ``timeout_s`` is answered with an error and left running in a daemon thread
    (Python cannot stop a thread); None waits for it.
    """
    if call.error is not None:
        return f"Error: {call.error}", True
    outcome: list[Any] = []
    worker = threading.Thread(target=_call_tool, args=(call, outcome), daemon=True, name=f"packrl-tool-{call.name}")
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        logger.warning("tool %r gave no answer within %s s on arguments %r; answered with an error "
                       "(rollout.multi_turn.tool_timeout_s)", call.name, timeout_s, call.arguments)
        return f"Error: the tool gave no answer within {timeout_s:g} s", True
    answer, err = outcome[0]
    if isinstance(err, ToolError):
        return f"Error: {err}", True
    if err is not None:
        raise RuntimeError(f"tool {call.name!r} raised {type(err).__name__}: {err} on arguments {call.arguments!r}; "
                           "a tool reports a bad call by raising packrl.rollout.tools.ToolError") from err
    if not isinstance(answer, str):
        raise RuntimeError(f"tool {call.name!r} returned a {type(answer).__name__}, not a str, on arguments "
                           f"{call.arguments!r}; a tool returns its answer as text")
    return answer, False


def _call_tool(call: ToolCall, outcome: list[Any]) -> None:
    """Run the tool in the calling thread; ``outcome`` receives ``(answer, None)`` or ``(None, exception)``."""
    try:
        outcome.append((TOOLS.lookup(call.name)(call.arguments), None))
    except Exception as err:  # noqa: BLE001 - sorted out by run_tool: ToolError is an answer, anything else a bug
        outcome.append((None, err))


# ---------------------------------------------------------------------------------------------
# calculator

_MAX_BITS = 3400  # about 1,000 decimal digits, for a numerator or a denominator
_MAX_EXPONENT_DIGITS = 1000  # a literal's exponent (1e1000 is the largest literal)
_MAX_EXPRESSION_CHARS = 500
_TOO_LARGE = "the number is too large (more than about 1000 digits)"
_DECIMAL = re.compile(r"(?P<mantissa>[0-9_]*\.?[0-9_]*)(?:[eE](?P<exponent>[+-]?[0-9_]+))?")


def _check_size(value: Fraction) -> Fraction:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ToolError(_TOO_LARGE)
    return value


def _pow(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only integer powers are exact; rewrite the expression without fractional exponents")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    smallest_bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) - 1  # log2 of the larger part, rounded down
    if abs(exponent) * smallest_bits > _MAX_BITS:  # the result has at least this many bits: refuse before computing it
        raise ToolError(_TOO_LARGE)
    return _check_size(base ** int(exponent))


def _divide(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("division by zero")
    return a / b


def _floor_divide(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("division by zero")
    return Fraction(a // b)


def _modulo(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("modulo by zero")
    return a % b


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: _divide, ast.FloorDiv: _floor_divide, ast.Mod: _modulo, ast.Pow: _pow}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def _literal(source: str) -> Fraction:
    """The exact value of a number as written (``12.5``, ``1e-400``, ``0x1f``), never through a float."""
    text = source.replace("_", "")
    if text[:2].lower() in ("0x", "0o", "0b"):
        return Fraction(int(text, 0))
    match = _DECIMAL.fullmatch(text)
    if match is None:
        raise ToolError(f"unsupported number {source!r}")
    exponent = match.group("exponent")
    if exponent is not None and len(exponent.lstrip("+-").lstrip("0")) > len(str(_MAX_EXPONENT_DIGITS)):
        raise ToolError(_TOO_LARGE)
    if exponent is not None and abs(int(exponent)) > _MAX_EXPONENT_DIGITS:
        raise ToolError(_TOO_LARGE)
    return _check_size(Fraction(text))


def _value(node: ast.AST, text: str) -> Fraction:
    """The exact value of an expression tree of numbers, + - * / // % ** and parentheses."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _literal(ast.get_source_segment(text, node) or str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _check_size(_BINARY[type(node.op)](_value(node.left, text), _value(node.right, text)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, text))
    raise ToolError(f"unsupported element {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses")


def format_number(value: Fraction) -> str:
    """An exact value as text: an integer as is, a terminating fraction as a decimal, any other
    as ``p/q``."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # terminating decimal: print all its digits
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        scaled = value * 10**digits
        sign = "-" if scaled < 0 else ""
        text = str(abs(scaled.numerator)).rjust(digits + 1, "0")
        return f"{sign}{text[:-digits]}.{text[-digits:]}"
    return f"{value.numerator}/{value.denominator}"


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, parsed with `ast` (never evaluated as code):
    numbers as written (decimals and exponents exact, never through a float), ``+ - * / // % **``
    and parentheses; ``×`` and a spaced ``x`` (``12 x 34``) multiply, ``÷`` divides, ``^`` is a
    power, and ``,`` between digits (thousands) is dropped.

    Raises:
        ToolError: the expression does not parse, uses anything else, nests too deeply, divides
            by zero, or a number in it would exceed about 1000 digits.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expression).replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=[\d)])\s+[xX]\s+(?=[\d(])", " * ", text).strip()
    try:
        tree = ast.parse(text, mode="eval")
        return _value(tree.body, text)
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise ToolError("the expression is nested too deeply") from None


@TOOLS.register("calculator")
@describe_tool("Exact arithmetic on one expression: numbers, + - * / // % ** and parentheses. Returns the value as text.",
               {"type": "object", "properties": {"expression": {"type": "string", "description": "the expression, e.g. 12 * (3 + 4)"}},
                "required": ["expression"]})
def calculator(arguments: dict[str, Any]) -> str:
    """Exact arithmetic: ``{"expression": "12 * (3 + 4) / 5"}`` -> ``"16.8"`` (see `evaluate`).

    Raises:
        ToolError: no ``expression`` string, or `evaluate` refuses it.
    """
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        raise ToolError('the calculator takes {"expression": "<arithmetic expression>"}')
    return format_number(evaluate(expression))

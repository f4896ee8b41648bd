"""Tool calls read from an assistant turn's text, by a parser registered by name.

The default, `hermes`, reads the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
that the Hermes / Qwen2.5 / Qwen3 chat templates teach. Where the tokenizer carries a response
template, transformers' `tokenizer.parse_response` reads the turn (the parser TRL uses) and a small
regex parser checks it: parse_response turns a region it cannot read into plain text without a
word, so a turn where it found fewer calls than the `<tool_call>` blocks present is counted as
unparsable and read by the regex parser instead. A block that is not a JSON call (bad JSON, no
name, no closing tag) is an error the model is shown, never an exception.

A parser is ``fn(text, tokenizer=None, tools=None) -> ParsedTurn``; `register_tool_call_parser`
adds one under a name, and `module:function` names a user's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.tools import EnvError, import_object


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    content: str  # the turn's text outside its tool calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per call that could not be read
    unparsable: bool = False  # the tokenizer's response template silently dropped tool-call markup


ToolCallParser = Callable[..., ParsedTurn]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_tool_call_parser(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    def register(fn: ToolCallParser) -> ToolCallParser:
        if name in TOOL_CALL_PARSERS:
            raise EnvError(f"tool-call parser {name!r} is already registered")
        TOOL_CALL_PARSERS[name] = fn
        return fn

    return register


def resolve_tool_call_parser(name: str) -> ToolCallParser:
    if name in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[name]
    if ":" not in name:
        raise EnvError(f"unknown tool-call parser {name!r}: choose from {sorted(TOOL_CALL_PARSERS)} or give module:function")
    return import_object("tool-call parser", name, callable)


def turn_as_json(turn: ParsedTurn) -> dict:
    """A parsed turn as it crosses a process boundary (JSON; the arguments must be JSON values)."""
    calls = [[call.name, call.arguments] for call in turn.calls]
    reply = {"content": str(turn.content), "calls": calls, "errors": [str(e) for e in turn.errors], "unparsable": bool(turn.unparsable)}
    json.dumps(reply)  # a TypeError or ValueError here names a value JSON cannot carry
    return reply


def turn_from_json(reply: dict, where: str) -> ParsedTurn:
    """The turn `turn_as_json` wrote; anything else is an EnvError naming `where`."""
    try:
        calls = [ToolCall(str(name), dict(arguments)) for name, arguments in reply["calls"]]
        return ParsedTurn(str(reply["content"]), calls, [str(e) for e in reply["errors"]], bool(reply["unparsable"]))
    except (KeyError, TypeError, ValueError) as err:
        raise EnvError(f"{where}: a malformed parsed turn ({type(err).__name__}: {err})") from None


# --- hermes ------------------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def call_from(data: Any, where: str) -> tuple[ToolCall | None, str | None]:
    """A call from its JSON value: {"name": str, "arguments": object or a JSON string of one}.
    The OpenAI form {"type": "function", "function": {...}} is accepted too."""
    if isinstance(data, dict) and isinstance(data.get("function"), dict):
        data = data["function"]
    if not isinstance(data, dict):
        return None, f"{where}: expected a JSON object, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, f'{where}: no "name" string'
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return None, f"{where}: arguments of {name!r} are not JSON ({err.msg} at char {err.pos})"
    if not isinstance(arguments, dict):
        return None, f'{where}: "arguments" of {name!r} must be an object, got {type(arguments).__name__}'
    return ToolCall(name, arguments), None


def hermes_regex(text: str) -> ParsedTurn:
    """Every `<tool_call>` block in `text`; an unclosed block runs to the end and is an error."""
    turn = ParsedTurn(content=_BLOCK.sub("", text).strip())
    for i, match in enumerate(_BLOCK.finditer(text), start=1):
        where = f"tool call {i}"
        if not match.group(0).endswith(CLOSE):
            turn.errors.append(f"{where}: no closing {CLOSE}")
            continue
        try:
            data = json.loads(match.group(1))
        except json.JSONDecodeError as err:
            turn.errors.append(f"{where}: not JSON ({err.msg} at char {err.pos})")
            continue
        call, error = call_from(data, where)
        if error is not None:
            turn.errors.append(error)
        else:
            turn.calls.append(call)
    return turn


@register_tool_call_parser("hermes")
def hermes(text: str, tokenizer=None, tools: list[dict] | None = None) -> ParsedTurn:
    """Hermes / Qwen tool calls, through the tokenizer's response template when it has one."""
    regex = hermes_regex(text)
    template = getattr(tokenizer, "response_template", None) if tokenizer is not None else None
    if template is None:
        return regex
    try:
        message = tokenizer.parse_response(text, prefix="", tools=tools)
    except ValueError:  # parse_response raises on a block it cannot read: the regex parser names which
        return regex
    blocks = text.count(OPEN)
    raw_calls = (message.get("tool_calls") or []) if isinstance(message, dict) else []
    if len(raw_calls) < blocks:  # parse_response's silent failure: markup left as plain text
        regex.unparsable = True
        return regex
    turn = ParsedTurn(content=str(message.get("content") or "").strip())
    for i, raw in enumerate(raw_calls, start=1):
        call, error = call_from(raw, f"tool call {i}")
        if error is not None:
            turn.errors.append(error)
        else:
            turn.calls.append(call)
    return turn

"""Tools: plain typed Python functions with a docstring.

A tool's JSON schema comes from its signature and docstring by `transformers.utils.get_json_schema`
(the OpenAI / transformers `tools=` convention), so the schema the chat template shows the model
and the function that runs are one object. A call's arguments are checked against that schema
before the function runs; a call that fails for any reason becomes an error text the model reads,
never an exception in the worker. The run's tools (rollout.agent.tools) run in a process of the worker's
own (tidal.envs.isolation); an environment's own tools run in the worker.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.python_tool import python


class EnvError(ValueError):
    """An environment, tool or parser that cannot be used as named; the text says which and why."""


_TOOL_MARK = "__tidal_tool__"


def tool(fn: Callable) -> Callable:
    """Marks an environment method as a tool: `@tool` above a typed method with a docstring."""
    setattr(fn, _TOOL_MARK, True)
    return fn


def is_marked_tool(fn: object) -> bool:
    return callable(fn) and getattr(fn, _TOOL_MARK, False)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict, "null": type(None)}


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    error: bool  # the call did not run, or raised
    failure: str | None = None  # an isolated tool's process failed the call: "timeout" or "crash" (it was replaced)
    cut: bool = False  # the text was cut at rollout.agent.tool_output_bytes


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters", ...}}
    reference: str | None = None  # the name in rollout.agent.tools (built-in or module:function), when it has one
    host: Any = field(default=None, compare=False, repr=False)  # the ToolHost that runs it, when isolated
    # arguments the run sets (the python tool's limits): left out of the schema the model sees, a
    # call that names one is refused, and every call gets them
    fixed: dict = field(default_factory=dict)

    @classmethod
    def from_function(cls, fn: Callable, reference: str | None = None, fixed: dict | None = None) -> Tool:
        try:
            schema = json_schema_of(fn)
        except Exception as err:  # noqa: BLE001 - transformers raises its own exception types for a missing hint or docstring
            raise EnvError(f"tool {_qualified(fn)}: no JSON schema from its signature and docstring ({err})") from None
        fixed = dict(fixed or {})
        return cls(schema["function"]["name"], fn, without_parameters(schema, set(fixed)), reference, fixed=fixed)

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {})

    def argument_error(self, arguments: Any) -> str | None:
        """Why `arguments` do not fit the schema (one line), or None."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        properties = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; {self.name} takes {sorted(properties)}"
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            return f"missing required argument(s) {missing}"
        for name, value in arguments.items():
            declared = properties[name].get("type")
            kinds = [declared] if isinstance(declared, str) else list(declared or [])
            if properties[name].get("nullable"):
                kinds.append("null")
            if kinds and not any(_is_json_type(value, k) for k in kinds):
                return f"argument {name!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
        return None

    def __call__(self, arguments: Any) -> ToolResult:
        """Runs the tool on a call's arguments. Bad arguments and exceptions are error texts."""
        problem = self.argument_error(arguments)
        if problem is not None:
            return ToolResult(f"error: {self.name}: {problem}", True)
        arguments = {**arguments, **self.fixed}
        if self.host is not None:
            return self.host.run(self, arguments)
        try:
            value = self.fn(**arguments)
        except Exception as err:  # noqa: BLE001 - user code: the model reads the error, the worker goes on
            return ToolResult(f"error: {self.name} raised {type(err).__name__}: {err}", True)
        return ToolResult(as_text(value), False)


def without_parameters(schema: dict, names: set[str]) -> dict:
    """`schema` without the parameters `names` (the run sets them; the model neither sees nor sets them)."""
    if not names:
        return schema
    function = dict(schema["function"])
    parameters = dict(function.get("parameters", {}))
    parameters["properties"] = {k: v for k, v in parameters.get("properties", {}).items() if k not in names}
    if "required" in parameters:
        parameters["required"] = [p for p in parameters["required"] if p not in names]
    function["parameters"] = parameters
    return {**schema, "function": function}


def json_schema_of(fn: Callable) -> dict:
    """transformers' `get_json_schema`, without importing torch: it maps every hint through a table
    that adds torch.Tensor whenever torch is installed, and a tool process under rollout.agent.tool_memory_mb
    (RLIMIT_AS) cannot map torch. A JSON tool takes no tensor, so the table does without it."""
    # here, not at the top: reading a config should not import transformers (nor its package, which imports torch)
    from transformers.utils import chat_template_utils

    saved = chat_template_utils.is_torch_available
    chat_template_utils.is_torch_available = lambda: False
    try:
        return chat_template_utils.get_json_schema(fn)
    finally:
        chat_template_utils.is_torch_available = saved


def _is_json_type(value: Any, kind: str) -> bool:
    expected = _JSON_TYPES.get(kind)
    if expected is None:
        return True  # a type the schema names but JSON does not: not ours to refuse
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, expected)


def as_text(value: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


# --- built-in tools ----------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64  # 10**64 is plenty for arithmetic; 9**9**9 would take the worker's memory


def calc(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "123 * 456".
    """

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    result = value(tree.body)
    if isinstance(result, float) and result.is_integer() and math.isfinite(result):
        result = int(result)
    return str(result)


BUILT_IN_TOOLS: dict[str, Callable] = {"calc": calc, "python": python}


def run_arguments(name: str, agent) -> dict:
    """The arguments a run fixes for a tool of rollout.agent.tools, from its config (`agent`): the python
    tool's limits. They travel with every call, so the tool's process needs no config of its own."""
    if name != "python":
        return {}
    return {
        "timeout_seconds": agent.python_timeout_seconds,
        "cpu_seconds": agent.tool_cpu_seconds,
        "memory_mb": agent.tool_memory_mb,
        "output_bytes": agent.tool_output_bytes,
    }


def tool_function(name: str) -> Callable:
    """A built-in tool's name or `module:function`, as the function."""
    return BUILT_IN_TOOLS[name] if name in BUILT_IN_TOOLS else import_object("tool", name, callable)


def resolve_tool(name: str, fixed: dict | None = None) -> Tool:
    """A built-in tool's name or `module:function`, as a Tool; `fixed`: arguments the run sets (run_arguments)."""
    return Tool.from_function(tool_function(name), name, fixed)


def import_object(kind: str, reference: str, check: Callable[[Any], bool]):
    """`module:attribute` imported; a missing module or attribute is an EnvError naming it."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvError(f"{kind} {reference!r}: give a built-in name or module:name")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import-time failure of user code is reported the same way
        raise EnvError(f"{kind} {reference!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})") from None
    obj = getattr(module, attribute, None)
    if obj is None or not check(obj):
        raise EnvError(f"{kind} {reference!r}: module {module_name!r} has no {kind} {attribute!r}")
    return obj


def _qualified(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

"""The environment of a multi-turn trajectory.

An environment is a small class, one instance per trajectory (its state is that trajectory's):

* ``reset(problem) -> messages``: the chat the policy starts from (by default, the problem's
  prompt as one user message);
* ``step(assistant_text) -> (observation messages, done)``: what the environment answers to one
  assistant turn (by default: run the turn's tool calls and return their results as `tool`
  messages; a turn without a tool call is the final answer, ``done``);
* ``reward(trajectory) -> float | dict | None``: the trajectory's reward (a dict is named parts,
  summed); None, the default, scores the final answer with the run's ``reward.functions``.

Tools are the class's methods marked with ``@tool``, the functions in its ``tools`` attribute, and
the run's ``rollout.agent.tools``; the worker runs the last in a process of their own
(tidal.envs.isolation), the environment's own in its process (they hold the trajectory's state).
Users name an environment ``module:Class`` (a subclass of `Environment`), as reward functions are
named. Nothing here runs a model: the engine and the worker drive the loop, tokenise the
observations and enforce the turn, token and time limits.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.hosted_parser import HostedParser
from tidal.envs.isolation import ToolHost, ToolLimits
from tidal.envs.parsing import TOOL_CALL_PARSERS, ParsedTurn, ToolCall, resolve_tool_call_parser
from tidal.envs.stats import EnvStats  # noqa: F401 - re-exported: part of an environment's API
from tidal.envs.tools import EnvError, Tool, import_object, is_marked_tool, resolve_tool, run_arguments


@dataclass
class Trajectory:
    """One finished trajectory, as `reward` sees it."""

    problem: Any  # what reset() was given: .prompt and .answer
    messages: list[dict]  # the whole chat: reset's messages, assistant turns and observations
    stats: EnvStats = field(default_factory=EnvStats)
    finish_reason: str = "done"  # done, max_turns, length (a turn hit max_new_tokens), timeout

    @property
    def final_text(self) -> str:
        """The last assistant turn's text (the answer a reward function reads)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return str(message.get("content") or "")
        return ""


def tool_message(text: str, name: str | None = None) -> dict:
    return {"role": "tool", "content": text} if name is None else {"role": "tool", "name": name, "content": text}


class Environment:
    """The base environment: a user message, then tool calls until a turn makes none.

    Subclass it to change the first messages (`reset`), what a turn gets back (`step`) or the reward
    (`reward`), and add tools as ``@tool`` methods or in the class attribute ``tools``. A subclass's
    ``__init__`` takes no arguments (the worker builds one instance per trajectory)."""

    tools: Sequence[Callable] = ()

    # set by bind(): the run's tools, parser and limits
    _tools: dict[str, Tool]
    _parser: Callable[..., ParsedTurn]
    _tokenizer: Any = None
    max_tool_calls: int = 8
    stats: EnvStats

    def bind(self, tools: Sequence[Tool] = (), parser: str | Callable = "hermes", tokenizer=None, max_tool_calls: int = 8) -> Environment:
        """Gives the instance the run's tools, tool-call parser (a name, or the parser) and limits; returns it."""
        found: dict[str, Tool] = {}
        for t in [*(Tool.from_function(fn) for fn in self._own_tool_functions()), *tools]:
            if t.name in found:
                raise EnvError(f"environment {type(self).__name__}: two tools are named {t.name!r}")
            found[t.name] = t
        self._tools = found
        self._parser = parser if callable(parser) else resolve_tool_call_parser(parser)
        self._tokenizer = tokenizer
        self.max_tool_calls = max_tool_calls
        self.stats = EnvStats()
        return self

    def _own_tool_functions(self) -> list[Callable]:
        functions = list(type(self).tools)
        for name, _ in inspect.getmembers(type(self), is_marked_tool):
            functions.append(getattr(self, name))  # bound: the schema has no `self`
        return functions

    @property
    def tool_schemas(self) -> list[dict]:
        """The tools as the chat template's `tools=` takes them."""
        return [t.schema for t in self._tools.values()]

    def reset(self, problem) -> list[dict]:
        return [{"role": "user", "content": problem.prompt}]

    def parse(self, assistant_text: str) -> ParsedTurn:
        return self._parser(assistant_text, tokenizer=self._tokenizer, tools=self.tool_schemas or None)

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        started = time.perf_counter()
        try:
            return self._step(assistant_text)
        finally:
            self.stats.env_seconds += time.perf_counter() - started

    def _step(self, assistant_text: str) -> tuple[list[dict], bool]:
        turn = self.parse(assistant_text)
        self.stats.turns += 1
        self.stats.unparsable_turns += int(turn.unparsable)
        if not turn.calls and not turn.errors:
            return [], True
        observations = []
        for error in turn.errors:
            self.stats.malformed_calls += 1
            observations.append(tool_message(f"error: {error}"))
        for call in turn.calls:
            if self.stats.tool_calls >= self.max_tool_calls:
                self.stats.refused_calls += 1
                observations.append(tool_message(f"error: the limit of {self.max_tool_calls} tool calls is reached; answer now", call.name))
                continue
            observations.append(self.call(call))
        return observations, False

    def call(self, call: ToolCall) -> dict:
        """Runs one call; its result, or its error, as a `tool` message."""
        self.stats.tool_calls += 1
        found = self._tools.get(call.name)
        if found is None:
            self.stats.tool_errors += 1
            return tool_message(f"error: unknown tool {call.name!r}; the tools are {sorted(self._tools)}", call.name)
        result = found(call.arguments)
        self.stats.tool_errors += int(result.error)
        self.stats.tool_timeouts += int(result.failure == "timeout")
        self.stats.tool_crashes += int(result.failure == "crash")
        self.stats.tool_outputs_cut += int(result.cut)
        return tool_message(result.text, call.name)

    def reward(self, trajectory: Trajectory) -> float | dict[str, float] | None:
        return None


BUILT_IN_ENVIRONMENTS: dict[str, type[Environment]] = {"tools": Environment}


def resolve_environment(name: str) -> type[Environment]:
    """A built-in environment's name or `module:Class` (a subclass of Environment)."""
    if name in BUILT_IN_ENVIRONMENTS:
        return BUILT_IN_ENVIRONMENTS[name]
    cls = import_object("environment", name, inspect.isclass)
    if not issubclass(cls, Environment):
        raise EnvError(f"environment {name!r}: {cls.__qualname__} must subclass tidal.envs.Environment")
    return cls


@dataclass
class EnvironmentFactory:
    """Builds one bound environment per trajectory; the classes and tools are resolved once. With a
    `host`, the run's tools run in its processes; with an `env_host`, so does a user's environment
    class (tidal.envs.sandboxed), and `cls` is the class that stands for it here (close() stops both)."""

    cls: type
    tools: list[Tool]
    parser: str | Callable = "hermes"
    tokenizer: Any = None
    max_tool_calls: int = 8
    host: ToolHost | None = None
    env_host: Any = None  # tidal.envs.sandboxed.EnvHost

    @classmethod
    def from_config(cls, agent, tokenizer=None, seed: int = 0, warm: bool = True) -> EnvironmentFactory:
        """rollout.agent's env as a run uses it: the tools and a user's environment class each in
        sandboxed processes of this one, with their limits; their modules are imported only there.
        `warm`: every environment process starts now (a check needs only the one it builds in)."""
        from tidal.envs.sandboxed import EnvLimits

        fixed = {name: run_arguments(name, agent) for name in agent.tools}
        isolation = ToolLimits.from_config(agent, seed)
        factory = cls.from_names(
            agent.env, agent.tools, agent.tool_parser, tokenizer, agent.max_tool_calls, isolation, fixed, EnvLimits.from_config(agent)
        )
        if warm and factory.env_host is not None:
            factory.env_host.prestart()
        return factory

    @classmethod
    def from_names(
        cls,
        env: str,
        tools: Sequence[str] = (),
        parser: str = "hermes",
        tokenizer=None,
        max_tool_calls: int = 8,
        isolation: ToolLimits | None = None,
        fixed: Mapping[str, dict] | None = None,
        hosting=None,
    ) -> EnvironmentFactory:
        """`isolation`: the tools run in a process of their own with these limits, which also reads
        their schemas (a user's tool module is imported only there, in the sandbox); None: in this one.
        `fixed`: per tool name, arguments the run sets (tidal.envs.tools.run_arguments). `hosting`
        (tidal.envs.sandboxed.EnvLimits): a user's environment class (not a built-in) lives in
        processes of its own with these limits, its module imported only there; None: in this one."""
        from tidal.envs.sandboxed import EnvHost

        fixed = fixed or {}
        host = ToolHost(list(tools), isolation) if isolation is not None and tools else None
        env_host = None
        try:
            if isolation is not None and is_users_parser(parser):
                parser = hosted_parser(parser, tokenizer, isolation)
            resolved = host.tools(fixed) if host is not None else [resolve_tool(t, fixed.get(t)) for t in tools]
            if hosting is not None and env not in BUILT_IN_ENVIRONMENTS:
                env_host = EnvHost(env, resolved, parser, tokenizer, max_tool_calls, hosting)
                factory = cls(env_host.environment, resolved, parser, tokenizer, max_tool_calls, host, env_host)
                env_host.check()  # a class that cannot be imported or built, or tools that clash, fail here and not in the first trajectory
            else:
                factory = cls(resolve_environment(env), resolved, parser, tokenizer, max_tool_calls, host)
                factory()
        except BaseException:
            _close_all(host, env_host, parser if isinstance(parser, HostedParser) else None)
            raise
        return factory

    def close(self) -> None:
        _close_all(self.host, self.env_host, self.parser if isinstance(self.parser, HostedParser) else None)

    def __call__(self):
        if self.env_host is not None:
            return self.env_host.new()
        try:
            env = self.cls()
        except Exception as err:  # noqa: BLE001 - user code: name the class
            raise EnvError(f"environment {self.cls.__qualname__}(): {type(err).__name__}: {err}") from None
        return env.bind(self.tools, self.parser, self.tokenizer, self.max_tool_calls)


def is_users_parser(parser) -> bool:
    """A `module:function` parser: user code, run in a sandboxed process like the tools."""
    return isinstance(parser, str) and parser not in TOOL_CALL_PARSERS and ":" in parser


def hosted_parser(reference: str, tokenizer, limits: ToolLimits) -> HostedParser:
    parser = HostedParser(reference, limits, tokenizer)
    try:
        parser.check()
    except BaseException:
        parser.close()
        raise
    return parser


def _close_all(*parts) -> None:
    for part in parts:
        if part is not None:
            part.close()

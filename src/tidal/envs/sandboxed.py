"""A user's environment class (rollout.agent.env: `module:Class`) in sandboxed processes of the worker's own
(`python -m tidal.envs.env_host`, tidal.hosted and tidal.sandbox), never in the worker: its module is
imported there, and its methods run there with none of the run's secrets, files, network or processes
within reach, as tools and reward functions do.

Each trajectory's instance lives in one of up to rollout.agent.env_processes processes (the one holding the
fewest) for the trajectory's whole life: its state stays in Python objects there between calls. In the
worker a `HostedEnvironment` stands for it, with what the agent loop calls (reset, step, reward,
tool_schemas, stats); each call is one JSON line each way, nothing is pickled. In the middle of a call
the instance asks the worker to run a tool of rollout.agent.tools (in the worker's tool processes, under
their limits) and to read a turn's tool calls (the parser needs the worker's tokenizer).

A call past rollout.agent.env_timeout_seconds (the environment's own time, not counting its rollout.agent.tools
calls), past rollout.agent.env_cpu_seconds or rollout.agent.env_memory_mb, or a crash or exit of its process fails
that call: the trajectory ends (counted under the environment's name in the end-of-run table) and the
process is replaced; the other trajectories whose instances it held fail at their next call, their
state gone. Every process a call starts ends with the call. Built-in environments (`tools`) run in the
worker: they are Tidal's code, and the tools they call already run in the tool processes."""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from tidal.envs.parsing import TOOL_CALL_PARSERS, resolve_tool_call_parser, turn_as_json
from tidal.envs.stats import EnvStats
from tidal.envs.tools import EnvError, Tool
from tidal.hosted import HostCallError, HostProcess, HostStartError

ERROR_CHARS = 2000  # of an error text from an environment's process (its log line and the trajectory's error)


@dataclass(frozen=True)
class EnvLimits:
    """rollout.agent.env_timeout_seconds, env_cpu_seconds, env_memory_mb and env_processes; and
    trajectory_timeout_seconds: the larger of it and env_timeout_seconds bounds one call with its tool
    calls (a step that calls tools for ever)."""

    timeout_seconds: float = 60.0
    cpu_seconds: int | None = 60
    memory_mb: int | None = 4096
    processes: int = 4
    trajectory_seconds: float = 120.0

    @classmethod
    def from_config(cls, agent) -> EnvLimits:
        """rollout.agent's limits of an environment process."""
        a = agent
        return cls(a.env_timeout_seconds, a.env_cpu_seconds, a.env_memory_mb, a.env_processes, a.trajectory_timeout_seconds)

    def host_args(self) -> list[str]:
        return [*([f"--memory-mb={self.memory_mb}"] if self.memory_mb else []), *([f"--cpu-seconds={self.cpu_seconds}"] if self.cpu_seconds else [])]


class EnvProcessFailed(Exception):
    """The environment's process failed a call (its timeout, a limit, a crash or an exit), or was
    replaced after another trajectory's call failed there: this trajectory's environment is gone."""


class EnvironmentRaised(Exception):
    """An exception user code raised in the environment's process."""


@functools.lru_cache(maxsize=256)
def _raised_class(kind: str) -> type[EnvironmentRaised]:
    return type(kind, (EnvironmentRaised,), {"__module__": __name__})


def raised(error: str) -> Exception:
    """The exception for an `{"error": "Type: message"}` reply, named as the user's type: the worker's
    log and the end-of-run table read as they did when environments ran in the worker."""
    kind, _, message = error.partition(": ")
    if kind == "EnvError":
        return EnvError(message[:ERROR_CHARS])
    if not (kind.isidentifier() and len(kind) <= 64):
        kind, message = EnvironmentRaised.__name__, error
    return _raised_class(kind)(message[:ERROR_CHARS])


def _checked_dicts(value, what: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise EnvError(f"{what} must be a list of dicts, got {type(value).__name__}")
    return value


def local_parser(parser: str | Callable, tokenizer) -> str | None:
    """The parser's name when the environment's process can run it itself (a built-in parser and a
    tokenizer without a response template: it reads the text alone), saving a question per step;
    None when it must ask the worker (a user's parser is never imported there, and none gets the tokenizer)."""
    if isinstance(parser, str) and parser in TOOL_CALL_PARSERS and getattr(tokenizer, "response_template", None) is None:
        return parser
    return None


class EnvHost:
    """The environment processes of one class, each started at once (they import the user's module
    while the worker loads its model) and replaced after a failure; `new()` is an instance in the one
    holding the fewest."""

    def __init__(self, reference: str, tools: list[Tool], parser: str | Callable, tokenizer, max_tool_calls: int, limits: EnvLimits):
        self.reference, self.limits, self.tokenizer = reference, limits, tokenizer
        self.tools = {t.name: t for t in tools}
        self.parser = parser if callable(parser) else resolve_tool_call_parser(parser)
        bind = {"tools": [t.schema for t in tools], "max_tool_calls": max_tool_calls, "parser": local_parser(parser, tokenizer)}
        bind = json.dumps(bind)
        args = [*limits.host_args(), f"--bind={bind}", reference]
        self.processes = [
            HostProcess("tidal.envs.env_host", args, limits.timeout_seconds, "rollout.agent.env_timeout_seconds", memory_mb=limits.memory_mb)
            for _ in range(limits.processes)
        ]
        self.held: list[set[int]] = [set() for _ in self.processes]  # the live instances' ids, per process
        self.dropped: list[deque[int]] = [deque() for _ in self.processes]  # ended instances the process still holds
        self.ids = itertools.count()
        self.lock = threading.Lock()
        # the worker's logs and the end-of-run table name an environment by its class (type(env).__qualname__)
        name = reference.partition(":")[2]
        self.environment: type[HostedEnvironment] = type(name, (HostedEnvironment,), {"__qualname__": name, "__module__": __name__})

    def new(self) -> HostedEnvironment:
        return self.environment(self)

    def check(self) -> None:
        """Builds one instance in a process (its module imported there): a class that cannot be
        imported or built fails here, an EnvError naming it, and not in the first trajectory."""
        probe = self.new()
        try:
            probe.tool_schemas  # noqa: B018 - the call builds it
        finally:
            probe.close()

    def prestart(self) -> None:
        for process in self.processes:
            process.prestart()

    def assign(self) -> tuple[int, int]:
        """A new instance's id, and the process that will hold it."""
        with self.lock:
            index = min(range(len(self.processes)), key=lambda i: len(self.held[i]))
            key = next(self.ids)
            self.held[index].add(key)
        return key, index

    def release(self, key: int, index: int) -> None:
        """The instance's trajectory is over: its process drops it at its next call (called from a
        finalizer too, on any thread: only atomic operations here)."""
        self.held[index].discard(key)
        self.dropped[index].append(key)

    def request(self, index: int, message: dict, asked: Callable[[dict], dict]) -> dict:
        drops = self.dropped[index]
        gone = []
        while True:
            try:
                gone.append(drops.popleft())
            except IndexError:
                break
        if gone:
            message["drop"] = gone
        limits = self.limits
        whole = (limits.trajectory_seconds, "rollout.agent.trajectory_timeout_seconds")
        if limits.timeout_seconds >= limits.trajectory_seconds:
            whole = (limits.timeout_seconds, "rollout.agent.env_timeout_seconds")
        return self.processes[index].request(message, asked=asked, whole=whole)

    def answer(self, question: dict, schemas: list[dict] | None) -> dict:
        """What an instance asks mid-call: run a tool of rollout.agent.tools, or read a turn's tool calls."""
        if "tool" in question:
            found = self.tools.get(question["tool"])
            if found is None:
                raise EnvError(f"no tool {question['tool']!r} in rollout.agent.tools")
            result = found(question["arguments"])
            return {"text": result.text, "failed": result.error, "failure": result.failure, "cut": result.cut}
        if "parse" in question:
            return turn_as_json(self.parser(str(question["parse"]), tokenizer=self.tokenizer, tools=schemas or None))
        raise EnvError(f"an environment process asked for {sorted(question)}")

    def close(self) -> None:
        for process in self.processes:
            process.close()


class HostedEnvironment:
    """One trajectory's instance of a user's environment class, which lives in an environment process;
    closed (dropped there) after its reward, or when the worker no longer holds it."""

    def __init__(self, host: EnvHost):
        self.host = host
        self.key, self.index = host.assign()
        self.stats = EnvStats()
        self.schemas: list[dict] | None = None
        self.created = self.closed = False
        self._release = weakref.finalize(self, host.release, self.key, self.index)

    @property
    def name(self) -> str:
        return f"environment {type(self).__qualname__}"

    @property
    def tool_schemas(self) -> list[dict]:
        """The tools as the chat template's `tools=` takes them (read once: they do not change after reset)."""
        if self.schemas is None:
            self.schemas = _checked_dicts(self._call("schemas")["schemas"], f"{self.name}: tool_schemas")
        return self.schemas

    def reset(self, problem) -> list[dict]:
        reply = self._call("reset", problem=_problem(problem))
        self.schemas = _checked_dicts(reply["schemas"], f"{self.name}: tool_schemas")
        self._take_stats(reply)
        return _checked_dicts(reply["messages"], f"{self.name}: reset()")

    def step(self, assistant_text: str) -> tuple[list[dict], bool]:
        started = time.perf_counter()
        try:
            reply = self._call("step", text=assistant_text)
        finally:
            self.stats.env_seconds += time.perf_counter() - started
        self._take_stats(reply)
        return _checked_dicts(reply["observations"], f"{self.name}: step()'s observations"), bool(reply["done"])

    def reward(self, trajectory) -> float | dict[str, float] | None:
        """The last call of a trajectory: its process drops the instance after it."""
        data = {"problem": _problem(trajectory.problem), "messages": trajectory.messages, "stats": asdict(trajectory.stats)}
        try:
            return self._call("reward", trajectory={**data, "finish_reason": trajectory.finish_reason})["value"]
        finally:
            self.close()

    def close(self) -> None:
        self.closed = True
        self._release()

    def _take_stats(self, reply: dict) -> None:
        """The counts the instance keeps (turns, tool calls...); env_seconds is the worker's own measure."""
        stats = reply.get("stats")
        if isinstance(stats, dict):
            for f in fields(EnvStats):
                value = stats.get(f.name)
                if f.name != "env_seconds" and isinstance(value, int) and not isinstance(value, bool):
                    setattr(self.stats, f.name, value)

    def _call(self, op: str, **arguments) -> dict:
        if self.closed:
            raise EnvError(f"{self.name}: its trajectory is over (reward() was called)")
        message = {"op": op, "id": self.key, **arguments}
        if not self.created:
            message["create"] = True
        try:
            reply = self.host.request(self.index, message, lambda question: self.host.answer(question, self.schemas))
        except HostStartError as err:
            raise EnvError(str(err)) from None
        except HostCallError as err:
            others = len(self.host.held[self.index] - {self.key})
            lost = f"; the environments of {others} other trajectories were lost with it" if others else ""
            raise EnvProcessFailed(f"{err.kind}: {err}{lost}") from None
        if reply.get("lost"):
            raise EnvProcessFailed("its process was replaced after another trajectory's call failed there: this trajectory's environment is gone")
        if "error" in reply:
            raise raised(str(reply["error"]))
        self.created = True
        return reply


def _problem(problem) -> dict:
    return {"id": problem.id, "prompt": problem.prompt, "answer": problem.answer}

"""`python -m tidal.envs.env_host [--memory-mb M] [--cpu-seconds S] --bind JSON module:Class`: a process
that holds a user's environment instances (rollout.agent.env) for its worker, in the sandbox
(tidal.hosted.serve: JSON lines, prints to stderr, exits with its parent, rlimits). The user's module
is imported here, never in the worker. `--bind`: `{"tools": [schema...], "max_tool_calls": n, "parser":
name or null}`, the run's tools (rollout.agent.tools) as the worker resolved them, and the built-in tool-call
parser to run here (null: ask the worker, which holds the tokenizer and a user's parser).

The worker writes `{"op", "id", ...}` for one instance (`"create": true` on its first call, `"drop":
[ids]` for instances whose trajectories ended):

* `{"op": "schemas"}` -> `{"schemas": [...]}`
* `{"op": "reset", "problem": {"id", "prompt", "answer"}}` -> `{"messages", "schemas", "stats"}`
* `{"op": "step", "text": str}` -> `{"observations", "done", "stats"}`
* `{"op": "reward", "trajectory": {"problem", "messages", "stats", "finish_reason"}}` -> `{"value"}`;
  the instance is dropped after it

or `{"error": "Type: message"}` when user code raised, `{"lost": true}` for an instance this process
does not hold (it was started after a failure took the one that did). Mid-call the host asks its
worker `{"tool": name, "arguments": {...}}` (rollout.agent.tools run in the worker's tool processes) and
`{"parse": text}` (the run's tool-call parser, when it needs the worker's tokenizer or is a user's)."""

from __future__ import annotations

import argparse
import json
import numbers
import sys
from dataclasses import asdict, dataclass

from tidal.hosted import serve


@dataclass(frozen=True)
class Problem:
    """What reset() is given, and a Trajectory's `problem`."""

    id: int
    prompt: str
    answer: str


class AskedTools:
    """rollout.agent.tools as an environment in this process calls them: each call is a question to the
    worker, which runs it in its tool processes (with their timeout, limits and error texts)."""

    def __init__(self, ask):
        self.ask = ask

    def run(self, tool, arguments: dict):
        from tidal.envs.tools import ToolResult

        reply = self.ask({"tool": tool.name, "arguments": arguments})
        if "text" not in reply:
            return ToolResult(f"error: {tool.name} failed: {reply.get('error', 'no answer from the worker')}", True)
        return ToolResult(reply["text"], bool(reply["failed"]), reply.get("failure"), bool(reply.get("cut")))


def _runs_in_the_worker(**arguments):
    raise RuntimeError("a tool of rollout.agent.tools runs in its worker's tool process")  # Tool.__call__ asks the worker


def asked_parser(ask):
    """The run's tool-call parser, run by the worker (it holds the tokenizer a parser may need)."""
    from tidal.envs.parsing import ParsedTurn, turn_from_json
    from tidal.envs.tools import EnvError

    def parse(text: str, tokenizer=None, tools=None) -> ParsedTurn:
        reply = ask({"parse": text})
        if "content" not in reply:
            raise EnvError(f"rollout.agent.tool_parser: {reply.get('error', 'no answer from the worker')}")
        return turn_from_json(reply, "rollout.agent.tool_parser")

    return parse


def crossing(value):
    """A reward as JSON carries it: a number as a float (numpy's too), a dict's values likewise; the
    rest as it is (the worker's check says what is wrong with it)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        return {str(k): crossing(v) for k, v in value.items()}
    return value


def trajectory_of(data: dict):
    from tidal.envs.base import EnvStats, Trajectory

    return Trajectory(Problem(**data["problem"]), data["messages"], EnvStats(**data["stats"]), data["finish_reason"])


def run_op(env, call: dict) -> dict:
    op = call["op"]
    if op == "schemas":
        return {"schemas": env.tool_schemas}
    if op == "reset":
        messages = list(env.reset(Problem(**call["problem"])))
        return {"messages": messages, "schemas": env.tool_schemas, "stats": asdict(env.stats)}
    if op == "step":
        observations, done = env.step(call["text"])
        return {"observations": list(observations), "done": bool(done), "stats": asdict(env.stats)}
    if op == "reward":
        return {"value": crossing(env.reward(trajectory_of(call["trajectory"])))}
    raise ValueError(f"unknown op {op!r}")


def answer(call: dict, build, instances: dict, memory_mb: int | None) -> dict:
    for gone in call.get("drop", ()):
        instances.pop(gone, None)
    key = call["id"]
    try:
        if key not in instances:
            if not call.get("create"):
                return {"lost": True}
            instances[key] = build()
        reply = run_op(instances[key], call)
        try:
            json.dumps(reply)
        except (TypeError, ValueError) as err:
            return {"error": f"TypeError: {call['op']}() returned what JSON cannot carry ({err})"}
        return reply
    except MemoryError:
        instances.pop(key, None)  # what it holds would fail its next call too
        return {"error": f"MemoryError: over its memory limit ({memory_mb} MB, rollout.agent.env_memory_mb)"}
    except Exception as err:  # noqa: BLE001 - user code; SystemExit is not caught: the host exits and the worker replaces it
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        if call["op"] == "reward":
            instances.pop(key, None)  # its trajectory is over


def load(reference: str, bind: dict, ask, memory_mb: int | None):
    from tidal.envs.base import EnvironmentFactory, resolve_environment
    from tidal.envs.tools import Tool

    tools = [Tool(s["function"]["name"], _runs_in_the_worker, s, s["function"]["name"], AskedTools(ask)) for s in bind["tools"]]
    parser = bind.get("parser") or asked_parser(ask)  # a built-in parser's name: it reads the text alone, here
    build = EnvironmentFactory(resolve_environment(reference), tools, parser, None, bind["max_tool_calls"])
    instances: dict = {}
    return lambda call: answer(call, build, instances, memory_mb)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.envs.env_host")
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--cpu-seconds", type=int)
    parser.add_argument("--bind", default='{"tools": [], "max_tool_calls": 8, "parser": "hermes"}')
    parser.add_argument("reference")
    args = parser.parse_args(argv)
    return serve(lambda ask: load(args.reference, json.loads(args.bind), ask, args.memory_mb), args.memory_mb, args.cpu_seconds, asks=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

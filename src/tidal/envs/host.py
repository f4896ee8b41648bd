"""`python -m tidal.envs.host [--memory-mb M] [--cpu-seconds S] [--output-bytes B] NAME...`: a process
that runs the run's tools (rollout.agent.tools) for its worker (tidal.hosted.serve: JSON lines, prints to
stderr, exits with its parent, rlimits).

The parent asks `{"describe": true}` for the tools' JSON schemas (`{"schemas": {NAME: schema}}`), then
writes calls `{"fn": NAME, "arguments": {...}}` (arguments already checked against the tool's
schema; with rollout.agent.tool_latency also `"delay": seconds`, slept before the tool runs), the host answers `{"text": str}` (the tool's value as text, at most B bytes of UTF-8; `"cut":
n` when the text had n bytes) or `{"error": "Type: message"}`."""

from __future__ import annotations

import argparse
import sys
import time

from tidal.hosted import serve


def answer(call: dict, functions: dict, output_bytes: int, memory_mb: int | None) -> dict:
    from tidal.envs.tools import as_text

    if call.get("delay"):  # rollout.agent.tool_latency: a slow tool, inside the tool's process and its timeout
        time.sleep(call["delay"])
    try:
        text = as_text(functions[call["fn"]](**call["arguments"]))
    except MemoryError:
        return {"error": f"MemoryError: over its memory limit ({memory_mb} MB, rollout.agent.tool_memory_mb)"}
    except Exception as err:  # noqa: BLE001 - user code; SystemExit is not caught: the host exits and the parent replaces it
        return {"error": f"{type(err).__name__}: {err}"}
    encoded = text.encode("utf-8", "replace")
    if len(encoded) <= output_bytes:
        return {"text": text}
    return {"text": encoded[:output_bytes].decode("utf-8", "ignore"), "cut": len(encoded)}


def describe(functions: dict) -> dict:
    """Each tool's JSON schema, for the worker: a user's tool module is imported here, in the sandbox,
    never in the worker. A tool without one is an error naming it."""
    from tidal.envs.tools import EnvError, Tool

    try:
        return {"schemas": {name: Tool.from_function(fn, name).schema for name, fn in functions.items()}}
    except EnvError as err:
        return {"error": f"EnvError: {err}"}


def load(names: list[str], output_bytes: int, memory_mb: int | None):
    from tidal.envs.tools import tool_function

    functions = {name: tool_function(name) for name in names}
    return lambda call: describe(functions) if call.get("describe") else answer(call, functions, output_bytes, memory_mb)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.envs.host")
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--cpu-seconds", type=int)
    parser.add_argument("--output-bytes", type=int, default=65536)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    return serve(lambda: load(args.names, args.output_bytes, args.memory_mb), args.memory_mb, args.cpu_seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

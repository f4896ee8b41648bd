"""`python -m tidal.rewards.host [--memory-mb M] [--cpu-seconds S] NAME...`: a process that runs user
reward functions for its parent (tidal.hosted.serve: JSON lines, prints to stderr, exits with its
parent, in the sandbox, rlimits).

The parent writes `{"fn", "completion", "answer"}`, the host answers `{"value": float}` or
`{"error": "Type: message"}`. After resolving its functions it says `{"ready": true}`, or
`{"fatal": message}` and exits."""

from __future__ import annotations

import argparse
import sys

from tidal.hosted import serve


def answer(call: dict, functions: dict) -> dict:
    from tidal.rewards import checked_reward

    try:
        return {"value": checked_reward(functions[call["fn"]](call["completion"], call["answer"]))}
    except Exception as err:  # user code; SystemExit is not caught: the host exits and the parent replaces it
        return {"error": f"{type(err).__name__}: {err}"}


def load(names: list[str]):
    from tidal.rewards import check_reward_signature, resolve

    functions = {name: resolve(name) for name in names}
    for name, fn in functions.items():
        check_reward_signature(name, fn)
    return lambda call: answer(call, functions)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.rewards.host")
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--cpu-seconds", type=int)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    return serve(lambda: load(args.names), args.memory_mb, args.cpu_seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

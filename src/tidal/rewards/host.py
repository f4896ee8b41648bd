"""`python -m tidal.rewards.host NAME...`: a process that runs user reward functions for its parent
(tidal.hosted.serve: JSON lines, prints to stderr, exits with its parent).

The parent writes `{"fn", "completion", "answer"}`, the host answers `{"value": float}` or
`{"error": "Type: message"}`. After resolving its functions it says `{"ready": true}`, or
`{"fatal": message}` and exits."""

from __future__ import annotations

import sys

from tidal.hosted import serve


def answer(call: dict, functions: dict) -> dict:
    from tidal.rewards import checked_reward

    try:
        return {"value": checked_reward(functions[call["fn"]](call["completion"], call["answer"]))}
    except Exception as err:  # user code; SystemExit is not caught: the host exits and the parent replaces it
        return {"error": f"{type(err).__name__}: {err}"}


def load(names: list[str]):
    from tidal.rewards import resolve

    functions = {name: resolve(name) for name in names}
    return lambda call: answer(call, functions)


if __name__ == "__main__":
    sys.exit(serve(lambda: load(sys.argv[1:])))

"""`python -m tidal.rewards.host NAME...`: a process that runs user reward functions for its parent.

JSON lines, nothing pickled: the parent writes `{"fn", "completion", "answer"}`, the host answers
`{"value": float}` or `{"error": "Type: message"}`. After resolving its functions it says
`{"ready": true}`, or `{"fatal": message}` and exits. The protocol has the process's real stdout to
itself: user code that prints writes to stderr (the worker's log)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def die_with_parent(parent: int) -> None:
    """Exits when the worker is gone, even while a user function hangs (the closed stdin is seen only
    between calls). A polling thread, not PR_SET_PDEATHSIG: that fires when the *thread* that started
    the host ends, and workers score on pool threads."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def answer(call: dict, functions: dict) -> dict:
    from tidal.rewards import checked_reward

    try:
        return {"value": checked_reward(functions[call["fn"]](call["completion"], call["answer"]))}
    except Exception as err:  # user code; SystemExit is not caught: the host exits and the parent replaces it
        return {"error": f"{type(err).__name__}: {err}"}


def main(names: list[str]) -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    die_with_parent(os.getppid())
    from tidal.rewards import RewardError, resolve

    try:
        functions = {name: resolve(name) for name in names}
    except RewardError as err:
        protocol.write(json.dumps({"fatal": str(err)}) + "\n")
        return 1
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in iter(sys.stdin.readline, ""):
        protocol.write(json.dumps(answer(json.loads(line), functions)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

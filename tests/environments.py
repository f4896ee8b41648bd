"""Environment classes of the tests, named `tests.environments:NAME` in rollout.agent.env as a user's would be.
A run and AgentLoop.from_config keep them in sandboxed environment processes (tidal.envs.sandboxed), so
this module imports nothing heavy, and what a test reads back from them, beside the trajectories,
comes through files in $TIDAL_TEST_MARKERS (the sandbox's write_paths)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from tidal.envs import Environment, Trajectory
from tidal.envs.parsing import ParsedTurn, ToolCall

MARKERS = "TIDAL_TEST_MARKERS"


class Chatty(Environment):
    """Answers every turn with "ok" (never done), and rewards the number of turns taken."""

    def step(self, assistant_text: str):
        return [{"role": "tool", "content": "ok"}], False

    def reward(self, trajectory: Trajectory) -> dict[str, float]:
        return {"turns": float(sum(m["role"] == "assistant" for m in trajectory.messages))}


class Counted(Chatty):
    """Chatty that scores 1 when its step() ran exactly once per answer in the trajectory (no turn answered
    twice, none lost), and -1 otherwise."""

    def __init__(self):
        self.steps = 0

    def step(self, assistant_text: str):
        self.steps += 1
        return super().step(assistant_text)

    def reward(self, trajectory: Trajectory) -> float:
        return 1.0 if self.steps == sum(m["role"] == "tool" for m in trajectory.messages) else -1.0


class Verbose(Chatty):
    def step(self, assistant_text: str):
        return [{"role": "tool", "content": "x" * 300}], False


class Fragile(Chatty):
    """Raises on its second turn (its state, a count of turns, is kept between the calls of its trajectory)."""

    def __init__(self):
        self.turn = 0

    def step(self, assistant_text: str):
        self.turn += 1
        if self.turn == 2:
            raise ConnectionError("the sandbox went away")
        return super().step(assistant_text)


def record_step(started: float) -> None:
    """One step's span and process, in $TIDAL_TEST_MARKERS (when set): `steps_at_once` reads them."""
    markers = os.environ.get(MARKERS)
    if markers:
        span = {"pid": os.getpid(), "start": started, "end": time.time()}
        Path(markers, f"step-{uuid.uuid4().hex}.json").write_text(json.dumps(span))


def steps_at_once(markers: Path) -> tuple[int, int]:
    """(the most steps that ran at once, the processes they ran in), from `record_step`'s files."""
    spans = [json.loads(p.read_text()) for p in markers.glob("step-*.json")]
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans])
    running = most = 0
    for _, change in edges:
        running += change
        most = max(most, running)
    return most, len({s["pid"] for s in spans})


class Overlapping(Chatty):
    """Chatty whose steps take 0.2 s each, recorded (record_step)."""

    def step(self, assistant_text: str):
        started = time.time()
        time.sleep(0.2)
        record_step(started)
        return super().step(assistant_text)


class SlowOnProblemZero(Chatty):
    """Chatty whose steps for problem 0 take 3 s each (a slow tool call); every other problem's are instant."""

    def reset(self, problem):
        self.slow = problem.id == 0
        return super().reset(problem)

    def step(self, assistant_text: str):
        if self.slow:
            time.sleep(3)
        return super().step(assistant_text)


class StepRaises(Environment):
    """Every step() raises: each trajectory that ends a turn ends there, its reward from reward.functions."""

    def step(self, assistant_text: str):
        raise RuntimeError("the sandbox is gone")


class CalcFirst(Environment):
    """The `tools` environment (rollout.agent.tools [calc]), except that a first turn without a tool call
    (the tiny model cannot write one) is answered by calling calc on the problem, as if the model
    had: every trajectory whose first turn ends gets a tool observation and a second turn. Steps
    take a while, as tools do, and are recorded (record_step)."""

    step_seconds = 0.2

    def reset(self, problem):
        self.expression = problem.prompt.rstrip("= ")
        return super().reset(problem)

    def step(self, assistant_text: str):
        started = time.time()
        time.sleep(self.step_seconds)
        observations, done = super().step(assistant_text)
        record_step(started)
        if done and self.stats.turns == 1:
            return [self.calc()], False
        return observations, done

    def calc(self) -> dict:
        return self.call(ToolCall("calc", {"expression": self.expression}))

    def reward(self, trajectory) -> float:
        """Varies within a group (the tiny model's answers are all wrong), so every group is trained on."""
        return len(trajectory.final_text) / 10


_attempted = False  # in this process


class CalcFirstAndHostile(CalcFirst):
    """CalcFirst that tries to take the run itself in its first step (tests.hostile.attempts, once per
    environment process), and whose fallback also calls tests.hostile:hostile_tool, which tries from
    the worker's tool process."""

    def step(self, assistant_text: str):
        global _attempted
        if not _attempted:
            _attempted = True
            from tests.hostile import attempts

            attempts("env")
        return super().step(assistant_text)

    def calc(self) -> dict:
        self.call(ToolCall("hostile_tool", {}))
        return super().calc()


class Misbehaves(Environment):
    """Does what the turn's text says: `count` (its steps so far: its state), `daemon` (starts a
    sleeper in a session of its own; its pid), `raise`, `hang`, `exit`, `allocate MB` (touches MB)."""

    def __init__(self):
        self.steps = 0

    def step(self, assistant_text: str):
        self.steps += 1
        command, _, argument = assistant_text.partition(" ")
        if command == "daemon":
            pid = os.fork()
            if pid == 0:
                os.setsid()
                time.sleep(600)
                os._exit(0)
            return [{"role": "tool", "content": str(pid)}], False
        if command == "raise":
            raise KeyError("no such cell")
        if command == "hang":
            time.sleep(600)
        if command == "exit":
            os._exit(3)
        if command == "allocate":
            block = bytearray(int(argument) << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
        return [{"role": "tool", "content": str(self.steps)}], False


class Exits(Chatty):
    """Chatty whose process exits in every step: each trajectory that steps fails, none is lost."""

    def step(self, assistant_text: str):
        os._exit(3)


class Plain(Environment):
    """The base environment, as a user's class: tool calls until a turn makes none."""


def colon_calls(text: str, tokenizer=None, tools=None) -> ParsedTurn:
    """A user's tool-call parser: a turn `NAME: EXPRESSION` calls NAME(expression=EXPRESSION)."""
    name, sep, expression = text.partition(": ")
    return ParsedTurn(text, [ToolCall(name, {"expression": expression})] if sep else [])


class CallsForEver(Environment):
    """A step that calls a tool of rollout.agent.tools again and again, never answering."""

    def step(self, assistant_text: str):
        while True:
            self.call(ToolCall("calc", {"expression": "1+1"}))


class Reviewed(Environment):
    """The `tools` environment (rollout.agent.tools), except that the first answer without a tool call is
    answered once by the user, who asks for a check: an observation in the user's role, after which a
    Qwen3-style template renders every earlier assistant turn of the chat without its reasoning."""

    def __init__(self):
        self.reviewed = False

    def step(self, assistant_text: str):
        observations, done = super().step(assistant_text)
        if done and not self.reviewed:
            self.reviewed = True
            return [{"role": "user", "content": "Check it once more."}], False
        return observations, done


class Recount(Environment):
    """A verifier that knows the answer: a wrong final answer is answered "count again" (one more turn), a right
    one ends the trajectory; the run's reward functions score the last answer."""

    def reset(self, problem):
        self.answer = str(problem.answer).strip()
        return super().reset(problem)

    def step(self, assistant_text: str):
        said = assistant_text.rpartition("A:")[2].strip()
        if said == self.answer:
            return [], True
        return [{"role": "user", "content": "count again"}], False

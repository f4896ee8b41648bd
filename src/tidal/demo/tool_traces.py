"""Synthetic tool-use traces for the tiny model's warm start (rollout.agent with the built-in `calc` or
`python` tool on the arithmetic task).

RL on an agent needs a policy that already speaks the chat and tool-call format and sometimes uses
the tool well: then a group's trajectories differ in whether they called the tool and how, and
the advantage says which was better. The traces are a mix: most answer in the head (the tiny
model cannot multiply, so those answers are mostly wrong), some call the tool correctly and copy
its result (`calc` with the expression, `python` with a program that prints it), and some call it
wrongly: a mistyped operand, or a malformed call (an argument `calc` does not take, which the
environment answers with an error; a `python` program that forgets to print, which prints nothing).
Each trace is played through the run's own environment,
chat template and token layout (tidal.rollout.agent), so the SFT sees exactly the tokens RL will:
the assistant turns are labelled, the prompt and every inserted token are not.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from tidal.data import Problem
from tidal.demo.length_tail import ScratchPads
from tidal.envs.python_tool import NO_OUTPUT

TRACE_KINDS = ("direct", "tool", "typo", "malformed")
TRACE_TOOLS = ("calc", "python")  # the built-in tools the traces know how to call


def tool_call_text(name: str, arguments: dict) -> str:
    """One Hermes-format tool call, compact (every character is a token for the tiny model)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def expression_of(prompt: str) -> str:
    """The arithmetic expression of an arithmetic prompt ("931*140=" -> "931*140")."""
    return prompt.strip().rstrip("=").strip()


def mistype(expression: str, rng: random.Random) -> str:
    """The expression with one digit changed: a call that runs but answers another question."""
    positions = [i for i, c in enumerate(expression) if c.isdigit()]
    i = rng.choice(positions)
    digit = rng.choice([d for d in "0123456789" if d != expression[i]])
    return expression[:i] + digit + expression[i + 1 :]


def trace_kind(rng: random.Random, tool_use: float, tool_mistakes: float) -> str:
    if rng.random() >= tool_use:
        return "direct"
    if rng.random() >= tool_mistakes:
        return "tool"
    return rng.choice(("typo", "malformed"))


def trace_tool(tools: list[str]) -> str | None:
    """The tool the traces call: the first of rollout.agent.tools they know, or None."""
    return next((t for t in tools if t in TRACE_TOOLS), None)


def call_arguments(tool: str, expression: str) -> dict:
    """The arguments of a call that computes `expression`."""
    return {"code": f"print({expression})"} if tool == "python" else {"expression": expression}


def malformed_arguments(tool: str, expression: str) -> dict:
    """A call that cannot give the answer: calc with an argument it does not take (an error), a
    program that computes the value but never prints it (no output)."""
    return {"code": expression} if tool == "python" else {"expr": expression}


def first_turn(kind: str, problem: Problem, rng: random.Random, tool: str = "calc") -> str:
    expression = expression_of(problem.prompt)
    if kind == "direct":
        return f"A: {problem.answer}"
    if kind == "tool":
        return tool_call_text(tool, call_arguments(tool, expression))
    if kind == "typo":
        return tool_call_text(tool, call_arguments(tool, mistype(expression, rng)))
    return tool_call_text(tool, malformed_arguments(tool, expression))


def answer_after(observations: list[dict], problem: Problem) -> str:
    """The final turn after the tool answered: its result copied, or, after an error or a program
    that printed nothing, a guess."""
    result = str(observations[-1].get("content", "")).strip() if observations else ""
    return f"A: {problem.answer}" if result.startswith("error") or result == NO_OUTPUT else f"A: {result}"


@dataclass
class Trace:
    token_ids: list[int]  # prompt + trajectory, as the rollout lays it out
    labels: list[int]  # the token where the policy sampled it, -100 elsewhere
    kind: str


def play_trace(loop, problem: Problem, kind: str, rng: random.Random, tool: str = "calc", pad: Callable[[str, int], str] | None = None) -> Trace:
    """Plays one scripted trajectory through the run's environment and template (`loop`: an AgentLoop).
    `pad(text, tokens)`: the first turn with a scratch pad before it (model.warm_start.length_tail)."""
    row = loop.start_row(problem)
    tools = row.env.tool_schemas
    ids = loop.render(row.messages, tools, True)
    labels = [-100] * len(ids)
    text = first_turn(kind, problem, rng, tool)
    if pad is not None:
        text = pad(text, len(loop.tokenizer(text, add_special_tokens=False).input_ids))
    for _ in range(loop.cfg.rollout.agent.max_turns):
        sampled = loop.tokenizer(text, add_special_tokens=False).input_ids + [loop.eos]
        ids += sampled
        labels += sampled
        observations, done = row.env.step(text)
        if done:
            break
        inserted = loop.fit_observations(observations, tools, row)
        if inserted is None:
            break
        ids += inserted
        labels += [-100] * len(inserted)
        text = answer_after(observations, problem)
    return Trace(ids, labels, kind)


def make_traces(
    loop, problems: list[Problem], tool_use: float, tool_mistakes: float, seed: int, tool: str = "calc", pads: ScratchPads | None = None
) -> list[Trace]:
    """One trace per problem; with `pads` (model.warm_start.length_tail) trace n's first turn has pad n."""
    rng = random.Random(f"tidal-tool-traces-{seed}")
    return [
        play_trace(loop, p, trace_kind(rng, tool_use, tool_mistakes), rng, tool, None if pads is None else partial(pads.pad, n))
        for n, p in enumerate(problems)
    ]


def trace_batch(traces: list[Trace], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels."""
    width = max(len(t.token_ids) for t in traces)
    ids = torch.tensor([t.token_ids + [pad] * (width - len(t.token_ids)) for t in traces])
    labels = torch.tensor([t.labels + [-100] * (width - len(t.labels)) for t in traces])
    mask = torch.tensor([[1] * len(t.token_ids) + [0] * (width - len(t.token_ids)) for t in traces])
    return ids, mask, labels


def trace_batcher(traces: list[Trace], pad: int, chunks: int = 3) -> Callable[[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Batches in `chunks` chunks of rows of similar length: the answers in the head are a third as
    long as the tool calls, and padding them to the longest trace would double the SFT's cost."""

    def batch(indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        rows = sorted((traces[i] for i in indices), key=lambda t: len(t.token_ids))
        size = -(-len(rows) // chunks)
        return [trace_batch(rows[at : at + size], pad) for at in range(0, len(rows), size)]

    return batch

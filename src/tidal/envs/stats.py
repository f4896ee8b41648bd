"""What happened in one trajectory's environment: counted in the worker and in an environment process alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EnvStats:
    """What happened in one trajectory's environment, for the run's metrics."""

    turns: int = 0  # assistant turns the environment answered
    tool_calls: int = 0  # calls that ran (their result or their error was shown)
    tool_errors: int = 0  # calls that ran and failed: unknown tool, bad arguments, the tool raised, timed out or crashed
    tool_timeouts: int = 0  # of those, isolated calls past rollout.agent.tool_timeout_seconds (their process was replaced)
    tool_crashes: int = 0  # of those, isolated calls whose process died: a crash, an exit, the CPU limit
    tool_outputs_cut: int = 0  # results cut at rollout.agent.tool_output_bytes
    malformed_calls: int = 0  # calls that could not be read at all (error observations)
    unparsable_turns: int = 0  # turns whose tool-call markup the tokenizer's response template dropped
    refused_calls: int = 0  # calls past max_tool_calls (error observations)
    env_seconds: float = 0.0  # time spent in step()

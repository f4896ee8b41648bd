"""Environments and tools for multi-turn (agentic) rollouts. Imported by the rollout side only: the
trainer sees trajectories (tokens and a loss mask), never an environment."""

from tidal.envs.base import (  # noqa: F401
    BUILT_IN_ENVIRONMENTS,
    Environment,
    EnvironmentFactory,
    EnvStats,
    Trajectory,
    resolve_environment,
    tool_message,
)
from tidal.envs.isolation import ToolHost, ToolLimits  # noqa: F401
from tidal.envs.parsing import (  # noqa: F401
    TOOL_CALL_PARSERS,
    ParsedTurn,
    ToolCall,
    hermes,
    hermes_regex,
    register_tool_call_parser,
    resolve_tool_call_parser,
)
from tidal.envs.tools import BUILT_IN_TOOLS, EnvError, Tool, ToolResult, calc, python, resolve_tool, run_arguments, tool  # noqa: F401

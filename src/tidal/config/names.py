"""The built-in names a config may use, read from the registries that define them (each list is written once,
there): the config checks a name against them, and the configuration reference lists them. Every registry
read here imports no torch and nothing of the config."""

from __future__ import annotations


def _reward_functions() -> tuple[str, ...]:
    from tidal.rewards.builtin import REGISTRY

    return tuple(REGISTRY)


def _environments() -> tuple[str, ...]:
    from tidal.envs.base import BUILT_IN_ENVIRONMENTS

    return tuple(BUILT_IN_ENVIRONMENTS)


def _tools() -> tuple[str, ...]:
    from tidal.envs.tools import BUILT_IN_TOOLS

    return tuple(BUILT_IN_TOOLS)


def _tool_parsers() -> tuple[str, ...]:
    from tidal.envs.parsing import TOOL_CALL_PARSERS

    return tuple(TOOL_CALL_PARSERS)


def _advantages() -> tuple[str, ...]:
    from tidal.algo.names import ADVANTAGES

    return ADVANTAGES


def _policy_losses() -> tuple[str, ...]:
    from tidal.algo.names import POLICY_LOSSES

    return POLICY_LOSSES


REGISTRIES = {
    "reward function": _reward_functions,
    "environment": _environments,
    "tool": _tools,
    "tool-call parser": _tool_parsers,
    "advantage estimator": _advantages,
    "policy loss": _policy_losses,
}


def registered(kind: str) -> tuple[str, ...]:
    """The built-in names of `kind` (a key of REGISTRIES), in their registry's order."""
    return REGISTRIES[kind]()

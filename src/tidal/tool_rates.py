"""Tool-use rates of multi-turn rollouts, from the environment counts groups carry (Group.env_stats)."""

from __future__ import annotations


def tool_use_rates(env_totals: dict[str, float]) -> dict[str, float | None]:
    """From groups' environment counts, summed (Group.env_stats): the share of trajectories that
    tried a tool call, the share of tried calls that failed (unreadable, refused, unknown tool, bad
    arguments, the tool failed; 0 when none was tried) and its complement the success rate (None
    when none was tried), and assistant turns per trajectory."""
    trajectories = max(1.0, env_totals.get("trajectories", 0.0))
    attempted = env_totals.get("tool_calls", 0.0) + env_totals.get("malformed_calls", 0.0) + env_totals.get("refused_calls", 0.0)
    failed = env_totals.get("tool_errors", 0.0) + env_totals.get("malformed_calls", 0.0) + env_totals.get("refused_calls", 0.0)
    return {
        "tool_use_rate": env_totals.get("tool_using", 0.0) / trajectories,
        "tool_error_rate": failed / attempted if attempted else 0.0,
        "tool_success_rate": 1.0 - failed / attempted if attempted else None,
        "turns_mean": env_totals.get("turns", 0.0) / trajectories,
    }

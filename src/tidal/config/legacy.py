"""Keys of older configs, still read where users have them in files (and in run directories' config.yaml):
each is put where it lives now, and one warning line names the old keys and their new places.

- the multi-turn keys once flat under `rollout` (`rollout.env`, `rollout.tools`, ...) are `rollout.agent.*`;
  beside `rollout.env: null` (what a run directory saved for a single-turn run) they were inert defaults;
- `batch_size` of a judge entry, which a judge never read (one sample per request)."""

from __future__ import annotations

from typing import Any

from tidal.config.base import ConfigError
from tidal.config.rollout import AgentConfig

AGENT_KEYS = tuple(AgentConfig.model_fields)


def upgrade(data: dict, source: str) -> tuple[dict, list[str]]:
    """`data` (a config as read, overrides applied) in today's form, and one warning line per kind of old key."""
    notes: list[str] = []
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and any(k in rollout for k in AGENT_KEYS):
        rollout, note = _agent_keys_moved(rollout, source)
        data = {**data, "rollout": rollout}
        notes.append(note)
    reward = data.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("functions"), list):
        functions, note = _judge_batch_size_dropped(reward["functions"], source)
        if note:
            data = {**data, "reward": {**reward, "functions": functions}}
            notes.append(note)
    return data, notes


def _agent_keys_moved(rollout: dict, source: str) -> tuple[dict, str]:
    old = {k: rollout[k] for k in AGENT_KEYS if k in rollout}
    rest = {k: v for k, v in rollout.items() if k not in old}
    olds = ", ".join(f"rollout.{k}" for k in old)
    if old.get("env") is None:
        defaults = {k: f.default for k, f in AgentConfig.model_fields.items() if k != "env"}
        stray = [f"rollout.{k}" for k, v in old.items() if k != "env" and v != defaults[k]]
        agent = rest.get("agent")
        if stray and not isinstance(agent, dict):
            raise ConfigError(
                f"invalid config ({source}): {', '.join(stray)}: only for multi-turn rollouts, which are rollout.agent now: "
                "write them under rollout.agent with its env (e.g. env: tools), or leave them out"
            )
        if isinstance(agent, dict):
            rest["agent"] = {**agent, **{k: v for k, v in old.items() if k != "env"}}
            return rest, f"{source}: {olds} are old keys, read as {_new_places(old)}: write them under rollout.agent"
        return rest, f"{source}: {olds} are old single-turn keys (no environment), read as rollout.agent unset: leave them out"
    agent = rest.get("agent")
    rest["agent"] = {**(agent if isinstance(agent, dict) else {}), **old}
    return rest, f"{source}: {olds} are old keys, read as {_new_places(old)}: write them under rollout.agent"


def _new_places(old: dict[str, Any]) -> str:
    return ", ".join(f"rollout.agent.{k}" for k in old)


def _judge_batch_size_dropped(functions: list, source: str) -> tuple[list, str | None]:
    judges = [f for f in functions if isinstance(f, dict) and f.get("type") == "judge" and "batch_size" in f]
    if not judges:
        return functions, None
    kept = [{k: v for k, v in f.items() if k != "batch_size"} if any(f is j for j in judges) else f for f in functions]
    labels = ", ".join(f"reward.functions[{f.get('name') or 'judge'}].batch_size" for f in judges)
    return kept, f"{source}: {labels} is not read (a judge sends one sample per request): leave it out"

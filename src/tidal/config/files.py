"""Config files: YAML (and --set overrides) in, a validated TidalConfig out; the resolved config
written back; what a resumed run may change."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tidal.config.legacy import upgrade
from tidal.config.reward import REWARD_TYPES
from tidal.config.schema import ConfigError, TidalConfig

log = logging.getLogger(__name__)
_SHOWN_VALUE_CHARS = 80


def _without_union_tags(loc: tuple) -> tuple[tuple, str | None]:
    """An error's location without the tag pydantic inserts for a reward entry's kind (`reward.functions.0.judge.url`
    is the user's `reward.functions.0.url`), and that tag."""
    for i in range(2, len(loc)):
        if loc[i - 2] == "functions" and isinstance(loc[i - 1], int) and loc[i] in REWARD_TYPES:
            return loc[:i] + loc[i + 1 :], loc[i]
    return loc, None


def _error_line(e: dict) -> str:
    """One error as `key: reason (got value)`. A check over a whole block (a section's or the config's
    own rule) names its keys in its reason: its input, the block, is not echoed back."""
    loc, kind = _without_union_tags(tuple(e["loc"]))
    key = ".".join(str(p) for p in loc)
    if e["type"] == "extra_forbidden" and kind is not None:
        owners = [repr(t) for t, cls in REWARD_TYPES.items() if loc[-1] in cls.model_fields]
        if owners:
            return f"{key}: only for type {' or '.join(owners)}, not {kind!r}"
    if e["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    reason = e["msg"].removeprefix("Value error, ")
    value = e.get("input")
    if isinstance(value, dict):
        return reason if not key or re.match(rf"{re.escape(key)}\b", reason) else f"{key}: {reason}"
    shown = repr(value)
    if len(shown) > _SHOWN_VALUE_CHARS:
        shown = shown[: _SHOWN_VALUE_CHARS - 3] + "..."
    return f"{key or '<root>'}: {reason} (got {shown})"


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        lines.append(f"  {_error_line(e)}")
    if len(lines) == 2:  # one error: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.iterations=3` -> (["trainer", "iterations"], 3); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`section.key=value`; a number steps into a list the config gives (`reward.functions.0.weight=2`)."""
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_list_index(node, path, depth, text)]
                continue
            if part not in node and path[depth + 1].isdigit():
                raise ConfigError(
                    f"override {text!r}: {'.'.join(path[: depth + 1])} is not in the config, so it has no item {path[depth + 1]}: "
                    f"set the whole list, e.g. --set '{'.'.join(path[: depth + 1])}=[...]'"
                )
            node = node.setdefault(part, {})
            if not isinstance(node, dict | list):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        if isinstance(node, list):
            node[_list_index(node, path, len(path) - 1, text)] = value
        else:
            node[path[-1]] = value
    return data


def _list_index(items: list, path: list[str], depth: int, text: str) -> int:
    where = ".".join(path[:depth])
    if not path[depth].isdigit():
        raise ConfigError(f"override {text!r}: {where} is a list: its items are numbered from 0, not named {path[depth]!r}")
    index = int(path[depth])
    if index >= len(items):
        raise ConfigError(f"override {text!r}: {where} has {len(items)} item(s), numbered from 0")
    return index


def config_from_dict(data: dict, source: str = "<dict>", on_old_keys: Callable[[str], None] = log.warning) -> TidalConfig:
    """The validated config of `data`. Old keys (tidal.config.legacy) are read at their new places; `on_old_keys`
    gets one line per kind of old key, naming them and where they live now."""
    data, notes = upgrade(data, source)
    for note in notes:
        on_old_keys(note)
    try:
        return TidalConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(
    path: str | os.PathLike | None,
    overrides: list[str] = (),
    base_dir: str | os.PathLike | None = None,
    on_old_keys: Callable[[str], None] = log.warning,
) -> TidalConfig:
    """The config in `path` (defaults when None) with `key=value` overrides applied. Relative data
    paths in the file are relative to `base_dir` (default: the file's folder); in overrides, to the
    working directory. The result holds absolute data paths, so it can be dumped and reloaded anywhere.
    `on_old_keys`: see config_from_dict."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        source = str(p)
        data = _data_paths_from(Path(base_dir) if base_dir is not None else p.parent, data)
    data = _data_paths_from(Path.cwd(), apply_overrides(data, list(overrides)))
    return config_from_dict(data, source, on_old_keys)


def _data_paths_from(base: Path, data: dict) -> dict:
    """Relative `data.path` / `data.eval_path` made absolute against `base`."""
    section = data.get("data")
    if not isinstance(section, dict):
        return data
    resolved = {
        k: str((base / v).resolve()) if k in ("path", "eval_path") and isinstance(v, str) and not Path(v).is_absolute() else v
        for k, v in section.items()
    }
    return {**data, "data": resolved}


def dump_config(cfg: TidalConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: TidalConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(node)

    walk("", cfg.model_dump(mode="json"))
    return out


# Keys that do not change what is trained, so a run directory may be resumed with other values:
# how long and where it runs, how it is observed, how work is spread over processes. Everything else
# (model, data, seed, rewards, rollout sampling, the algorithm and its optimizer) must match.
NON_TRAINING_KEYS = (
    "trainer.iterations",
    "trainer.threads",
    "trainer.tail_threads",
    "trainer.group_timeout_seconds",
    "trainer.max_skipped_steps",  # raised to resume a run that failed on it
    "reward.timeout_seconds",
    "rollout.workers",
    "rollout.workers.",  # the range form's min, max and start
    "rollout.threads",
    "rollout.groups_per_batch",
    "rollout.sync_groups_per_call",
    "rollout.generation_token_budget",
    "rollout.first_call_groups",
    "rollout.max_inflight_groups",
    "model.warm_start.cache_dir",
    "eval.",
    "tracking.",
    "transport.",
    "weights.",  # retention: which old snapshots are kept
)


def training_changes(old: TidalConfig, new: TidalConfig) -> list[str]:
    """`key (old -> new)` for every key whose change would change training (NON_TRAINING_KEYS aside)."""
    a, b = flatten(old), flatten(new)

    def short(value: str | None) -> str:
        text = "unset" if value is None else value
        return text if len(text) <= 60 else text[:57] + "..."

    def counts(key: str) -> bool:
        return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NON_TRAINING_KEYS)

    return [f"{k} ({short(a.get(k))} -> {short(b.get(k))})" for k in [*a, *(k for k in b if k not in a)] if counts(k) and a.get(k) != b.get(k)]

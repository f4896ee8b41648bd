"""Name -> function registries: adding an algorithm is one decorated function, and config validation reads the names."""

from __future__ import annotations

import importlib
from typing import TypeVar

F = TypeVar("F")


def add(registry: dict[str, F], kind: str, name: str, fn: F) -> None:
    """Registers `fn` under `name`; a name already taken is an error (a silent overwrite would change a run's algorithm)."""
    if name in registry:
        raise ValueError(f"{kind} {name!r} is already registered (by {_qualified(registry[name])})")
    registry[name] = fn


def check_built_ins(registry: dict, kind: str, names: tuple[str, ...]) -> None:
    """At the registry's import: its built-ins are exactly tidal.algo.names' list (which the config reads without torch)."""
    if set(registry) != set(names):
        raise ImportError(f"the built-in {kind}s {sorted(registry)} are not tidal.algo.names' {sorted(names)}: list each name there once")


def lookup(registry: dict[str, F], kind: str, name: str) -> F:
    """The function registered under `name`; an unknown name is a ValueError listing the choices.

    `module:function` names a user's function: the module is imported (in every process that reads
    the config, so each role finds it) and the function registered under that name."""
    if name not in registry and ":" in name:
        registry[name] = _import_function(kind, name)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}: choose from {sorted(registry)} or give module:function")
    return registry[name]


def _import_function(kind: str, reference: str):
    module_name, _, attribute = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{kind} {reference!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"{kind} {reference!r}: module {module_name!r} has no function {attribute!r}")
    return fn


def _qualified(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

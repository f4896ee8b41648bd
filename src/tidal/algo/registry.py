"""Name -> function registries: adding an algorithm is one decorated function, and config validation reads the names."""

from __future__ import annotations

from typing import TypeVar

F = TypeVar("F")


def add(registry: dict[str, F], kind: str, name: str, fn: F) -> None:
    """Registers `fn` under `name`; a name already taken is an error (a silent overwrite would change a run's algorithm)."""
    if name in registry:
        raise ValueError(f"{kind} {name!r} is already registered (by {_qualified(registry[name])})")
    registry[name] = fn


def lookup(registry: dict[str, F], kind: str, name: str) -> F:
    """The function registered under `name`; an unknown name is a ValueError listing the choices."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}: choose from {sorted(registry)}")
    return registry[name]


def _qualified(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

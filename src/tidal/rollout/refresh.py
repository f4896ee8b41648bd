"""What a partial rollout asks of its worker (rollout.partial): whether newer weights wait, and to load them.

Its own module so that the turn loops (tidal.rollout.trajectory) and the engines can name it without
importing tidal.rollout.partial, which imports them.
"""

from __future__ import annotations

from typing import Protocol


class Refresh(Protocol):
    """Whether newer weights wait, and to load them (tidal.rollout.partial.PolicyRefresh)."""

    version: int  # the version the engine holds now

    def interrupt(self) -> bool:
        """True when a newer version waits (asked from the engine's thread, between decode steps)."""

    async def swap(self) -> int:
        """Loads the waiting version; returns the version the engine holds after it (unchanged when refused)."""

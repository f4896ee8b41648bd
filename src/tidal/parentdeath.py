"""Linux's parent-death signal (prctl PR_SET_PDEATHSIG): the kernel signals a process when the
thread that started it ends, so a child never outlives its parent, even one killed by SIGKILL or
the OOM killer, and even while the child itself is stuck in C code. Elsewhere it is not set."""

from __future__ import annotations

import functools
import signal

PR_SET_PDEATHSIG = 1


@functools.cache
def prctl():
    """libc's prctl, or None where there is none. Loaded once: a forked child calls it without importing."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Asks for `signum` when this process's parent thread ends; False where prctl is not there.

    The parent is the *thread* that forked this process: started from a thread that ends before its
    process does, a child gets the signal then. Only processes started from a thread that lives as
    long as its process (the main thread, tidal.hosted's spawner) may set it."""
    call = prctl()
    return call is not None and call(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0

"""Each pipeline step as if in its own pod, on one machine (``tidal run --via kfp-local``).

On a cluster every step is a pod: a fresh HOME, cache and working directory, gone when the step
ends; only the run directory (the data volume) is shared. kfp.local runs every step as a
subprocess of one machine, so a step that left something outside the run directory for a later
one would pass there and fail on a cluster. Under :data:`POD_SANDBOX_ENV` each step gets what a
pod would, and loses it when it ends.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from tidal.kube.steps.pod_env import check_pod_env

POD_SANDBOX_ENV = "TIDAL_KFP_LOCAL_PODS"
"""Set by ``tidal run --via kfp-local``: a folder under which each step gets a fresh HOME, cache and
working directory, removed when the step ends, as a pod's would be. Only the run directory is shared."""


def as_separate_pod(step: str):
    """Run the decorated step function as if in its own pod when :data:`POD_SANDBOX_ENV` is set; first, on a cluster
    or not, check the pod's credentials (:mod:`tidal.kube.steps.pod_env`)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            check_pod_env()
            root = os.environ.get(POD_SANDBOX_ENV)
            if not root:
                return function(*args, **kwargs)
            with pod_sandbox(step, Path(root)):
                return function(*args, **kwargs)

        return wrapper

    return decorate


@contextmanager
def pod_sandbox(step: str, root: Path):
    """A fresh HOME, $TIDAL_CACHE and working directory for this process; all removed on exit."""
    root.mkdir(parents=True, exist_ok=True)
    pod = Path(tempfile.mkdtemp(prefix=f"{step}-", dir=root))
    home, work = pod / "home", pod / "work"
    home.mkdir()
    work.mkdir()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(HOME=str(home), TIDAL_CACHE=str(home / ".cache" / "tidal"), XDG_CACHE_HOME=str(home / ".cache"))
    os.chdir(work)
    try:
        yield pod
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(pod, ignore_errors=True)

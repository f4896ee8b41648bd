"""How a step runs Tidal: its CLI verbs in subprocesses, exactly as on a laptop.

Nothing crosses a process boundary pickled: configs are YAML files, results JSON. A verb's output
streams to the step's log; a verb that fails fails the step, naming the verb.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tidal.kube.steps.records import PipelineStepError


def tidal_executable() -> list[str]:
    """The ``tidal`` console script of this interpreter (the image's, or the venv's locally)."""
    beside = Path(sys.executable).with_name("tidal")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("tidal")
    if found:
        return [found]
    raise PipelineStepError(f"the 'tidal' command is not installed next to {sys.executable} nor on PATH; install Tidal in the component image")


def torchrun_executable() -> str:
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.is_file() else (shutil.which("torchrun") or "torchrun")


def run_tidal(args: list[str], capture: bool = False) -> str:
    """Run a ``tidal`` verb; its output streams to this step's log. Raises naming the verb on failure."""
    command = tidal_executable() + args
    print("+ " + " ".join(command), flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE if capture else None, text=True)
    if result.returncode != 0:
        raise PipelineStepError(f"'tidal {args[0]}' exited with status {result.returncode}")
    return result.stdout or ""


def run_command(command: list[str], what: str) -> None:
    print("+ " + " ".join(command), flush=True)
    code = subprocess.run(command).returncode
    if code != 0:
        raise PipelineStepError(f"'{what}' exited with status {code}")


def nats_url_of(config_path: str) -> str:
    """The NATS server the verbs connect to: the staged config's ``transport.nats_url``."""
    from tidal.config import load_config

    url = load_config(config_path).transport.nats_url
    if not url:
        raise PipelineStepError(f"{config_path}: transport.nats_url is empty; the pipeline needs a NATS server")
    return url

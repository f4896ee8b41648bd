"""`tidal scale RUN_DIR N`: the number of rollout workers of a running local run. The command checks
the count and writes it to RUN_DIR/workers.request; the run's launcher (RoleProcesses) starts or
stops workers to match."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tidal.config import load_config
from tidal.rundir import LOCK_FILE, RunDir, RunDirLock


def launcher_alive(run: RunDir) -> bool:
    """Whether the launcher that locked the run directory still runs (its children hold the lock too,
    and would outlive a killed launcher only briefly)."""
    if not RunDirLock(run.root).held():
        return False
    try:
        os.kill(int((run.root / LOCK_FILE).read_text().split()[0]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        pass
    return True


def request_scale(run_dir: str | Path, count: int) -> str:
    """Checks `count` against the run and asks its launcher for it; the line to print. ValueError: refused."""
    run = RunDir(Path(run_dir).resolve())
    if count < 1:
        raise ValueError(f"{count} rollout workers: a run needs at least 1")
    if not run.config.is_file():
        raise ValueError(f"{run.root} holds no run (no config.yaml)")
    if not launcher_alive(run):
        raise ValueError(f"no `tidal run` is running in {run.root}")
    cfg = load_config(run.config)
    if cfg.mode == "sync":
        raise ValueError(f"the run in {run.root} is in sync mode: it has no rollout workers")
    fewest, most = cfg.rollout.worker_bounds
    if most is not None and not fewest <= count <= most:
        raise ValueError(f"{count} rollout workers is outside the run's rollout.workers range [{fewest}, {most}]")
    run.request_workers(count)
    return f"tidal: asked the launcher of {run.root} for {count} rollout worker(s) (its logs/launcher.log says when they run)"


def register(sub) -> None:
    p = sub.add_parser("scale", help="set the number of rollout workers of a running local run")
    p.add_argument("run_dir", help="the run directory of a running `tidal run`")
    p.add_argument("workers", type=int, help="rollout workers to run from now on")
    p.set_defaults(func=scale_command)


def scale_command(args: argparse.Namespace) -> int:
    print(request_scale(args.run_dir, args.workers), flush=True)
    return 0

"""What every role sets up the same way: threads, logging, the dataset, the model."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from tidal.config import TidalConfig

NATS_LOST_EXIT = 75  # a role's exit code when NATS cannot be reached (EX_TEMPFAIL): the launcher may restart it


TAIL_THREADS_ENV = "TIDAL_TAIL_THREADS"  # what `tidal run` resolved trainer.tail_threads to


def tail_threads(cfg: TidalConfig, threads: int) -> int | None:
    """The trainer's threads once its iteration's groups are all in (trainer.tail_threads), when more
    than `threads`; None otherwise. `auto` means something only where `tidal run` resolved it (the
    environment): a pod does not know whose cores are free."""
    if cfg.mode != "periodic" or cfg.trainer.tail_threads is None:
        return None
    tail = int(os.environ.get(TAIL_THREADS_ENV, 0)) if cfg.trainer.tail_threads == "auto" else cfg.trainer.tail_threads
    return tail if tail > threads else None


def set_threads(n: int) -> None:
    import torch  # here, not at the top: a refusal before anything starts should not wait for torch

    torch.set_num_threads(max(1, n))
    os.environ["OMP_NUM_THREADS"] = str(max(1, n))


def split_cores(cfg: TidalConfig, cores: int | None = None) -> tuple[int, int]:
    """(trainer threads, threads per rollout worker) for periodic mode, unless set in config. `tidal run`
    replaces `auto` by the capacity planner's figures before any role starts; a role started another
    way (a pod) reads `auto` as an even split."""
    cores = cores or os.cpu_count() or 1
    workers = cfg.rollout.workers if isinstance(cfg.rollout.workers, int) else 1
    trainer = cfg.trainer.threads if isinstance(cfg.trainer.threads, int) else max(1, cores // (workers + 1))
    rollout = cfg.rollout.threads if isinstance(cfg.rollout.threads, int) else max(1, (cores - trainer) // workers)
    return trainer, rollout


def setup_logging(log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    handlers: list[logging.Handler] = []
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    else:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=level, handlers=handlers, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    for noisy in ("httpx", "urllib3", "alembic", "mlflow", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # else tidal.model.loading quiets it when it imports it
        quiet_transformers()


def quiet_transformers() -> None:
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:
        pass

"""Logging as every Tidal process sets it up: one file (or stderr), libraries' chatter turned down."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


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

"""Logging as every Tidal process sets it up: one file (or stderr), libraries' chatter turned down."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_log_file: Path | None = None  # this process's log, when it logs to a file (the launcher: its terminal is the user's)


def setup_logging(log_file: str | Path | None = None, level: int = logging.INFO) -> None:
    global _log_file
    handlers: list[logging.Handler] = []
    if log_file and _log_file is None:
        atexit.register(_teardown_output_to_log)
    _log_file = Path(log_file) if log_file else None
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


def _redirect_output(path: Path) -> tuple[int, int]:
    """fds 1 and 2 onto `path` (appended); returns the previous ones."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


@contextmanager
def output_to_log() -> Iterator[None]:
    """While open, this process's fds 1 and 2 go to its log file, when it logs to one: processes started inside
    (vLLM's engine core and its workers) print to the fds they inherit, into the log, not onto the user's terminal."""
    if _log_file is None:
        yield
        return
    saved = _redirect_output(_log_file)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved):
            os.dup2(fd, target)
            os.close(fd)


def library_logs_to_log(name: str) -> None:
    """A library that installs its own console handler (vLLM's logger prints to stdout) logs into this process's
    log file instead, when it has one."""
    if _log_file is None:
        return
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


def _teardown_output_to_log() -> None:
    """At exit, after everything Tidal prints: what the interpreter's teardown prints (triton's nanobind bindings, imported
    with vLLM, report 'leaked' objects there) goes to the log, not the terminal."""
    if _log_file is not None:
        try:
            _redirect_output(_log_file)
        except OSError:
            pass

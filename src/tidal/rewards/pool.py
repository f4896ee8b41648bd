"""User reward functions (`module:function`) run in a worker-owned process, so that a hang, a crash or
`sys.exit` in user code costs one score (0, counted as a reward error), never the worker. The process
is a fresh interpreter (`python -m tidal.rewards.host`), fed JSON lines over stdin/stdout: only str
and float cross the boundary. A call that outlives `reward.timeout_seconds`, or a process that dies,
fails that call; the process is killed and a new one starts at the next call."""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


class RewardError(ValueError):
    """A reward function cannot be found or loaded."""


STARTUP_SECONDS = 120.0  # importing a user's module may load a model of its own


class RewardCallError(Exception):
    """One call to a user reward function failed: `kind` is its exception type, or Timeout / ProcessDied."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class LineReader:
    """Lines from a pipe with a deadline (select + os.read: a hung writer never blocks the reader)."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def line(self, deadline: float) -> bytes | None:
        """The next line; None at EOF; TimeoutError past `deadline` (time.monotonic())."""
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


class RewardProcess:
    """One host process and the functions it runs; started at the first call, replaced after a failure."""

    def __init__(self, names: list[str], timeout: float):
        self.names, self.timeout = names, timeout
        self.proc: subprocess.Popen | None = None
        self.reader: LineReader | None = None
        self.started = 0  # processes started so far (a replacement is the second one on)
        self.ready = False  # the running process has said it imported the functions
        self.lock = threading.Lock()

    def prestart(self) -> None:
        """Starts the process now, without waiting for it: its interpreter and the user's imports
        then overlap with the caller's own start-up (a worker's model load); the first call waits."""
        with self.lock:
            if self.proc is None:
                self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.rewards.host", *self.names], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.reader = LineReader(self.proc.stdout.fileno())
        self.ready = False
        self.started += 1

    def _start(self) -> None:
        """Spawns the process unless `prestart` did, and waits for its ready line."""
        if self.proc is None:
            self._spawn()
        try:
            first = self.reader.line(time.monotonic() + max(STARTUP_SECONDS, self.timeout))
        except TimeoutError:
            self.stop()
            raise RewardError(f"reward functions {self.names}: their process did not start within {STARTUP_SECONDS:.0f}s") from None
        reply = json.loads(first) if first else {"fatal": f"their process exited with code {self.proc.wait()} while starting"}
        if "fatal" in reply:
            self.stop()
            raise RewardError(reply["fatal"])
        self.ready = True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
        self.proc = self.reader = None
        self.ready = False

    def call(self, name: str, completion: str, answer: str) -> float:
        with self.lock:
            if self.proc is None or not self.ready:
                self._start()
            try:
                self.proc.stdin.write((json.dumps({"fn": name, "completion": completion, "answer": answer}) + "\n").encode())
                self.proc.stdin.flush()
                line = self.reader.line(time.monotonic() + self.timeout)
            except TimeoutError:
                self.stop()
                raise RewardCallError("Timeout", f"no answer within {self.timeout:g}s (reward.timeout_seconds); its process was replaced") from None
            except BrokenPipeError:
                line = None
            if line is None:
                code = self.proc.wait()
                self.stop()
                raise RewardCallError("ProcessDied", f"its process exited with code {code} (a crash or sys.exit); it was replaced")
        reply = json.loads(line)
        if "error" in reply:
            kind, _, detail = reply["error"].partition(": ")
            raise RewardCallError(kind, detail)
        return float(reply["value"])

    def function(self, name: str):
        return lambda completion, answer: self.call(name, completion, answer)

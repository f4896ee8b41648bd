"""MLflow: a local store in the run directory by default, or the configured tracking server."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from tidal.config import TidalConfig, flatten

log = logging.getLogger(__name__)


def tracking_uri(cfg: TidalConfig, run_dir: str | Path) -> str:
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        seed_sqlite_store(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


def schema_template_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal") / "mlflow-schema"


def seed_sqlite_store(db: Path) -> None:
    """A new sqlite store starts as a copy of an empty one already migrated by this MLflow version
    (cached once per machine): MLflow's ~60 schema migrations take ~4 s on every new run otherwise.
    The template has no Default experiment, so MLflow creates it with this store's artifact root.
    Files appear only whole (a temp file, then a link or rename); a store that exists, or that
    another process creates meanwhile, is never replaced."""
    if db.exists():
        return
    import mlflow

    template = schema_template_dir() / f"mlflow-{mlflow.__version__}.db"
    try:
        if not template.is_file():
            _build_template(template)
        db.parent.mkdir(parents=True, exist_ok=True)
        copying = _temp_beside(db)
        try:
            copying.write_bytes(template.read_bytes())
            os.link(copying, db)
        except FileExistsError:  # another process seeded it first: theirs is the store
            pass
        finally:
            copying.unlink(missing_ok=True)
    except Exception as err:  # noqa: BLE001 - an unusable cache only costs the migrations
        log.warning("no migrated MLflow store template (%s): MLflow migrates the new store itself", err)


def _temp_beside(path: Path) -> Path:
    import tempfile

    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def _build_template(template: Path) -> None:
    import sqlite3

    from mlflow.tracking import MlflowClient

    template.parent.mkdir(parents=True, exist_ok=True)
    building = _temp_beside(template)
    try:
        building.unlink()  # MLflow creates the database file itself
        MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()  # migrates it
        conn = sqlite3.connect(building)
        try:
            with conn:
                conn.execute("DELETE FROM experiments WHERE experiment_id = 0")
        finally:
            conn.close()
        os.replace(building, template)  # two builders: either whole template will do
    finally:
        building.unlink(missing_ok=True)


# The UI's experiment type: metric charts and run comparison ("Model training"), not GenAI traces.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def git_commit() -> str | None:
    """The commit of the Tidal source tree this run uses, when it is a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def run_tags(cfg: TidalConfig, run_dir: str | Path) -> dict[str, str]:
    """What a run is filtered and grouped by in the MLflow UI: mode, model, git commit, run directory."""
    tags = {
        "tidal.mode": cfg.mode,
        "mode": cfg.mode,
        "model": cfg.model.name_or_path or "tiny",
        "tidal.run_dir": str(Path(run_dir).resolve()),
        "mlflow.source.name": "tidal run",
        "mlflow.source.type": "LOCAL",
    }
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def experiment_id(client, name: str, uri: str) -> str:
    """The experiment's id, created when missing: artifacts beside a sqlite store (not in the working
    directory), and typed for the UI's model-training views."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if uri.startswith("sqlite:///"):
        artifacts = (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifacts, tags=EXPERIMENT_KIND)
    except Exception:  # created by another run sharing the store in the meantime
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def start_run(cfg: TidalConfig, run_dir: str | Path, tags: dict[str, str] | None = None) -> str:
    """Creates the run (tagged with mode, model, git commit and run directory) and logs the resolved
    config as params, flattened with dotted keys. Returns the run id."""
    from mlflow.entities import Param

    uri = tracking_uri(cfg, run_dir)
    client = _client(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment, uri)
    run = client.create_run(exp_id, run_name=cfg.tracking.run_name or Path(run_dir).name, tags={**run_tags(cfg, run_dir), **(tags or {})})
    params = [Param(k, v[:6000]) for k, v in flatten(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Adds tags to an existing run (e.g. `system` for a benchmark's runs, set by the benchmark)."""
    from mlflow.entities import RunTag

    _client(uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


# MLflow's UI groups charts by the prefix before "/": what the rollouts were, what the update did,
# where the time went. metrics.jsonl keeps the flat names; only the store sees the grouped ones.
ROLLOUT_METRICS = frozenset(
    {
        "reward_mean", "reward_std", "accuracy", "response_length_mean", "response_length_max", "response_length_correct_mean",
        "response_length_incorrect_mean", "generated_tokens", "samples", "reward_errors", "zero_advantage_group_fraction",
        "pass_at_group_size", "staleness_max", "staleness_mean", "groups_discarded", "groups_filtered", "messages_rejected",
        "messages_rejected_total", "queue_depth", "policy_version",
    }
)  # fmt: skip
TIME_METRICS = frozenset({"pipeline_efficiency", "wall_time", "generated_tokens_per_s", "trained_tokens_per_s", "samples_per_s"})
NOT_LOGGED = frozenset({"iteration"})  # it is the step


def mlflow_metric_name(key: str) -> str:
    """`rollout/…`, `train/…`, `time/…`; names that already carry a group (`eval/…`) are kept."""
    if "/" in key:
        return key
    if key in ROLLOUT_METRICS or key.startswith("staleness_fraction_"):
        return f"rollout/{key}"
    if key.startswith("agent_"):  # multi-turn rollouts: turns, tool calls, environment time
        return f"agent/{key.removeprefix('agent_')}"
    if key in TIME_METRICS or key.endswith("_seconds"):
        return f"time/{key}"
    if key.startswith(("accuracy_", "sampled_accuracy_", "total_", "pass_at_", "maj_at_")):
        return f"summary/{key}"
    return f"train/{key}"


class Tracker:
    """One batched MLflow call per iteration, under the grouped names of `mlflow_metric_name`."""

    def __init__(self, uri: str, run_id: str):
        from concurrent.futures import ThreadPoolExecutor

        self.run_id = run_id
        # MLflow's import and store set-up take seconds: done beside the role's own start-up, and
        # waited for at the first call
        pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-client")
        self._client = pool.submit(_client, uri)
        pool.shutdown(wait=False)

    @property
    def client(self):
        return self._client.result()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(mlflow_metric_name(k), float(v), now, step)
            for k, v in metrics.items()
            if k not in NOT_LOGGED and v is not None and math.isfinite(float(v))
        ]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

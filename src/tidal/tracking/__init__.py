"""MLflow: a local store in the run directory by default, or the configured tracking server."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.config import TidalConfig, flatten

log = logging.getLogger(__name__)


def configured_uri(configured: str | None) -> str | None:
    """The store a run names: its tracking.uri, else $MLFLOW_TRACKING_URI; None when neither does."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or None


class TrackingUnreachableError(ValueError):
    """The MLflow server a run names does not answer; one line."""


def check_server_reachable(cfg: TidalConfig, timeout: float = 5.0) -> None:
    """An http(s) store named by tracking.uri or $MLFLOW_TRACKING_URI takes connections: MLflow's client
    would otherwise retry for minutes, silently, before the run's first call to it fails."""
    import socket
    import urllib.request
    from urllib.parse import urlparse

    uri = configured_uri(cfg.tracking.uri)
    if not uri or not uri.startswith(("http://", "https://")):
        return
    parsed = urlparse(uri)
    if urllib.request.getproxies().get(parsed.scheme) and not urllib.request.proxy_bypass(parsed.hostname or ""):
        return  # reached through a proxy: a direct connection says nothing
    source = "tracking.uri" if cfg.tracking.uri else "$MLFLOW_TRACKING_URI"
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or (443 if parsed.scheme == "https" else 80)), timeout=timeout):
            return
    except OSError as err:
        raise TrackingUnreachableError(f"cannot reach the MLflow server at {uri} ({source}): {err}; is it running?") from None


def local_store_uri(run_dir: str | Path) -> str:
    """The sqlite store in the run directory, where a run that names no store logs."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"  # RunDir.mlflow_store (rundir imports this module)


# where MLflow's sqlite store records files by absolute path (experiments' and logged models' artifact
# roots, runs' artifact URIs, registered versions' sources); a moved store points at the old place
STORE_PATH_COLUMNS = {
    "experiments": ("artifact_location",),
    "runs": ("artifact_uri",),
    "model_versions": ("source", "storage_location"),
    "logged_models": ("artifact_location",),
}


def rewrite_store_paths(db: Path, old_root: Path, new_root: Path) -> int:
    """In the sqlite store ``db``, every recorded path under ``old_root`` (as a file URI or a plain path)
    moved under ``new_root``; returns how many values changed. Columns a store's schema lacks are skipped."""
    import sqlite3

    prefixes = [(old_root.as_uri() + "/", new_root.as_uri() + "/"), (f"{old_root}/", f"{new_root}/")]
    changed = 0
    with sqlite3.connect(db) as con:
        for table, columns in STORE_PATH_COLUMNS.items():
            present = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
            for column in (c for c in columns if c in present):
                for old, new in prefixes:
                    changed += con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?", (new, len(old) + 1, len(old), old)
                    ).rowcount
    return changed


def tracking_uri(cfg: TidalConfig, run_dir: str | Path) -> str:
    return configured_uri(cfg.tracking.uri) or local_store_uri(run_dir)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        seed_sqlite_store(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


def schema_template_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal") / "mlflow-schema"


def seed_sqlite_store(db: Path) -> None:
    """A new sqlite store starts as a copy of an empty one already migrated by this MLflow version
    (cached once per machine): MLflow's schema migrations would otherwise run again for every new run.
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


# MLflow 3's UI shows an experiment either as GenAI (traces, evaluations, an "Evaluations" run page)
# or as model training (runs, metric charts, the model registry). The experiment tag says which to
# the UIs that read it (its kind selector, and the pages of MLflow 3 versions before the workflow
# switch). The 3.17 UI takes the view from its sidebar's GenAI / Model training switch instead,
# which a page's address sets (workflowType), so every link to a page names the view as well.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
MODEL_TRAINING_VIEW = {"workflowType": "machine_learning"}


def ui_page(experiment_id: str, run_id: str | None = None, tab: str = "", **query: str) -> str:
    """The MLflow UI's page of a run (``tab``: e.g. "model-metrics"), or of an experiment's runs side by
    side, in the model-training view: the part of the address after the server's root."""
    from urllib.parse import urlencode

    path = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "") + (f"/{tab}" if tab else "")
    return f"{path}?{urlencode({**query, **MODEL_TRAINING_VIEW})}"


def run_page_url(ui_base: str, experiment_id: str, run_id: str) -> str:
    """The run's page on the MLflow UI at ``ui_base`` (a gateway's prefix kept: pages are fragments of it)."""
    return f"{ui_base.rstrip('/')}/{ui_page(experiment_id, run_id)}"


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


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of the store ``uri`` keeps its artifacts: beside a sqlite store (not in
    the working directory of whoever created it); None lets a server choose."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return None


def experiment_id(client, name: str, uri: str) -> str:
    """The experiment's id, created when missing: artifacts where :func:`artifact_location` says, and
    typed for the UI's model-training views."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri), tags=EXPERIMENT_KIND)
    except Exception:  # created by another run sharing the store in the meantime
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


MAX_PARAM_LENGTH = 6000  # MLflow refuses longer param values
PARAMS_PER_CALL = 100  # MLflow's limit on params in one log_batch


def create_run(uri: str, experiment: str, run_name: str, tags: dict[str, str], params: dict[str, str]) -> tuple[str, str]:
    """Creates a run in ``experiment`` (created when missing, see :func:`experiment_id`) with its tags
    and params (batched). Returns ``(experiment id, run id)``."""
    client = _client(uri)
    exp_id = experiment_id(client, experiment, uri)
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    log_params(uri, run.info.run_id, params)
    return exp_id, run.info.run_id


def log_params(uri: str, run_id: str, params: dict[str, str]) -> None:
    """Params of an existing run, in batches (MLflow's limits on their number and length)."""
    from mlflow.entities import Param

    batch = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
    client = _client(uri)
    for i in range(0, len(batch), PARAMS_PER_CALL):
        client.log_batch(run_id, params=batch[i : i + PARAMS_PER_CALL])


@dataclass(frozen=True)
class FoundRun:
    run_id: str
    experiment_id: str
    metrics: dict[str, float]  # the last value of each metric


def find_run(uri: str, tags: dict[str, str]) -> FoundRun | None:
    """The first run, in any experiment of the store, that carries every tag given; None if none does."""
    client = _client(uri)
    experiment_ids, token = [], None
    while True:
        page = client.search_experiments(page_token=token)
        experiment_ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            break
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = client.search_runs(experiment_ids, filter_string=query, max_results=1) if experiment_ids else []
    if not runs:
        return None
    run = runs[0]
    return FoundRun(run.info.run_id, run.info.experiment_id, {k: float(v) for k, v in run.data.metrics.items()})


def experiment_of_run(uri: str, run_id: str) -> str:
    return _client(uri).get_run(run_id).info.experiment_id


def experiment_id_by_name(uri: str, name: str) -> str | None:
    found = _client(uri).get_experiment_by_name(name)
    return None if found is None else found.experiment_id


def start_run(cfg: TidalConfig, run_dir: str | Path, tags: dict[str, str] | None = None) -> str:
    """Creates the run (tagged with mode, model, git commit and run directory) and logs the resolved
    config as params, flattened with dotted keys. Returns the run id."""
    run_name = cfg.tracking.run_name or Path(run_dir).name
    _, run_id = create_run(tracking_uri(cfg, run_dir), cfg.tracking.experiment, run_name, {**run_tags(cfg, run_dir), **(tags or {})}, flatten(cfg))
    return run_id


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Adds tags to an existing run (e.g. `system` for a benchmark's runs, set by the benchmark)."""
    log_batch(uri, run_id, tags=tags)


def log_batch(uri: str, run_id: str, metrics: dict[str, float] | None = None, step: int = 0, tags: dict[str, str] | None = None) -> None:
    """Metrics (at ``step``, under the names given) and tags of an existing run, in one call."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    _client(uri).log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
        tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
    )


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Ends a run with ``status`` (FINISHED, FAILED, KILLED)."""
    _client(uri).set_terminated(run_id, status=status)


def registry_name_problem(name: str) -> str | None:
    """Why MLflow's Model Registry would refuse ``name`` (blank, '.', starting with '..', a '/' or ':'), or None.
    Checked before a run or an export that ends by registering, so the refusal does not come last."""
    # MLflow's own rule (mlflow.utils.validation): a name is also a path, so any name starting with '..' is refused
    if not name.strip() or "/" in name or ":" in name or name == "." or name.startswith(".."):
        return "a registered model's name must not be blank, '.' or start with '..', nor contain '/' or ':'"
    return None


def register_model(uri: str, run_id: str, name: str, folder: str | Path, artifact_path: str, tags: dict[str, str] | None = None) -> str:
    """Logs ``folder`` as the run's artifacts under ``artifact_path`` and registers them as a new
    version of the registered model ``name`` (created on first use). Returns the version."""
    client = _client(uri)
    client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)
    try:
        client.create_registered_model(name)
    except Exception as err:  # already registered: add a version to it
        if "already exists" not in str(err).lower() and "RESOURCE_ALREADY_EXISTS" not in str(err):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags or {})
    return str(version.version)


# MLflow's UI groups charts by the prefix before "/": what the rollouts were, what the update did,
# where the time went. metrics.jsonl keeps the flat names; only the store sees the grouped ones.
ROLLOUT_METRICS = frozenset(
    {
        "reward_mean", "reward_std", "accuracy", "response_length_mean", "response_length_max", "response_length_p50", "response_length_p99", "response_length_correct_mean",
        "response_length_incorrect_mean", "generated_tokens", "samples", "reward_errors", "zero_advantage_group_fraction",
        "pass_at_group_size", "staleness_max", "staleness_mean", "token_staleness_mean", "mixed_version_sample_fraction", "groups_discarded", "groups_filtered", "messages_rejected",
        "messages_rejected_total", "queue_depth", "policy_version", "reward_server_requests", "reward_server_retries",
        "reward_server_failed_requests", "reward_server_samples", "reward_server_batch_size_mean",
    }
)  # fmt: skip
TIME_METRICS = frozenset({"pipeline_efficiency", "wall_time", "generated_tokens_per_s", "trained_tokens_per_s", "samples_per_s"})
NOT_LOGGED = frozenset({"iteration", "failures"})  # the step; failures are text (metrics.jsonl, the end-of-run table)


def mlflow_metric_name(key: str) -> str:
    """`rollout/…`, `train/…`, `time/…`; names that already carry a group (`eval/…`) are kept."""
    if "/" in key:
        return key
    if key in ROLLOUT_METRICS or key.startswith(("staleness_fraction_", "token_staleness_fraction_")):
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

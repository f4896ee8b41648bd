"""MLflow: a local store in the run directory by default, or the configured tracking server."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from tidal.config import TidalConfig, flatten


def tracking_uri(cfg: TidalConfig, run_dir: str | Path) -> str:
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def start_run(cfg: TidalConfig, run_dir: str | Path, tags: dict[str, str] | None = None) -> str:
    """Creates the run and logs the resolved config as params. Returns the run id."""
    from mlflow.entities import Param

    client = _client(tracking_uri(cfg, run_dir))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.tracking.experiment)
    run = client.create_run(exp_id, run_name=cfg.tracking.run_name or Path(run_dir).name, tags={"tidal.mode": cfg.mode, **(tags or {})})
    params = [Param(k, v[:6000]) for k, v in flatten(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


class Tracker:
    """One batched MLflow call per iteration."""

    def __init__(self, uri: str, run_id: str):
        self.client = _client(uri)
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

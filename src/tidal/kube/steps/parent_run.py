"""The MLflow parent run of a pipeline run: opened by prepare, logged to by the rounds, ended by
finalize; its links to and from the KFP run; the final model's registration. Every MLflow call goes
through :mod:`tidal.tracking`, whose rules (the store's URI, where artifacts go, the experiment's
kind, params in batches) are the same for ``tidal run`` and the pipeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tidal import tracking
from tidal.kube import cluster
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.rundir import RunDir


def tracking_uri_for(run: RunDir, configured: str | None) -> str:
    """Explicit config value (the ``tracking_uri`` parameter), else $MLFLOW_TRACKING_URI (key ``tracking-uri`` of
    Secret ``tidal-mlflow``). Never a silent local store: a run whose metrics vanish into a file in the run
    directory looks like a run that logged nothing. ``tidal run --via kfp-local`` passes its own sqlite URI."""
    uri = tracking.configured_uri(configured)
    if not uri:
        raise PipelineStepError(
            f"no MLflow tracking URI: $MLFLOW_TRACKING_URI is unset (key 'tracking-uri' of Secret '{cluster.MLFLOW_SECRET}') "
            "and neither the tracking_uri parameter nor tracking.uri gives one. Create the Secret (docs/kubernetes.md), or pass "
            f"tracking_uri, e.g. {tracking.local_store_uri(run.root)} for a run without a tracking server"
        )
    return uri


@dataclass(frozen=True)
class RunLinks:
    """Where people open KFP and MLflow (pipeline parameters ``kfp_ui_url``, ``mlflow_ui_url``); empty: unknown."""

    kfp_ui_url: str = ""
    mlflow_ui_url: str = ""

    def kfp_run_url(self, job_id: str) -> str:
        return f"{self.kfp_ui_url.rstrip('/')}/#/runs/details/{job_id}" if self.kfp_ui_url and job_id else ""


def kfp_tags(job_id: str, links: RunLinks) -> dict[str, str]:
    """Tags that lead from the MLflow run back to its KFP run."""
    tags = {"kfp.run_id": job_id} if job_id else {}
    url = links.kfp_run_url(job_id)
    if url:
        tags["kfp.run_url"] = url
        tags["mlflow.note.content"] = f"Kubeflow Pipelines run: [{job_id}]({url})"
    return tags


def mlflow_ui_base(links: RunLinks, tracking_uri: str) -> str:
    """Where people open the MLflow UI: the ``mlflow_ui_url`` parameter, else the ``ui-url`` of Secret tidal-mlflow
    (e.g. the Kubeflow gateway's https://kubeflow.example.com/tidal/mlflow/), else an http(s) tracking URI (which on
    a cluster is the in-cluster address, http://tidal-mlflow:5000/tidal/mlflow); empty: no link, the run id only."""
    ui = links.mlflow_ui_url or os.environ.get(cluster.MLFLOW_UI_URL_ENV, "")
    return ui or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else "")


@dataclass(frozen=True)
class ParentRun:
    """The MLflow run of a pipeline run, as prepare recorded it (``RUN_DIR/kube/pipeline.json``). The trainer
    logs its iterations into it too (run.json names it), so a pipeline run is one MLflow run."""

    run_id: str
    tracking_uri: str
    url: str = ""
    """Its page on the MLflow UI; empty when no UI address is known."""

    @classmethod
    def of(cls, run: RunDir) -> ParentRun:
        records = StepRecords(run)
        state = records.read(records.parent_run)
        return cls(state["parent_run_id"], state["tracking_uri"], state.get("mlflow_run_url", ""))

    def save(self, run: RunDir) -> None:
        records = StepRecords(run)
        records.write(records.parent_run, {"parent_run_id": self.run_id, "tracking_uri": self.tracking_uri, "mlflow_run_url": self.url})

    def log(self, metrics: dict[str, float] | None = None, step: int = 0, tags: dict[str, str] | None = None) -> None:
        tracking.log_batch(self.tracking_uri, self.run_id, metrics=metrics, step=step, tags=tags)

    def markdown(self) -> str:
        """What the KFP run page shows for the MLflow run (KFP has no API to annotate a run once it exists)."""
        link = f"[{self.run_id}]({self.url})" if self.url else f"`{self.run_id}` on `{self.tracking_uri}`"
        return f"## MLflow run\n\n{link}\n"


def open_parent_run(run: RunDir, config_path: str, job_id: str = "", links: RunLinks = RunLinks()) -> ParentRun:
    """Create (or, on a retried prepare, reuse) the MLflow parent run of this pipeline run, tagged with the KFP run,
    the resolved config as its params."""
    from tidal.config import flatten, load_config

    if StepRecords(run).parent_run.is_file():
        return ParentRun.of(run)
    config = load_config(config_path)
    uri = tracking_uri_for(run, config.tracking.uri)
    tags = {"tidal.role": "pipeline", "tidal.run_dir": str(run.root), **kfp_tags(job_id, links)}
    experiment_id, run_id = tracking.create_run(uri, config.tracking.experiment, f"pipeline-{run.root.name}", tags, flatten(config))
    ui = mlflow_ui_base(links, uri)
    parent = ParentRun(run_id, uri, tracking.run_page_url(ui, experiment_id, run_id) if ui else "")
    parent.save(run)
    return parent


def mlflow_run_markdown(run_dir: str) -> str:
    """The prepare component's Markdown artifact: the MLflow run's link on the KFP run page."""
    return ParentRun.of(RunDir(Path(run_dir))).markdown()


def log_to_parent_run(run: RunDir, metrics: dict[str, float] | None = None, step: int = 0, tags: dict[str, str] | None = None) -> None:
    ParentRun.of(run).log(metrics=metrics, step=step, tags=tags)


FINAL_MODEL_ARTIFACT = "final_model"


def register_final_model(run: RunDir, registered_model_name: str, exported: Path, record: dict, weights: Path) -> str:
    """Log the exported model directory to the parent run and register it as a version of
    ``registered_model_name``, tagged like `tidal export --register` and with the snapshot it came from."""
    from tidal.export import registry_tags

    parent = ParentRun.of(run)
    tags = {**registry_tags(record), "tidal.weights": str(weights)}
    return tracking.register_model(parent.tracking_uri, parent.run_id, registered_model_name, exported, FINAL_MODEL_ARTIFACT, tags=tags)


def end_parent_run(run: RunDir, succeeded: bool) -> list[str]:
    """FINISHED when the run got to its end, else FAILED; nothing when prepare never opened one."""
    if not StepRecords(run).parent_run.is_file():
        return []
    parent = ParentRun.of(run)
    status = "FINISHED" if succeeded else "FAILED"
    tracking.end_run(parent.tracking_uri, parent.run_id, status)
    return [f"MLflow run {parent.run_id}: {status}"]

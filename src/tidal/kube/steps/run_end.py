"""The run's last steps: register_model (export the final snapshot, register it in MLflow) and finalize, the exit
handler, whatever became of the run."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.kube.steps import run_state, snapshots
from tidal.kube.steps.parent_run import end_parent_run, register_final_model
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError, StepRecords, pipeline_run_dir
from tidal.kube.trainer.launch import delete_trainer_jobs
from tidal.rundir import RunDir


@as_separate_pod("register-model")
def register_model(run_dir: str, registered_model_name: str) -> str:
    """Export the final snapshot as a model directory (`tidal export`: full weights, or base + adapter for a
    LoRA run), log it to the parent run and register it in the MLflow model registry."""
    from tidal.export import EXPORT_RECORD, export_version

    run = RunDir(Path(run_dir))
    snapshots.trust_run_key(run)  # the export checks the signature with it too
    version, latest_path = snapshots.latest_snapshot(run)
    snapshots.verify_snapshot(latest_path)
    out = run.root / "exports" / f"{Path(latest_path).name}-final"
    if out.exists():  # a retried step: the export before it was whole (export_version renames a finished folder into place)
        exported_path, record = out, json.loads((out / EXPORT_RECORD).read_text())
    else:
        exported = export_version(run, out, version, accuracy=last_evaluated_accuracy(run, latest_path))
        exported_path, record = exported.path, exported.record
    model_version = register_final_model(run, registered_model_name, exported_path, record, Path(latest_path))
    records = StepRecords(run)
    records.write(
        records.registered, {"model": registered_model_name, "version": model_version, "weights": latest_path, "export": str(exported_path)}
    )
    print(f"registered {registered_model_name} version {model_version}: {exported_path} ({record['kind']}, from {latest_path})", flush=True)
    return model_version


def last_evaluated_accuracy(run: RunDir, weights_path: str) -> float | None:
    """The held-out accuracy the evaluate step measured for `weights_path`, if it did."""
    records = StepRecords(run)
    for path in reversed(records.evaluations()):
        record = records.read(path)
        if record.get("weights") == weights_path and "accuracy" in record["metrics"]:
            return float(record["metrics"]["accuracy"])
    return None


@as_separate_pod("finalize")
def finalize_run(run_dir: str, job_id: str, namespace: str = "", job_backend=None, pool_api_client=None) -> list[str]:
    """Whatever became of the run (the exit handler runs after success, failure and cancellation): delete
    trainer jobs that are left and the elastic worker pool, end the MLflow parent run FINISHED (register_model got to the end) or
    FAILED, and delete the run's NATS streams and KV bucket. Every part is tried; the step fails
    afterwards if one failed, naming it. Returns what it did, one line per action. Weights, checkpoints
    and the config stay on the volume.

    register_model, the run's last step, writes ``registered.json``: its presence is how finalize knows
    the run succeeded. (An exit task could be handed dsl.PipelineTaskFinalStatus, but KFP backends
    before 2.14 cannot resolve it.)"""
    run = pipeline_run_dir(run_dir, job_id)
    succeeded = StepRecords(run).registered.is_file()
    done: list[str] = []
    problems: list[str] = []

    def attempt(what: str, action) -> None:
        try:
            done.extend(action())
        except Exception as err:
            problems.append(f"{what}: {type(err).__name__}: {err}")

    attempt("deleting trainer jobs", lambda: delete_trainer_jobs(run, job_backend))
    attempt("deleting the worker pool", lambda: delete_worker_pool(run, pool_api_client))
    attempt("ending the MLflow run", lambda: end_parent_run(run, succeeded))
    attempt("deleting the NATS streams and KV bucket", lambda: delete_run_transport(run))
    for line in done:
        print(line, flush=True)
    if problems:
        raise PipelineStepError("finalize could not clean up everything:\n  - " + "\n  - ".join(problems))
    return done


def delete_worker_pool(run: RunDir, api_client=None) -> list[str]:
    from tidal.kube.pool.elastic import delete_pool

    return delete_pool(run, api_client)


def delete_run_transport(run: RunDir) -> list[str]:
    if not run.config.is_file():
        return []  # prepare stopped before it created streams
    return [f"deleted {what}" for what in run_state.delete_run_transport(run, str(run.config))]

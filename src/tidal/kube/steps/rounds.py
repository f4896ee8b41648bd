"""A round's bookkeeping steps: open_round (take the round lease, mark the run running), weight_sync (verify and
publish the round's snapshot) and evaluate (held-out metrics, then release the lease). The trainer lane is
:mod:`tidal.kube.trainer.launch`, the rollout-worker lanes :mod:`tidal.kube.pool.fixed`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.kube.steps import run_state, snapshots
from tidal.kube.steps.parent_run import log_to_parent_run
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError, StepRecords, pipeline_run_dir
from tidal.kube.steps.tidal_cli import run_tidal
from tidal.rundir import RunDir


@as_separate_pod("open-round")
def open_round(run_dir: str, config_path: str, round_index: int, job_id: str) -> None:
    """Take the round lease (round ``round_index - 1`` of this pipeline run must have ended: a KFP backend that
    ignores the rounds loop's parallelism=1 starts every round at once, and all but one fail here, saying so,
    instead of sharing the run directory), then mark the run as running round ``round_index`` so this round's
    workers do not exit at once."""
    run = RunDir(Path(run_dir))
    try:
        run_state.begin_round(run, config_path, job_id or "local", round_index)
    except run_state.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    run_state.open_round(run, config_path, round_index)
    log_to_parent_run(run, metrics={"round/started": float(round_index)}, step=round_index)


@dataclass(frozen=True)
class SyncedWeights:
    version: int
    path: str


@as_separate_pod("weight-sync")
def weight_sync(run_dir: str, round_index: int) -> SyncedWeights:
    """Verify the round's newest snapshot against its manifest, point ``latest`` at it, log it to MLflow."""
    run = RunDir(Path(run_dir))
    snapshots.trust_run_key(run)
    version, path = snapshots.latest_snapshot(run)
    try:
        snapshots.verify_snapshot(path)
    except Exception as err:
        raise PipelineStepError(f"round {round_index}: snapshot v{version} failed verification: {err}") from None
    snapshots.point_latest(run, version)
    synced = SyncedWeights(version=version, path=path)
    records = StepRecords(run)
    records.write(records.round_file(round_index), {"round": round_index, **asdict(synced)})
    log_to_parent_run(
        run,
        metrics={"round/policy_version": float(version)},
        step=round_index,
        tags={f"tidal.round{round_index:03d}.weights": path, "tidal.latest_weights": path},
    )
    return synced


@as_separate_pod("evaluate")
def evaluate(run_dir: str, config_path: str, weights_path: str, round_index: int, job_id: str) -> dict[str, float]:
    """Held-out metrics of the round's snapshot (``tidal eval``), logged to MLflow per round; the round's last
    step, so it releases the round lease and the next round may begin."""
    run = RunDir(Path(run_dir))
    output = run_tidal(["eval", config_path, "--run-dir", str(run.root), "--weights", weights_path], capture=True)
    print(output, flush=True)
    metrics = numeric_metrics(last_json_object(output))
    if not metrics:
        raise PipelineStepError(f"'tidal eval' printed no numeric metrics: {output[-500:]!r}")
    log_to_parent_run(run, metrics={f"eval/{k}": v for k, v in metrics.items()}, step=round_index)
    records = StepRecords(run)
    records.write(records.eval_file(round_index), {"round": round_index, "metrics": metrics, "weights": weights_path})
    try:
        run_state.end_round(run, config_path, job_id or "local", round_index)
    except run_state.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    return metrics


def last_json_object(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise PipelineStepError(f"'tidal eval' did not print JSON: {text[-500:]!r}") from None


def numeric_metrics(payload: dict) -> dict[str, float]:
    return {key: float(value) for key, value in payload.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


def final_metrics(run_dir: str, job_id: str) -> dict[str, float]:
    """The held-out metrics of the last evaluated round, and that round (the run's metrics); empty before any."""
    records = StepRecords(pipeline_run_dir(run_dir, job_id))
    evaluations = records.evaluations()
    if not evaluations:
        return {}
    last = records.read(evaluations[-1])
    return {**{f"final_{k}": float(v) for k, v in last["metrics"].items()}, "rounds_evaluated": float(last["round"] + 1)}

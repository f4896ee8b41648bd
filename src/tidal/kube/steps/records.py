"""What the pipeline's steps keep in the run directory, and the error a step fails with.

Every step reads and writes the run's storage (the run directory on the shared volume, the NATS KV
bucket, the MLflow parent run), so a round started by a fresh pod, or a retried step, picks up where
the last one stopped. Beside what Tidal's roles write (:class:`tidal.rundir.RunDir`), the steps
record in ``RUN_DIR/kube/``::

    submitted-config.yaml  the config as submitted (config_yaml, or a copy of config_path)
    pipeline.json          the MLflow parent run, its tracking URI and link (prepare)
    round-NNN.json         the snapshot weight_sync published for round NNN
    eval-NNN.json          the held-out metrics evaluate logged for round NNN
    trainer-jobs.jsonl     every trainer job a launcher created, or was about to: what finalize deletes
    registered.json        the registered model version (register_model, the run's last step)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tidal.kube import cluster
from tidal.rundir import Records, RunDir

STATE_DIR = "kube"


class PipelineStepError(RuntimeError):
    """A pipeline step cannot go on; the message says which input or file is wrong."""


def pipeline_run_dir(run_dir: str, job_id: str) -> RunDir:
    """The run directory a step works in: ``run_dir``, else the pipeline job's folder on the data volume
    (an exit handler may read only pipeline parameters, so it finds the folder as prepare does)."""
    if run_dir:
        return RunDir(Path(run_dir))
    if not job_id:
        raise PipelineStepError("either run_dir or the pipeline job id must be given")
    return RunDir(Path(cluster.RUNS_ROOT) / job_id)


@dataclass(frozen=True)
class StepRecords:
    """``RUN_DIR/kube/`` of one run directory: its files, and how they are written and read (the elastic
    pool's record, ``worker-pool.json``, is written by tidal.kube.pool.elastic under ``folder``)."""

    run: RunDir

    @property
    def folder(self) -> Path:
        return self.run.root / STATE_DIR

    submitted_config = property(lambda self: self.folder / "submitted-config.yaml")
    parent_run = property(lambda self: self.folder / "pipeline.json")
    registered = property(lambda self: self.folder / "registered.json")

    def round_file(self, round_index: int) -> Path:
        return self.folder / f"round-{round_index:03d}.json"

    def eval_file(self, round_index: int) -> Path:
        return self.folder / f"eval-{round_index:03d}.json"

    def evaluations(self) -> list[Path]:
        """The eval-NNN.json files, in round order."""
        return sorted(self.folder.glob("eval-*.json")) if self.folder.is_dir() else []

    @property
    def trainer_jobs(self) -> Records:
        return self.run.records(f"{STATE_DIR}/trainer-jobs.jsonl")

    def create(self) -> StepRecords:
        self.folder.mkdir(parents=True, exist_ok=True)
        return self

    def write(self, path: Path, payload: dict) -> None:
        """Replace ``path`` whole (a temporary file, renamed): a step killed mid-write leaves the old one."""
        self.create()
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
        os.replace(tmp, path)

    def read(self, path: Path) -> dict:
        if not path.is_file():
            raise PipelineStepError(f"{path} is missing: did the 'prepare' step run for this run directory?")
        return json.loads(path.read_text())

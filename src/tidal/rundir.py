"""The run directory: its record of the run (run.json) and its append-only logs of iterations and groups."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RunInfo:
    """Written once per run (run.json); every role reads it from the shared run directory."""

    run_id: str
    base_model: str
    tracking_uri: str
    mlflow_run_id: str

    def save(self, run_dir: Path) -> None:
        (Path(run_dir) / "run.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> RunInfo:
        path = Path(run_dir) / "run.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: start the run with `tidal run` (or the pipeline's prepare step) first")
        return cls(**json.loads(path.read_text()))


@dataclass
class RunFiles:
    """The run directory's append-only records (metrics.jsonl, groups.jsonl) and its checkpoint folder."""

    run_dir: Path
    on_iteration: Callable[[dict], None] | None = None  # e.g. the launcher's progress bar

    @property
    def checkpoint(self) -> Path:
        return Path(self.run_dir) / "checkpoint"

    def append(self, name: str, record: dict) -> None:
        with (Path(self.run_dir) / name).open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    def append_many(self, name: str, records: list[dict]) -> None:
        with (Path(self.run_dir) / name).open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)

"""`tidal export RUN_DIR --out DIR`: one version of a run's weights as a Hugging Face model directory
(weights, config, generation config, tokenizer and chat template) with `tidal_export.json`, its
provenance; `--register NAME` adds it to the run's MLflow run and the Model Registry.

A full-weight version is exported as it is. A LoRA version (its snapshot holds `adapter_config.json`
instead of `model.safetensors`) is exported as the base model in DIR and the adapter in DIR/adapter,
or with `--merge` as one plain model with the adapter merged in."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tidal.run_keys import snapshot_keys
from tidal.rundir import RunDir, RunInfo
from tidal.weights import (
    WEIGHTS_FILE,
    CorruptSnapshotError,
    WeightStore,
    sha256_of,
    verify_snapshot,
    version_dir_name,
)

EXPORT_RECORD = "tidal_export.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FOLDER = "adapter"  # beside the base model, not in it: transformers would load an adapter found in DIR into the base
EXPORT_ARTIFACT = "exported-model"


class ExportError(ValueError):
    """The export cannot be made as asked (no such version, a corrupt snapshot, --out in use); one line."""


@dataclass(frozen=True)
class Exported:
    path: Path
    version: int
    kind: str  # "full", "adapter" (base model + adapter/) or "merged"
    record: dict  # what tidal_export.json holds


def chosen_version(store: WeightStore, requested: int | None) -> int:
    """The version asked for, else the latest; ExportError names the versions present when it is not there."""
    present = store.versions()
    if not present:
        raise ExportError(f"{store.root} holds no weight snapshot: the run has not published any version")
    version = store.latest_version() if requested is None else requested
    if version not in present:
        what = f"the latest version ({version})" if requested is None else f"version {requested}"
        raise ExportError(f"{what} is not in {store.root}; the versions present are {', '.join(map(str, present))}")
    return version


def refuse_used_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not an empty directory: choose a new one")


def is_adapter(snapshot: Path) -> bool:
    return (snapshot / ADAPTER_CONFIG).is_file()


def verified_manifest(snapshot: Path, keys: dict) -> dict:
    """`keys`: tidal.run_keys.snapshot_keys (the run's public key: its trainer's signature is checked)."""
    try:
        return verify_snapshot(snapshot, **keys)
    except CorruptSnapshotError as err:
        raise ExportError(f"{err}; not exported") from None


def iteration_of(version: int) -> int | None:
    """The last iteration trained into `version`: iteration i publishes version i + 1; version 0 is the start."""
    return version - 1 if version > 0 else None


def heldout_accuracy(run: RunDir, version: int) -> float | None:
    """Greedy held-out accuracy of `version`: its eval.jsonl point (eval.every), else summary.json's
    accuracy after the run when `version` is the run's final one; None when it was not evaluated."""
    for record in reversed(run.evals.read()):
        if record.get("version") == version and record.get("accuracy") is not None:
            return float(record["accuracy"])
    if run.summary.is_file():
        summary = json.loads(run.summary.read_text())
        if Path(summary.get("final_weights", "")).name == version_dir_name(version) and summary.get("accuracy_after") is not None:
            return float(summary["accuracy_after"])
    return None


def export_record(info: RunInfo, version: int, kind: str, manifest: dict, accuracy: float | None) -> dict:
    return {
        "run_id": info.run_id,
        "version": version,
        "iteration": iteration_of(version),
        "kind": kind,
        "base_model": info.base_model,
        "source_files": manifest["files"],  # sha256 of each snapshot file, as its verified manifest records it
        "source_dtype": manifest.get("dtype"),
        "heldout_accuracy": accuracy,
        "mlflow_run_id": info.mlflow_run_id or None,
        "tracking_uri": info.tracking_uri or None,
    }


def model_dtype(run: RunDir) -> str:
    """The dtype the run trained in (model.dtype of its config.yaml)."""
    if not run.config.is_file():
        return "float32"
    from tidal.config import load_config

    return load_config(run.config).model.dtype


def save_side_files(base: str, out: Path) -> None:
    """Tokenizer (with its chat template), a vision-language model's image processor, and generation config
    of the run's base model: a snapshot copies only some of the tokenizer's files, and none for a base model
    named by hub id."""
    from transformers import AutoConfig, GenerationConfig

    from tidal.model.loading import load_tokenizer
    from tidal.model.vision import is_vision_model, load_processor

    load_tokenizer(base).save_pretrained(out)
    if is_vision_model(AutoConfig.from_pretrained(base)):
        load_processor(base).image_processor.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(base).save_pretrained(out)
    except OSError:  # the base model has none: transformers derives one from config.json
        pass


def write_full(snapshot: Path, base: str, manifest: dict, out: Path) -> None:
    """The snapshot's weights byte for byte (checked again once copied), its config naming their dtype."""
    from transformers import AutoConfig

    shutil.copyfile(snapshot / WEIGHTS_FILE, out / WEIGHTS_FILE)
    if sha256_of(out / WEIGHTS_FILE) != manifest["files"][WEIGHTS_FILE]:
        raise ExportError(f"snapshot {snapshot}: {WEIGHTS_FILE} changed while it was copied; not exported")
    config = AutoConfig.from_pretrained(str(snapshot) if (snapshot / "config.json").is_file() else base)
    config.dtype = manifest.get("dtype") or config.dtype  # from_pretrained's dtype="auto" then loads them as they are
    config.save_pretrained(out)
    save_side_files(base, out)


def write_adapter(snapshot: Path, base: str, manifest: dict, dtype: str, out: Path, final: Path) -> None:
    """The base model in `out`, the adapter's verified files in out/adapter, its config pointing at `final`."""
    from tidal.model.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(base, dtype)
    model.save_pretrained(out)
    save_side_files(base, out)
    adapter = out / ADAPTER_FOLDER
    adapter.mkdir()
    for name in manifest["files"]:
        shutil.copyfile(snapshot / name, adapter / name)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(final.resolve())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def merged_model(snapshot: Path, base: str, dtype: str):
    """The base model with the adapter of `snapshot` merged into its weights (peft's merge_and_unload)."""
    from peft import PeftModel

    from tidal.model.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(base, dtype)
    return PeftModel.from_pretrained(model, str(snapshot)).merge_and_unload()


def write_merged(snapshot: Path, base: str, dtype: str, out: Path) -> None:
    merged_model(snapshot, base, dtype).save_pretrained(out)
    save_side_files(base, out)


def temp_beside(out: Path) -> Path:
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def move_into_place(tmp: Path, out: Path) -> None:
    """An empty --out is replaced; one that filled up meanwhile is not."""
    if out.is_dir():
        try:
            out.rmdir()
        except OSError:
            raise ExportError(f"--out {out} was filled by something else during the export: choose a new one") from None
    os.rename(tmp, out)


def export_version(run: RunDir, out: str | Path, version: int | None = None, merge: bool = False, accuracy: float | None = None) -> Exported:
    """Writes `version` (default: the latest) of the run as a model directory at `out`: whole or not at all.
    `accuracy`: its held-out accuracy when the caller knows it (a pipeline's evaluate step), else looked up in the run."""
    out = Path(out)
    refuse_used_out(out)
    info = run.info()
    store = WeightStore(run.weights)
    version = chosen_version(store, version)
    snapshot = store.path(version)
    manifest = verified_manifest(snapshot, snapshot_keys(run.root))
    adapter = is_adapter(snapshot)
    kind = ("merged" if merge else "adapter") if adapter else "full"
    tmp = temp_beside(out)
    try:
        if kind == "full":
            write_full(snapshot, info.base_model, manifest, tmp)
        elif kind == "adapter":
            write_adapter(snapshot, info.base_model, manifest, model_dtype(run), tmp, out)
        else:
            write_merged(snapshot, info.base_model, model_dtype(run), tmp)
        record = export_record(info, version, kind, manifest, heldout_accuracy(run, version) if accuracy is None else accuracy)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1))
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, version, kind, record)


def registry_tags(record: dict) -> dict[str, str]:
    """What a registered version is compared and promoted by in the MLflow UI."""
    tags = {
        "tidal.run_id": record["run_id"],
        "tidal.version": str(record["version"]),
        "tidal.iteration": "" if record["iteration"] is None else str(record["iteration"]),
        "tidal.export": record["kind"],
        "tidal.base_model": record["base_model"],
    }
    if record["heldout_accuracy"] is not None:
        tags["tidal.heldout_accuracy"] = str(record["heldout_accuracy"])
    return tags


def mlflow_run_of(run: RunDir) -> RunInfo:
    """run.json, checked to name an MLflow run (before anything is exported)."""
    info = run.info()
    if not (info.mlflow_run_id and info.tracking_uri):
        raise ExportError(
            f"--register needs the run's MLflow run, and {run.info_file} records none: runs started by `tidal run` have one "
            "(tracking.uri, else $MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db); a pipeline's run needs MLFLOW_TRACKING_URI set when it is prepared"
        )
    return info


def check_registry_name(name: str) -> None:
    """The name MLflow's Model Registry accepts, checked before anything is exported."""
    from tidal.tracking import registry_name_problem

    problem = registry_name_problem(name)
    if problem:
        raise ExportError(f"--register {name!r}: {problem}")


def register_export(run: RunDir, exported: Exported, name: str) -> str:
    """Logs the exported directory to the run's MLflow run and registers it as a version of `name`; returns the version."""
    from tidal import tracking

    info = mlflow_run_of(run)
    artifact_path = f"{EXPORT_ARTIFACT}/{version_dir_name(exported.version)}-{exported.kind}"
    return tracking.register_model(info.tracking_uri, info.mlflow_run_id, name, exported.path, artifact_path, tags=registry_tags(exported.record))


def register(sub) -> None:
    ex = sub.add_parser(
        "export",
        help="a version of a run's weights as a Hugging Face model directory (LoRA: base + adapter, or merged)",
        description="Writes one weight version of a run as a directory that transformers loads, with its tokenizer, chat template "
        f"and {EXPORT_RECORD} (run id, version, source hashes, held-out accuracy). The snapshot's hashes (and signature) are "
        "checked first; the directory appears whole or not at all.",
    )
    ex.add_argument("run_dir", help="run directory")
    ex.add_argument("--out", required=True, help="the model directory to write (must not exist, or be empty)")
    ex.add_argument("--version", type=int, default=None, metavar="N", help="the weight version to export (default: the latest)")
    ex.add_argument(
        "--merge",
        action="store_true",
        help=f"LoRA runs: merge the adapter into the base weights (one plain model) instead of the base model plus {ADAPTER_FOLDER}/; "
        "a no-op for full-weight runs",
    )
    ex.add_argument("--register", default=None, metavar="NAME", help="also log it to the run's MLflow run and register it as a version of model NAME")
    ex.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    run = RunDir(args.run_dir)
    if not run.started:
        raise FileNotFoundError(f"{run.root} is not a run directory (no {run.info_file.name})")
    run.rehome_moved_store()
    if args.register is not None:
        check_registry_name(args.register)
        mlflow_run_of(run)
    exported = export_version(run, args.out, args.version, args.merge)
    line = f"exported version {exported.version} of {exported.record['run_id']} ({exported.kind}) to {exported.path}"
    if exported.version == 0:  # the base (or warm start), not a trained policy
        line += " (version 0 is the starting model" + ("; the run trained no step)" if args.version is None else ", before any step)")
    if args.merge and exported.kind == "full":
        line += " (--merge: a full-weight version has no adapter to merge)"
    if args.register is not None:
        line += f"; registered as {args.register} version {register_export(run, exported, args.register)}"
    print(line)
    return 0

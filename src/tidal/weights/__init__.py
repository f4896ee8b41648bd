"""Versioned weight snapshots: `weights/v000042/` = safetensors + manifest, written atomically."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
# Files copied from the base model so every snapshot is itself a loadable HF model directory.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class CorruptSnapshotError(RuntimeError):
    """A snapshot's files do not match its manifest."""


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unique_tensors(state_dict: dict[str, torch.Tensor], to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Drops tied aliases (safetensors refuses shared storage, a broadcast sends each tensor once);
    the model re-ties them on load."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu() if to_cpu else tensor.detach().contiguous()
    return out


class WeightStore:
    def __init__(self, root: str | Path, base_model_dir: str | Path | None = None):
        self.root = Path(root)
        self.base_model_dir = Path(base_model_dir) if base_model_dir else None

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> Path:
        """Writes into a temp dir, then renames: readers see a whole snapshot or none."""
        final = self.path(version)
        tmp = self.root / f".tmp-{version_dir_name(version)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = unique_tensors(state_dict)
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "tidal_version": str(version)})
        if self.base_model_dir and self.base_model_dir.is_dir():
            for name in SIDE_FILES:
                if (self.base_model_dir / name).is_file():
                    shutil.copy2(self.base_model_dir / name, tmp / name)
        manifest = {
            "version": version,
            "files": {WEIGHTS_FILE: sha256_of(tmp / WEIGHTS_FILE)},
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
            "num_tensors": len(tensors),
            "created": time.time(),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        self.point_latest(version)
        return final

    def remove_temp(self) -> list[str]:
        """Removes what an interrupted publish left (`.tmp-v…` folders, `.latest-…` files); call it
        only when no publish can be running (the trainer, on start). Returns the names removed."""
        if not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir() if p.name.startswith((".tmp-v", ".latest-"))]
        for p in stale:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return sorted(p.name for p in stale)

    def point_latest(self, version: int) -> None:
        """Moves the `latest` pointer atomically."""
        tmp = self.root / f".latest-{os.getpid()}"
        tmp.write_text(str(version))
        os.replace(tmp, self.root / "latest")

    def latest_version(self) -> int | None:
        marker = self.root / "latest"
        return int(marker.read_text()) if marker.is_file() else None

    def load(self, version_or_path: int | str | Path) -> dict[str, torch.Tensor]:
        """Loads a snapshot after checking every file's sha256 against the manifest."""
        path = self.path(version_or_path) if isinstance(version_or_path, int) else Path(version_or_path)
        return load_verified(path)


def load_verified(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CorruptSnapshotError(f"snapshot {path}: no {MANIFEST_FILE}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError) as err:
        raise CorruptSnapshotError(f"snapshot {path}: unreadable manifest ({err})") from None
    for name, expected in files.items():
        if not (path / name).is_file():
            raise CorruptSnapshotError(f"snapshot {path}: {name} is missing")
        actual = sha256_of(path / name)
        if actual != expected:
            raise CorruptSnapshotError(f"snapshot {path}: {name} sha256 {actual[:12]}… does not match manifest {expected[:12]}…")
    return load_file(str(path / WEIGHTS_FILE))

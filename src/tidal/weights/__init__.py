"""Versioned weight snapshots: `weights/v000042/` = safetensors + manifest, written atomically."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are written or read: the launcher's checks do without it
    import torch

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
# Files copied from the base model so every snapshot is itself a loadable HF model directory.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class CorruptSnapshotError(RuntimeError):
    """A snapshot's files do not match its manifest."""


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


_VERSION_DIR = re.compile(r"^v(\d{6,})$")


def versions_in_use(current: int, max_staleness: int = 0) -> set[int]:
    """Versions a rollout worker may still load once ``current`` is published: ``current``, the previous
    one (a worker that has not switched yet) and, in bounded mode, the ``max_staleness`` before it."""
    return {v for v in range(current - max_staleness - 1, current + 1) if v >= 0}


def retained_versions(versions: list[int], keep_last: int | None, keep_every: int | None, protected: set[int]) -> set[int]:
    """Which of ``versions`` a retention policy keeps: the newest ``keep_last`` (None: all), every multiple of
    ``keep_every``, and every ``protected`` one whatever the policy says."""
    present = set(versions)
    if keep_last is None:
        return present
    keep = set(sorted(present)[-keep_last:]) | (protected & present)
    if keep_every:
        keep |= {v for v in present if v % keep_every == 0}
    return keep


SIGNING_KEY_ENV = "TIDAL_WEIGHTS_KEY"  # the run's secret: `tidal run` sets it from RUN_DIR/weights-key, a cluster from a Secret


def signing_key_from_env() -> bytes | None:
    key = os.environ.get(SIGNING_KEY_ENV, "")
    return key.encode() if key else None


def manifest_signature(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 of the manifest (its `hmac` field aside) under the run's key: a snapshot whose
    manifest is consistent (right sha256s) but not signed with the key was not written by the run's trainer."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


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
        self.written: dict[int, str] = {}  # version -> sha256 of the weights this store published

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> Path:
        """Writes into a temp dir, then renames: readers see a whole snapshot or none."""
        tmp, manifest = self._write_temp(version, state_dict, dtype)
        self.written[version] = manifest["files"][WEIGHTS_FILE]
        return self._commit(version, tmp)

    def repair(self, version: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> bool:
        """Snapshot `version` as a worker would load it: False when it verifies; True when it did not
        and was rewritten from `state_dict`, which must be the weights it held (the same sha256 as
        when this store published it, or as its manifest says). Raises CorruptSnapshotError when
        the snapshot is corrupt and `state_dict` is no longer those weights."""
        try:
            verify_snapshot(self.path(version))
            return False
        except CorruptSnapshotError as err:
            damage = str(err)
        expected = self.written.get(version) or manifest_sha256(self.path(version))
        tmp, manifest = self._write_temp(version, state_dict, dtype)
        if manifest["files"][WEIGHTS_FILE] != expected:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CorruptSnapshotError(
                f"{damage}; it cannot be rewritten: the trainer's weights are no longer v{version}"
                + ("" if expected else " (and the manifest that would prove it is unreadable)")
            )
        self._commit(version, tmp, point_latest=False)
        log.warning("rewrote snapshot v%d, which did not verify (%s)", version, damage)
        return True

    def _write_temp(self, version: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[Path, dict]:
        tmp = self.root / f".tmp-{version_dir_name(version)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = unique_tensors(state_dict)
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        # one metadata key: safetensors writes the metadata map in hash order, and `repair` needs the
        # same weights to give the same bytes (the version is in the manifest)
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
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
        key = signing_key_from_env()
        if key:
            manifest["hmac"] = manifest_signature(manifest, key)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        return tmp, manifest

    def _commit(self, version: int, tmp: Path, point_latest: bool = True) -> Path:
        final = self.path(version)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        if point_latest:
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

    def versions(self) -> list[int]:
        """Published snapshots, oldest first (temporary and deleted ones are not versions)."""
        if not self.root.is_dir():
            return []
        found = (_VERSION_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def prune(self, keep_last: int | None, keep_every: int | None = None, protected: set[int] = frozenset()) -> list[int]:
        """Delete the snapshots the retention policy does not keep; returns their versions.

        The version ``latest`` points at is always kept, besides ``protected``. A snapshot first leaves
        its name by an atomic rename, so a reader sees a whole snapshot or none, never a half-deleted one."""
        latest = self.latest_version()
        keep = retained_versions(self.versions(), keep_last, keep_every, set(protected) | ({latest} if latest is not None else set()))
        deleted = []
        for version in self.versions():
            if version in keep:
                continue
            trash = self.root / f".deleted-{version_dir_name(version)}-{os.getpid()}"
            try:
                os.rename(self.path(version), trash)
            except FileNotFoundError:
                continue  # pruned by someone else meanwhile
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(version)
        if deleted:
            log.info("weight retention: deleted snapshot(s) %s of %s", ", ".join(f"v{v}" for v in deleted), self.root)
        return deleted

    def load(self, version_or_path: int | str | Path) -> dict[str, torch.Tensor]:
        """Loads a snapshot after checking every file's sha256 against the manifest."""
        path = self.path(version_or_path) if isinstance(version_or_path, int) else Path(version_or_path)
        return load_verified(path)


def load_verified(path: str | Path) -> dict[str, torch.Tensor]:
    """Loads a snapshot after verify_snapshot."""
    from safetensors.torch import load_file

    verify_snapshot(path)
    return load_file(str(Path(path) / WEIGHTS_FILE))


def verify_snapshot(path: str | Path) -> dict:
    """Every file's sha256 against the manifest; returns the manifest. CorruptSnapshotError names what is wrong."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CorruptSnapshotError(f"snapshot {path}: no {MANIFEST_FILE}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CorruptSnapshotError(f"snapshot {path}: unreadable manifest ({err})") from None
    key = signing_key_from_env()
    if key and not hmac.compare_digest(str(manifest.get("hmac", "")), manifest_signature(manifest, key)):
        what = "is not signed" if "hmac" not in manifest else "has a signature that does not match"
        raise CorruptSnapshotError(f"snapshot {path}: its manifest {what} with this run's key ({SIGNING_KEY_ENV}): not written by this run's trainer")
    for name, expected in files.items():
        if not (path / name).is_file():
            raise CorruptSnapshotError(f"snapshot {path}: {name} is missing")
        actual = sha256_of(path / name)
        if actual != expected:
            raise CorruptSnapshotError(f"snapshot {path}: {name} sha256 {actual[:12]}… does not match manifest {expected[:12]}…")
    return manifest


def manifest_sha256(path: Path) -> str | None:
    """The weights file's sha256 as the manifest records it; None when the manifest is unreadable."""
    try:
        return json.loads((path / MANIFEST_FILE).read_text())["files"][WEIGHTS_FILE]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None

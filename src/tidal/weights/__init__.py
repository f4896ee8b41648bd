"""Versioned weight snapshots, written atomically: `weights/v000042/` = model.safetensors + manifest.json
(full weights), or under LoRA adapter_model.safetensors + adapter_config.json + manifest.json (peft's
file names, on top of the base model the manifest names)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.weights.signing import SIGNATURE_FIELD, hmac_problem, manifest_signature, signature_problem, trusted_public_key

if TYPE_CHECKING:  # torch is imported where tensors are written or read: the launcher's checks do without it
    import torch

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # peft's save_pretrained names: PeftModel.from_pretrained(base, version_dir) loads a version
ADAPTER_CONFIG_FILE = "adapter_config.json"
MANIFEST_FILE = "manifest.json"
# Files copied from the base model so every snapshot is itself a loadable HF model directory.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class CorruptSnapshotError(RuntimeError):
    """A snapshot's files do not match its manifest."""


class WeightsDidNotArriveError(RuntimeError):
    """An engine that loaded a version computes other log-probs of the run's probe than the trainer published with it."""


def tensors_file(manifest: dict) -> str:
    """The file holding a snapshot's tensors: the adapter under LoRA, else the full weights."""
    return ADAPTER_FILE if manifest.get("kind") == "lora" else WEIGHTS_FILE


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


def write_adapter_files(directory: Path, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
    """An adapter laid out as peft's save_pretrained writes it, which PeftModel.from_pretrained and vLLM's
    LoRA loader read: the weight store's versions, and an engine's adapter received over NCCL."""
    from safetensors.torch import save_file

    # one metadata key: safetensors writes the metadata map in hash order, and the store's `repair`
    # needs the same weights to give the same bytes
    save_file(tensors, str(directory / ADAPTER_FILE), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))


class WeightStore:
    """`adapter_config` (peft's adapter_config.json as a dict): every version is an adapter on top of
    `base_model_dir`, which is stored once and named in each manifest. `probe` (tidal.model.probe):
    the sequences whose log-probs `publish` records with each version for the arrival check.
    `signing_key` (hex): the trainer's private key (tidal.run_keys.load_signing_key), which signs every manifest
    written; without one, manifests are unsigned and a run's loaders refuse them."""

    def __init__(
        self,
        root: str | Path,
        base_model_dir: str | Path | None = None,
        adapter_config: dict | None = None,
        probe: list | None = None,
        base_probe_logprobs: list | None = None,
        signing_key: str | None = None,
    ):
        self.root = Path(root)
        self.signing_key = signing_key
        self.base_model_dir = Path(base_model_dir) if base_model_dir else None
        self.adapter_config = adapter_config
        self.probe = probe
        self.base_probe_logprobs = base_probe_logprobs  # the base model's, recorded with every version (engines calibrate on it)
        self.written: dict[int, str] = {}  # version -> sha256 of the weights this store published
        self.probes: dict[int, dict] = {}  # version -> the probe record published with it (a rewrite keeps it)

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    @property
    def tensors_file(self) -> str:
        return ADAPTER_FILE if self.adapter_config is not None else WEIGHTS_FILE

    def publish(
        self, version: int, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None, probe_logprobs: list | None = None
    ) -> Path:
        """Writes into a temp dir, then renames: readers see a whole snapshot or none. `probe_logprobs`:
        the trainer's log-probs of `self.probe` at these weights, recorded in the manifest."""
        if probe_logprobs is not None:
            self.probes[version] = {"sequences": self.probe, "logprobs": probe_logprobs}
            if self.base_probe_logprobs is not None:
                self.probes[version]["base_logprobs"] = self.base_probe_logprobs
        tmp, manifest = self._write_temp(version, state_dict, dtype)
        self.written[version] = manifest["files"][self.tensors_file]
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
        if version not in self.probes and (old := readable_manifest(self.path(version))) and "probe" in old:
            self.probes[version] = old["probe"]
        tmp, manifest = self._write_temp(version, state_dict, dtype)
        if manifest["files"][self.tensors_file] != expected:
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
        extra: dict = {}
        if self.adapter_config is not None:  # the base is stored once, not copied into each version
            write_adapter_files(tmp, tensors, self.adapter_config)
            extra = {"kind": "lora", "base_model": str(self.base_model_dir) if self.base_model_dir else None}
        else:
            from safetensors.torch import save_file

            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})  # one key: see write_adapter_files
            if self.base_model_dir and self.base_model_dir.is_dir():
                for name in SIDE_FILES:
                    if (self.base_model_dir / name).is_file():
                        shutil.copy2(self.base_model_dir / name, tmp / name)
        files = [self.tensors_file] + ([ADAPTER_CONFIG_FILE] if self.adapter_config is not None else [])
        manifest = {
            "version": version,
            **extra,
            "files": {name: sha256_of(tmp / name) for name in files},
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
            "num_tensors": len(tensors),
            "created": time.time(),
        }
        if version in self.probes:
            manifest["probe"] = self.probes[version]
        if self.signing_key:
            manifest[SIGNATURE_FIELD] = manifest_signature(manifest, self.signing_key)
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


def load_verified(path: str | Path, public_key: str | None = None) -> dict[str, torch.Tensor]:
    """Loads a snapshot's tensors (the full weights, or the adapter) after verify_snapshot."""
    return load_verified_with_manifest(path, public_key)[0]


def load_verified_with_manifest(path: str | Path, public_key: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """load_verified, and the verified manifest."""
    from safetensors.torch import load_file

    manifest = verify_snapshot(path, public_key)
    name = tensors_file(manifest)
    if name not in manifest["files"]:
        raise CorruptSnapshotError(f"snapshot {path}: its manifest does not cover {name}")
    return load_file(str(Path(path) / name)), manifest


def verify_snapshot(path: str | Path, public_key: str | None = None, hmac_key: bytes | None = None) -> dict:
    """Every file's sha256 against the manifest, and its signature with `public_key` (hex; default: the key this
    process trusts, tidal.weights.signing.trust_public_key, which every role of a run sets); returns the manifest.
    CorruptSnapshotError names what is wrong. `hmac_key`, without a public key: the symmetric key of a run
    directory from before Ed25519 signing (tidal.run_keys.snapshot_keys). Without any key only the sha256s are checked."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CorruptSnapshotError(f"snapshot {path}: no {MANIFEST_FILE}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CorruptSnapshotError(f"snapshot {path}: unreadable manifest ({err})") from None
    public_key = public_key or trusted_public_key()
    problem = signature_problem(manifest, public_key) if public_key else hmac_problem(manifest, hmac_key) if hmac_key else None
    if problem:
        raise CorruptSnapshotError(f"snapshot {path}: {problem}: not written by this run's trainer")
    for name, expected in files.items():
        if not (path / name).is_file():
            raise CorruptSnapshotError(f"snapshot {path}: {name} is missing")
        actual = sha256_of(path / name)
        if actual != expected:
            raise CorruptSnapshotError(f"snapshot {path}: {name} sha256 {actual[:12]}… does not match manifest {expected[:12]}…")
    return manifest


def readable_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def manifest_sha256(path: Path) -> str | None:
    """The tensors file's sha256 as the manifest records it; None when the manifest is unreadable."""
    manifest = readable_manifest(path)
    try:
        return manifest["files"][tensors_file(manifest)]
    except (KeyError, TypeError):
        return None

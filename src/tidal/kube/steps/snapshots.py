"""The run's weight store as weight_sync and register_model see it: the newest snapshot, its check, the ``latest``
pointer (the core's :mod:`tidal.weights` rules; no torch)."""

from __future__ import annotations

from tidal.rundir import RunDir


def latest_snapshot(run: RunDir) -> tuple[int, str]:
    """``(version, path)`` of the snapshot the weight store's ``latest`` pointer names."""
    from tidal.weights import WeightStore

    store = WeightStore(run.weights)
    version = store.latest_version()
    if version is None:
        raise FileNotFoundError(f"no weight snapshot published under {store.root}: did the trainer run?")
    return version, str(store.path(version))


def trust_run_key(run: RunDir) -> None:
    """This pod's checks use the run's public key, from the file the staged config names (mounted from its ConfigMap)."""
    from tidal.config import load_config
    from tidal.run_keys import load_public_key

    load_public_key(load_config(run.config).weights.public_key_file, run)


def verify_snapshot(path: str) -> None:
    """Every file in the snapshot's manifest exists and matches its sha256, and the trainer signed it (the core's
    check, with the key trust_run_key read)."""
    from tidal.weights import load_verified

    load_verified(path)


def point_latest(run: RunDir, version: int) -> None:
    """Move the weight store's ``latest`` pointer to ``version`` (atomic rename, the store's format)."""
    from tidal.weights import WeightStore

    store = WeightStore(run.weights)
    if not store.path(version).is_dir():
        raise FileNotFoundError(f"cannot point latest at missing snapshot {store.path(version)}")
    store.point_latest(version)

"""Per-token policy versions of a sample (partial rollouts): which weights sampled each token.

A partial rollout (`rollout.partial`, bounded mode) may change weights in the middle of a response, so
a sample's tokens can come from several versions. In memory a sample keeps one version per token
(NO_VERSION on tokens the environment or the template inserted); on the wire the list travels
run-length encoded, as an int32 array of (version, count) rows, and a sample of one version leaves it
off altogether. Decoding checks the runs cover the tokens exactly and every sampled token's version
lies in the window the group allows.
"""

from __future__ import annotations

import numpy as np

NO_VERSION = -1  # an inserted token: no policy sampled it


class VersionRunsError(ValueError):
    """Runs that do not describe the sample's tokens; the text says why."""


def encode_runs(versions: np.ndarray) -> np.ndarray:
    """int32 [R, 2]: (version, count) of each run of equal versions, in order."""
    versions = np.asarray(versions, dtype=np.int64)
    if not versions.size:
        return np.zeros((0, 2), dtype=np.int32)
    starts = np.flatnonzero(np.r_[True, versions[1:] != versions[:-1]])
    counts = np.diff(np.r_[starts, versions.size])
    return np.stack([versions[starts], counts], axis=1).astype(np.int32)


def decode_runs(runs: object, size: int, sampled: np.ndarray | None, window: tuple[int, int]) -> np.ndarray:
    """The per-token versions (int32 [size]) the runs describe. `sampled`: bool [size] of the tokens a
    policy sampled (None: all); the others get NO_VERSION whatever the runs say. Every sampled token's
    version must lie in `window` (oldest, newest), inclusive."""
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1:] != (2,) or runs.dtype.kind not in "iu":
        raise VersionRunsError("expected an integer array of (version, count) rows")
    counts = runs[:, 1].astype(np.int64)
    if runs.shape[0] and int(counts.min()) < 1:
        raise VersionRunsError(f"a run of {int(counts.min())} tokens (each run holds at least one)")
    if int(counts.sum()) != size:
        raise VersionRunsError(f"runs of {int(counts.sum())} tokens for {size} tokens (one version per token)")
    versions = np.repeat(runs[:, 0].astype(np.int64), counts)
    if sampled is not None:
        versions = np.where(sampled, versions, NO_VERSION)
    chosen = versions if sampled is None else versions[sampled]
    oldest, newest = window
    if chosen.size and (int(chosen.min()) < oldest or int(chosen.max()) > newest):
        bad = int(chosen.min()) if int(chosen.min()) < oldest else int(chosen.max())
        raise VersionRunsError(f"a token of version {bad}, outside [{oldest}, {newest}] (the group's version to its iteration)")
    return versions.astype(np.int32)


def token_staleness(versions: np.ndarray, trained_version: int) -> np.ndarray:
    """Per sampled token: versions the trained weights are ahead of the weights that sampled it."""
    versions = np.asarray(versions)
    return (trained_version - versions[versions != NO_VERSION]).astype(np.int64)

"""Weight arrival: which version a work item needs, where that version is, and whether it arrived.

A worker generates an item of iteration v with weights v (periodic) or the newest published version
(bounded); it loads that version from the run's own weight store (or receives it some other way, e.g.
over NCCL), and then checks that it arrived: the engine's log-probs of the run's probe, a few fixed
sequences the trainer scored with the same weights, must match the trainer's. A refused snapshot
(checksums, tensors that do not fit) keeps the previous version and backs off; a version that did not
arrive stops the worker (WeightsDidNotArriveError).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from tidal.model.probe import (
    BASE_BOUND,
    CALIBRATION_FACTOR,
    DTYPE_TOLERANCE,
    arrival_tolerance,
    coarsest_dtype,
    largest_difference,
    probe_difference,
)
from tidal.protocol import WorkItem
from tidal.rollout.engine import RolloutEngine
from tidal.transport import Transport
from tidal.transport.health import WorkerHealth, report_refusal
from tidal.weights import WeightsDidNotArriveError, readable_manifest, version_dir_name

log = logging.getLogger(__name__)


async def version_to_generate(transport: Transport, mode: str, item: WorkItem) -> int | None:
    """The policy version that must generate `item`. periodic: exactly the item's iteration, once
    published. bounded: the newest published version, which is at least iteration -
    rollout.max_staleness because the trainer releases work only that far ahead. None when the
    trainer has already moved past the item's iteration (a leftover, e.g. a redelivered or spare
    item: its group would be discarded, and weight retention may have deleted its snapshot)."""
    if mode != "bounded":
        policy = await transport.wait_for_policy(item.iteration)
        return None if policy.version > item.iteration else item.iteration
    policy = await transport.wait_for_policy(0)
    return None if policy.version > item.iteration else policy.version


async def snapshot_path(transport: Transport, version: int, weights_root: Path | None) -> str:
    """Where weights `version` are, once the trainer has published them. A worker that knows its run
    directory loads from the run's own weight store: the KV pointer only says which version is
    current, so a pointer rewritten to another directory cannot redirect it to other weights.
    Without one (a worker built by hand), beside the pointer's URI."""
    policy = await transport.wait_for_policy(version)
    if weights_root is not None:
        return str(Path(weights_root) / version_dir_name(version))
    return os.path.join(os.path.dirname(policy.uri), version_dir_name(version))


async def check_arrival(
    engine: RolloutEngine, probe: dict | None, version: int, tolerance: float, worker_id: str, why: str = "weights.arrival_tolerance"
) -> float | None:
    """The engine's log-probs of the probe published with `version` (its manifest's record) against the
    trainer's: returns the mean per-token difference; one above `tolerance` is WeightsDidNotArriveError
    naming the version (the run stops). None: nothing checked (no probe, or the check is off)."""
    if not probe or not tolerance:
        return None
    return compare_probe(probe, await engine.probe(probe["sequences"]), version, tolerance, worker_id, why)


def compare_probe(
    probe: dict, engine_logprobs: list[list[float]], version: int, tolerance: float, worker_id: str, why: str = "weights.arrival_tolerance"
) -> float:
    """The mean per-token difference between the engine's log-probs of the probe and the trainer's (`probe` as
    the manifest records it); above `tolerance` (named by `why`) it is WeightsDidNotArriveError naming the version."""
    difference = probe_difference(probe["logprobs"], engine_logprobs)
    if not difference <= tolerance:
        largest = largest_difference(probe["logprobs"], engine_logprobs)
        raise WeightsDidNotArriveError(
            f"weights v{version} did not arrive on worker {worker_id}: its log-probs of the run's probe differ from the trainer's "
            f"by {difference:.3g} per token on average, up to {largest:.3g} ({why} {tolerance:g}, for the mean)"
        )
    return difference


class ArrivalCheck:
    """One engine's arrival check. Its tolerance is weights.arrival_tolerance when set; else the default for the dtypes
    both sides compute in (arrival_tolerance). Where one side computes in half precision, how far a right version
    lands depends on the model's depth and the hardware as much as on the dtype, so the engine also measures its
    difference on the base model, the one weights it serves before its first version: the tolerance of every version
    is then at least CALIBRATION_FACTOR times that, and a base further off than BASE_BOUND stops the worker."""

    def __init__(self, configured: float | None, engine: str, dtypes: tuple[str, ...], worker_id: str):
        self.tolerance = arrival_tolerance(configured, engine, *dtypes)
        self.why = "weights.arrival_tolerance"
        self.dtype = coarsest_dtype(*dtypes)
        self.uncalibrated = configured is None and self.tolerance > DTYPE_TOLERANCE["float32"]
        self.worker_id = worker_id

    def wants_base(self, probe: dict | None) -> bool:
        """True while the engine, still serving the base model, should be probed before its first version."""
        return bool(self.uncalibrated and probe and probe.get("base_logprobs"))

    def calibrate(self, probe: dict, base_logprobs: list[list[float]]) -> float:
        """From the engine's log-probs of the probe on the base model: the tolerance of every later version."""
        difference = probe_difference(probe["base_logprobs"], base_logprobs)
        bound = BASE_BOUND.get(self.dtype, max(BASE_BOUND.values()))
        if not difference <= bound:
            raise WeightsDidNotArriveError(
                f"the base model did not arrive on worker {self.worker_id}: its log-probs of the run's probe differ from the "
                f"trainer's by {difference:.3g} per token on average (at most {bound:g} in {self.dtype}): it is not the "
                "model the trainer trains"
            )
        self.uncalibrated = False
        if CALIBRATION_FACTOR * difference > self.tolerance:
            self.tolerance = CALIBRATION_FACTOR * difference
            self.why = f"the tolerance calibrated on the base model ({CALIBRATION_FACTOR}x its {difference:.2g}):"
        log.info(
            "worker %s: arrival check calibrated on the base model: %.2g per token in %s, tolerance %.2g",
            self.worker_id,
            difference,
            self.dtype,
            self.tolerance,
        )
        return difference

    def check(self, probe: dict | None, engine_logprobs: list[list[float]], version: int) -> float:
        return compare_probe(probe, engine_logprobs, version, self.tolerance, self.worker_id, self.why)


Receive = Callable[[int], Awaitable[bool]]


class WeightArrival:
    """How one worker's engine gets the versions it generates with."""

    def __init__(
        self,
        tolerance: float | None,
        trainer_dtypes: tuple[str, ...],
        engine: RolloutEngine,
        transport: Transport,
        health: WorkerHealth,
        weights_root: Path | None,
    ):
        """`tolerance`: weights.arrival_tolerance (None: the default for the dtypes); `trainer_dtypes`: what the
        trainer's probe forward computes in (tidal.model.probe.trainer_compute_dtypes)."""
        self.tolerance, self.trainer_dtypes = tolerance, trainer_dtypes
        self.engine, self.transport, self.health, self.weights_root = engine, transport, health, weights_root
        self._check: ArrivalCheck | None = None
        self.backoff = 0.0  # after a refusal: how long the worker waits before trying again

    @property
    def check(self) -> ArrivalCheck:
        """The engine's arrival check (made on first use: an engine knows its dtype once started)."""
        if self._check is None:
            dtypes = (*self.engine.compute_dtypes, *self.trainer_dtypes)
            self._check = ArrivalCheck(self.tolerance, self.engine.kind, dtypes, self.health.worker_id)
        return self._check

    async def path(self, version: int) -> str:
        return await snapshot_path(self.transport, version, self.weights_root)

    async def load(self, version: int, receive: Receive | None = None) -> float | None:
        """Loads `version` and checks that it arrived; returns the seconds taken, or None when the
        snapshot is refused (recorded in the heartbeat, which tells the trainer; the previous version
        serves on). `receive(version)`: another way in (NCCL), tried first; False: load from the store."""
        t0 = time.time()
        path = await self.path(version)
        await self._calibrate_on_base(path)
        if receive is not None and await receive(version):
            # the trainer published the version (with its probe record) before it sent it
            source, probe = " over NCCL", (readable_manifest(Path(path)) or {}).get("probe")
        else:
            result = await self.engine.load_weights(path)
            if "error" in result:
                self.backoff = await report_refusal(self.transport, self.health, version, result["error"])
                if result.get("partial") and self.health.version is not None:
                    await self.engine.load_weights(await self.path(self.health.version))
                return None
            source, probe = " from the weight store", result.get("probe")
        loaded = time.time() - t0
        difference = None
        if probe:  # a version published without one is not checked
            difference = await check_arrival(self.engine, probe, version, self.check.tolerance, self.health.worker_id, self.check.why)
        self.health.loaded(version)
        arrived = "" if difference is None else f" (probe log-probs within {difference:.1e} of the trainer's, mean per token)"
        log.info("worker %s loaded weights v%d in %.3fs%s%s", self.health.worker_id, version, loaded, source, arrived)
        return time.time() - t0

    async def _calibrate_on_base(self, path: str) -> None:
        """Before the engine's first version (it still serves the base model): the arrival check's
        calibration, on the base's record that version `path`'s manifest carries."""
        if self.health.version is not None:
            return
        probe = (readable_manifest(Path(path)) or {}).get("probe")
        if probe and self.check.wants_base(probe):
            self.check.calibrate(probe, await self.engine.probe(probe["sequences"]))

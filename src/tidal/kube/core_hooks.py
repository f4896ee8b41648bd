"""The only place where the Kubeflow layer touches Tidal's core internals.

Everything else in :mod:`tidal.kube` talks to the core through its CLI verbs
(``tidal train``, ``tidal rollout-worker``, ``tidal eval``). Keeping these few
calls in one adapter means a change in the core's transport, run-info or
weight-store API is fixed here, once.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from tidal.protocol import RunState
from tidal.rundir import RunDir, new_run_id

# run states after which a round's rollout workers may stop (the worker pods' supervisor reads them)
ROUND_OVER_STATES = (RunState.ROUND_DONE.value, RunState.DONE.value)


def run_id_of(run: RunDir) -> str:
    """The run's id, which names its streams and KV bucket: a pipeline's run directory is named by its KFP job."""
    return new_run_id(run.root, unique_name=True)


BASE_MODEL_DIR = "base-model"
"""Where the prepare step stages the base model inside the run directory (on the shared volume)."""


def prepare_run(run: RunDir, config_path: str, tracking_uri: str, mlflow_run_id: str, shared_roots: tuple[str, ...] = ()) -> None:
    """Stage the base model and data, write run.json, create the streams and the KV bucket.

    The base model is copied into ``RUN_DIR/base-model`` (see :func:`stage_base_model`), and
    run.json records that path: the prepare pod's own cache vanishes with the pod.
    """
    from tidal.config import load_config
    from tidal.roles import check_prompt_settings, ensure_base_model, run_async
    from tidal.rundir import RunInfo

    cfg = load_config(config_path)
    if not run.started:
        base_model = stage_base_model(ensure_base_model(cfg), run, shared_roots)
        check_prompt_settings(cfg, base_model)
        run.save_info(RunInfo(run_id=run_id_of(run), base_model=str(base_model), tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id))
    run_async(_create_transport(cfg, run))


def stage_base_model(base_model: str | Path, run: RunDir, shared_roots: tuple[str, ...] = ()) -> str:
    """Where every later pod finds the base model: a local directory is copied to ``RUN_DIR/base-model``.

    The warm-started tiny model, and any model directory, lives in this pod's file system
    (``$TIDAL_CACHE`` or ``$HOME/.cache/tidal``), which the trainer and worker pods do not see.
    A directory already inside the run directory or under one of ``shared_roots`` (the data
    volume) is used where it is. A name that is not a local directory (a Hugging Face hub id) is
    returned unchanged: each pod resolves it itself. The copy is atomic (a temporary folder,
    renamed), so a retried prepare step either finds the staged model or stages it again.
    """
    source = Path(base_model)
    if not source.is_dir():
        return str(base_model)
    source = source.resolve()
    run_path = run.root.resolve()
    if any(source.is_relative_to(Path(root).resolve()) for root in (run_path, *shared_roots)):
        return str(source)
    target = run_path / BASE_MODEL_DIR
    if (target / "config.json").is_file():
        return str(target)
    tmp = run_path / f".{BASE_MODEL_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return str(target)


async def _create_transport(cfg, run: RunDir) -> None:
    async with _session(cfg, run):
        pass  # a session with create=True sets up the run's streams and KV bucket


def open_round(run: RunDir, config_path: str, round_index: int) -> None:
    """Set the KV run state to running for ``round_index``, so the round's workers do not exit at once."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_put_run_state(load_config(config_path), run, RunState.RUNNING, round_index))


# ---------------------------------------------------------------- round sequencing (one round at a time)

ROUND_LEASE_KEY = "kube.round"
"""KV key of the round lease: ``{"job", "round", "state": "open"|"closed", "time"}``."""


class RoundSequenceError(RuntimeError):
    """A round was asked to start or end out of turn: rounds of one run directory ran concurrently."""


def reset_rounds(run: RunDir, config_path: str, job_id: str) -> str | None:
    """prepare: the rounds of pipeline run ``job_id`` start from scratch (none open, none closed). Returns a
    warning when another pipeline run had a round open on this run directory (it will fail at its next round)."""
    from tidal.config import load_config
    from tidal.roles import run_async

    return run_async(_reset_rounds(load_config(config_path), run, job_id))


def begin_round(run: RunDir, config_path: str, job_id: str, round_index: int) -> None:
    """Take the round lease for ``round_index``: only after round ``round_index - 1`` of the same pipeline run
    closed (or again, for a retried step of the same round). Raises :class:`RoundSequenceError` otherwise."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_move_lease(load_config(config_path), run, job_id, round_index, "open"))


def end_round(run: RunDir, config_path: str, job_id: str, round_index: int) -> None:
    """Release the round lease of ``round_index`` (its evaluation is done); the next round may begin."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_move_lease(load_config(config_path), run, job_id, round_index, "closed"))


async def _reset_rounds(cfg, run: RunDir, job_id: str) -> str | None:
    from tidal.protocol import pack

    async with _session(cfg, run) as transport:
        current, _ = await _read_lease(transport)
        warning = None
        if current and current.get("job") != job_id and current.get("state") == "open":
            warning = f"pipeline run {current.get('job')} had round {current.get('round')} of this run directory open; it will stop at its next round"
        await transport.kv.put(ROUND_LEASE_KEY, pack({"job": job_id, "round": -1, "state": "closed", "time": time.time()}))
        return warning


async def _move_lease(cfg, run: RunDir, job_id: str, round_index: int, to_state: str) -> None:
    from nats.js.errors import KeyWrongLastSequenceError

    from tidal.protocol import pack

    async with _session(cfg, run) as transport:
        current, revision = await _read_lease(transport)
        if current is None and to_state == "open" and round_index == 0:
            current = {"job": job_id, "round": -1, "state": "closed"}  # a run prepared before leases existed
        if not _allowed(current, job_id, round_index, to_state):
            raise RoundSequenceError(_out_of_turn(current, job_id, round_index, to_state))
        if current.get("round") == round_index and current.get("state") == to_state:
            return  # a retried step: already so
        value = pack({"job": job_id, "round": round_index, "state": to_state, "time": time.time()})
        try:
            if revision is None:
                await transport.kv.create(ROUND_LEASE_KEY, value)
            else:
                await transport.kv.update(ROUND_LEASE_KEY, value, last=revision)
        except KeyWrongLastSequenceError:
            raise RoundSequenceError(
                f"round {round_index} of pipeline run {job_id}: another step changed the round lease at the same moment, "
                f"so rounds of this run directory are running concurrently. {CONCURRENT_ROUNDS_ADVICE}"
            ) from None


CONCURRENT_ROUNDS_ADVICE = (
    "Rounds must run one after another (ParallelFor parallelism=1), which KFP backends honour from 2.4.0 "
    "(kubeflow/pipelines#10798); older ones start every round at once. Upgrade the KFP backend, or run one round "
    "(rounds=1, iterations_per_round=all iterations)."
)


def _allowed(current: dict | None, job_id: str, round_index: int, to_state: str) -> bool:
    if current is None or current.get("job") != job_id:
        return False
    at, state = current.get("round"), current.get("state")
    if to_state == "open":
        return (at == round_index - 1 and state == "closed") or (at == round_index and state == "open")
    return at == round_index and state in ("open", "closed")


def _out_of_turn(current: dict | None, job_id: str, round_index: int, to_state: str) -> str:
    verb = "start" if to_state == "open" else "end"
    if current is None:
        return f"round {round_index} cannot {verb}: the run has no round lease (did prepare run for pipeline run {job_id}?)"
    if current.get("job") != job_id:
        return (
            f"round {round_index} of pipeline run {job_id} cannot {verb}: pipeline run {current.get('job')} has since taken over "
            "this run directory (its prepare step ran). One pipeline run per run directory at a time."
        )
    return f"round {round_index} cannot {verb}: round {current.get('round')} of this run is {current.get('state')}. {CONCURRENT_ROUNDS_ADVICE}"


async def _read_lease(transport) -> tuple[dict | None, int | None]:
    from nats.js.errors import KeyNotFoundError

    from tidal.protocol import unpack

    try:
        entry = await transport.kv.get(ROUND_LEASE_KEY)
    except KeyNotFoundError:
        return None, None
    if entry is None or not entry.value:
        return None, entry.revision if entry else None
    value = unpack(entry.value)
    return (value if isinstance(value, dict) else None), entry.revision


def _session(cfg, run: RunDir, create: bool = True):
    """``async with _session(cfg, run) as transport``: the run's transport, closed at the block's end."""
    from tidal.transport import session

    return session(nats_url(cfg), run_id_of(run), cfg.transport, create=create)


def mark_run_failed(run: RunDir, config_path: str, round_index: int | None = None) -> None:
    """Set the KV run state to failed, so the round's rollout workers stop and release their accelerators."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_put_run_state(load_config(config_path), run, RunState.FAILED, round_index))


async def _put_run_state(cfg, run: RunDir, state: RunState, round_index: int | None) -> None:
    async with _session(cfg, run) as transport:
        await transport.put_run_state(state, round_index)


def delete_run_transport(run: RunDir, config_path: str) -> list[str]:
    """Delete the run's streams and KV bucket; returns what existed (nothing on a second call)."""
    from tidal.config import load_config
    from tidal.roles import run_async
    from tidal.transport import delete_run

    return run_async(delete_run(nats_url(load_config(config_path)), run_id_of(run)))


def nats_url(cfg) -> str:
    if not cfg.transport.nats_url:
        raise ValueError("transport.nats_url is empty: the pipeline needs a NATS server")
    return cfg.transport.nats_url


def latest_snapshot(run: RunDir) -> tuple[int, str]:
    """``(version, path)`` of the snapshot the weight store's ``latest`` pointer names."""
    from tidal.weights import WeightStore

    store = WeightStore(run.weights)
    version = store.latest_version()
    if version is None:
        raise FileNotFoundError(f"no weight snapshot published under {store.root}: did the trainer run?")
    return version, str(store.path(version))


def verify_snapshot(path: str) -> None:
    """Every file in the snapshot's manifest exists and matches its sha256 (the core's check)."""
    from tidal.weights import load_verified

    load_verified(path)


def point_latest(run: RunDir, version: int) -> None:
    """Move the weight store's ``latest`` pointer to ``version`` (atomic rename, the store's format)."""
    from tidal.weights import WeightStore

    store = WeightStore(run.weights)
    if not store.path(version).is_dir():
        raise FileNotFoundError(f"cannot point latest at missing snapshot {store.path(version)}")
    store.point_latest(version)


def read_run_state(run: RunDir, config_path: str) -> str | None:
    """The KV bucket's run state, e.g. ``"round_done"``; None before anyone set it (or if malformed)."""
    from tidal.config import load_config
    from tidal.roles import run_async

    return run_async(_get_run_state(load_config(config_path), run))


async def _get_run_state(cfg, run: RunDir) -> dict | None:
    async with _session(cfg, run, create=False) as transport:
        status = await transport.run_status()
    return None if status is None else status.state.value

"""The only place where the Kubeflow layer touches Tidal's core internals.

Everything else in :mod:`tidal.kube` talks to the core through its CLI verbs
(``tidal train``, ``tidal rollout-worker``, ``tidal eval``). Keeping these few
calls in one adapter means a change in the core's transport, run-info or
weight-store API is fixed here, once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tidal.protocol import RunState

# run states after which a round's rollout workers may stop (the worker pods' supervisor reads them)
ROUND_OVER_STATES = (RunState.ROUND_DONE.value, RunState.DONE.value)


def run_id_of(run_dir: str) -> str:
    """The run's id, which names its streams and KV bucket: the run directory's name."""
    return Path(run_dir).name


BASE_MODEL_DIR = "base-model"
"""Where the prepare step stages the base model inside the run directory (on the shared volume)."""


def prepare_run(run_dir: str, config_path: str, tracking_uri: str, mlflow_run_id: str, shared_roots: tuple[str, ...] = ()) -> None:
    """Stage the base model and data, write run.json, create the streams and the KV bucket.

    The base model is copied into ``RUN_DIR/base-model`` (see :func:`stage_base_model`), and
    run.json records that path: the prepare pod's own cache vanishes with the pod.
    """
    from tidal.config import load_config
    from tidal.roles import check_prompt_settings, ensure_base_model, run_async
    from tidal.rundir import RunInfo

    cfg = load_config(config_path)
    run_path = Path(run_dir)
    if not (run_path / "run.json").is_file():
        base_model = stage_base_model(ensure_base_model(cfg), run_dir, shared_roots)
        check_prompt_settings(cfg, base_model)
        RunInfo(run_id=run_id_of(run_dir), base_model=str(base_model), tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id).save(run_path)
    run_async(_create_transport(cfg, run_dir))


def stage_base_model(base_model: str | Path, run_dir: str, shared_roots: tuple[str, ...] = ()) -> str:
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
    run_path = Path(run_dir).resolve()
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


async def _create_transport(cfg, run_dir: str) -> None:
    from tidal.transport import Transport

    transport = await Transport.connect(nats_url(cfg), run_id_of(run_dir), cfg.transport, create=True)
    await transport.close()


def open_round(run_dir: str, config_path: str, round_index: int) -> None:
    """Set the KV run state to running for ``round_index``, so the round's workers do not exit at once."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_put_run_state(load_config(config_path), run_dir, RunState.RUNNING, round_index))


def mark_run_failed(run_dir: str, config_path: str, round_index: int | None = None) -> None:
    """Set the KV run state to failed, so the round's rollout workers stop and release their accelerators."""
    from tidal.config import load_config
    from tidal.roles import run_async

    run_async(_put_run_state(load_config(config_path), run_dir, RunState.FAILED, round_index))


async def _put_run_state(cfg, run_dir: str, state: RunState, round_index: int | None) -> None:
    from tidal.transport import Transport

    transport = await Transport.connect(nats_url(cfg), run_id_of(run_dir), cfg.transport, create=True)
    try:
        await transport.put_run_state(state, round_index)
    finally:
        await transport.close()


def delete_run_transport(run_dir: str, config_path: str) -> list[str]:
    """Delete the run's streams and KV bucket; returns what existed (nothing on a second call)."""
    from tidal.config import load_config
    from tidal.roles import run_async
    from tidal.transport import delete_run

    return run_async(delete_run(nats_url(load_config(config_path)), run_id_of(run_dir)))


def nats_url(cfg) -> str:
    if not cfg.transport.nats_url:
        raise ValueError("transport.nats_url is empty: the pipeline needs a NATS server")
    return cfg.transport.nats_url


def latest_snapshot(run_dir: str) -> tuple[int, str]:
    """``(version, path)`` of the snapshot the weight store's ``latest`` pointer names."""
    from tidal.weights import WeightStore

    store = WeightStore(Path(run_dir) / "weights")
    version = store.latest_version()
    if version is None:
        raise FileNotFoundError(f"no weight snapshot published under {store.root}: did the trainer run?")
    return version, str(store.path(version))


def verify_snapshot(path: str) -> None:
    """Every file in the snapshot's manifest exists and matches its sha256 (the core's check)."""
    from tidal.weights import load_verified

    load_verified(path)


def point_latest(run_dir: str, version: int) -> None:
    """Move the weight store's ``latest`` pointer to ``version`` (atomic rename, the store's format)."""
    from tidal.weights import WeightStore

    store = WeightStore(Path(run_dir) / "weights")
    if not store.path(version).is_dir():
        raise FileNotFoundError(f"cannot point latest at missing snapshot {store.path(version)}")
    store.point_latest(version)


def read_run_state(run_dir: str, config_path: str) -> str | None:
    """The KV bucket's run state, e.g. ``"round_done"``; None before anyone set it (or if malformed)."""
    from tidal.config import load_config
    from tidal.roles import run_async

    return run_async(_get_run_state(load_config(config_path), run_dir))


async def _get_run_state(cfg, run_dir: str) -> dict | None:
    from tidal.transport import Transport

    transport = await Transport.connect(nats_url(cfg), run_id_of(run_dir), cfg.transport, create=False)
    try:
        status = await transport.run_status()
        return None if status is None else status.state.value
    finally:
        await transport.close()

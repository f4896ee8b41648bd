"""The run's state in NATS as the pipeline's steps see it: the KV run state (running round N, round done,
failed), the round lease that keeps rounds one after another, and deleting the run's streams and KV bucket.

Each call is one session on the run's NATS server (:func:`tidal.transport.run_in_session`, the primitive
:class:`tidal.transport.RunNats` uses too; here the run id comes from the run directory's name, which
finalize needs before prepare wrote run.json). Nothing here imports torch: these steps run in small pods.
"""

from __future__ import annotations

import asyncio
import time

from tidal.protocol import RunState
from tidal.rundir import RunDir, new_run_id

# run states after which a round's rollout workers may stop (the worker pods' supervisor reads them)
ROUND_OVER_STATES = (RunState.ROUND_DONE.value, RunState.DONE.value)


def run_id_of(run: RunDir) -> str:
    """The run's id, which names its streams and KV bucket: a pipeline's run directory is named by its KFP job."""
    return new_run_id(run.root, unique_name=True)


def in_session(config_path: str, run: RunDir, fn, create: bool = True):
    """``await fn(transport)`` in one session on the run's streams and KV bucket (``create``: make them if missing)."""
    from tidal.config import load_config
    from tidal.transport import run_in_session

    cfg = load_config(config_path)
    return run_in_session(nats_url(cfg), run_id_of(run), cfg.transport, fn, create=create)


def open_round(run: RunDir, config_path: str, round_index: int) -> None:
    """Set the KV run state to running for ``round_index``, so the round's workers do not exit at once."""
    in_session(config_path, run, lambda t: t.put_run_state(RunState.RUNNING, round_index))


# ---------------------------------------------------------------- round sequencing (one round at a time)

ROUND_LEASE_KEY = "kube.round"
"""KV key of the round lease: ``{"job", "round", "state": "open"|"closed", "time"}``."""


class RoundSequenceError(RuntimeError):
    """A round was asked to start or end out of turn: rounds of one run directory ran concurrently."""


def reset_rounds(run: RunDir, config_path: str, job_id: str) -> str | None:
    """prepare: the rounds of pipeline run ``job_id`` start from scratch (none open, none closed). Returns a
    warning when another pipeline run had a round open on this run directory (it will fail at its next round)."""
    return in_session(config_path, run, lambda t: _reset_rounds(t, job_id))


def begin_round(run: RunDir, config_path: str, job_id: str, round_index: int) -> None:
    """Take the round lease for ``round_index``: only after round ``round_index - 1`` of the same pipeline run
    closed (or again, for a retried step of the same round). Raises :class:`RoundSequenceError` otherwise."""
    in_session(config_path, run, lambda t: _move_lease(t, job_id, round_index, "open"))


def end_round(run: RunDir, config_path: str, job_id: str, round_index: int) -> None:
    """Release the round lease of ``round_index`` (its evaluation is done); the next round may begin."""
    in_session(config_path, run, lambda t: _move_lease(t, job_id, round_index, "closed"))


async def _reset_rounds(transport, job_id: str) -> str | None:
    from tidal.protocol import pack

    current, _ = await _read_lease(transport)
    warning = None
    if current and current.get("job") != job_id and current.get("state") == "open":
        warning = f"pipeline run {current.get('job')} had round {current.get('round')} of this run directory open; it will stop at its next round"
    await transport.kv.put(ROUND_LEASE_KEY, pack({"job": job_id, "round": -1, "state": "closed", "time": time.time()}))
    return warning


async def _move_lease(transport, job_id: str, round_index: int, to_state: str) -> None:
    from nats.js.errors import KeyWrongLastSequenceError

    from tidal.protocol import pack

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


def mark_run_failed(run: RunDir, config_path: str, round_index: int | None = None) -> None:
    """Set the KV run state to failed, so the round's rollout workers stop and release their accelerators."""
    in_session(config_path, run, lambda t: t.put_run_state(RunState.FAILED, round_index))


def delete_run_transport(run: RunDir, config_path: str) -> list[str]:
    """Delete the run's streams and KV bucket; returns what existed (nothing on a second call)."""
    from tidal.config import load_config
    from tidal.transport import delete_run

    return asyncio.run(delete_run(nats_url(load_config(config_path)), run_id_of(run)))


def nats_url(cfg) -> str:
    if not cfg.transport.nats_url:
        raise ValueError("transport.nats_url is empty: the pipeline needs a NATS server")
    return cfg.transport.nats_url


def read_run_state(run: RunDir, config_path: str) -> str | None:
    """The KV bucket's run state, e.g. ``"round_done"``; None before anyone set it (or if malformed)."""
    return in_session(config_path, run, _get_run_state, create=False)


async def _get_run_state(transport) -> str | None:
    status = await transport.run_status()
    return None if status is None else status.state.value

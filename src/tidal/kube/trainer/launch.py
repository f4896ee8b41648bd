"""The train step: where a round's trainer runs, and launching it there.

``trainer_backend=local`` runs ``tidal train`` in the step's own pod; ``trainjob`` (Kubeflow Trainer
v2) and ``pytorchjob`` (Training Operator v1) make the step a small launcher that creates the
round's trainer job, streams its log and waits for it. A launcher names each job per run, round and
attempt, owns it through its pod, and records it in the run directory before creating it, so the
pipeline's exit handler deletes whatever a killed launcher left behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tidal.kube import cluster
from tidal.kube.in_cluster import POD_NAME_ENV, POD_UID_ENV, current_namespace, is_not_found
from tidal.kube.steps import run_state
from tidal.kube.steps.pod_sandbox import as_separate_pod
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.kube.steps.tidal_cli import nats_url_of, run_command, tidal_executable, torchrun_executable
from tidal.rundir import RunDir


@dataclass(frozen=True)
class TrainerPlacement:
    """Where a round's trainer runs: ``local`` (in this pod/process), ``trainjob`` (Kubeflow Trainer v2) or ``pytorchjob``
    (Training Operator v1)."""

    backend: str = "local"
    nodes: int = 1
    accelerators_per_node: int = 1
    accelerator: str = "cpu"
    image: str = ""
    namespace: str = ""
    pipeline_job_id: str = ""
    cpu: str = "8"
    memory: str = "64Gi"
    deadline_s: int = 0
    """The trainer job's ``activeDeadlineSeconds`` (the operator fails it after that long); 0: none."""
    start_timeout_s: int = 3600
    """How long the job may stay unstarted (Pending, image pull, waiting for Kueue) before the launcher gives up."""
    queue_name: str = ""
    """Kueue LocalQueue of the trainer job (the ``kueue.x-k8s.io/queue-name`` label); empty: not queued."""


JOB_BACKENDS = ("trainjob", "pytorchjob")
TRAINER_BACKENDS = ("local", *JOB_BACKENDS)
DEFAULT_TRAINER_WAIT_S = 7 * 24 * 3600
DEADLINE_MARGIN_S = 600


class StepTerminated(PipelineStepError):
    """The step's pod got SIGTERM (the KFP run was cancelled, or the pod is being deleted)."""


@contextmanager
def termination_as_exception():
    """Turn SIGTERM into :class:`StepTerminated`, so clean-up (delete the job, mark the run failed) runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise StepTerminated(f"received signal {signum}: the run was cancelled or the pod is being deleted")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@as_separate_pod("train")
def train_round(run_dir: str, config_path: str, round_index: int, iterations: int, placement: TrainerPlacement, job_backend=None) -> None:
    """Train ``iterations`` iterations, resuming from the latest checkpoint in the run directory.

    Whatever goes wrong — a bad placement, a job the API server refuses, a job that never starts
    (Pending, image pull), dies (OOM, the operator's deadline) or outlives the launcher's wait, or
    a cancelled run — the KV run state is set to failed before the step fails, so the round's
    rollout workers stop and release their accelerators instead of waiting forever.
    """
    run = RunDir(Path(run_dir))
    try:
        with termination_as_exception():
            if placement.backend == "local":
                run_command(local_trainer_command(config_path, run, nats_url_of(config_path), iterations, placement), "tidal train")
            elif placement.backend in JOB_BACKENDS:
                train_round_as_job(run, config_path, round_index, iterations, placement, job_backend)
            else:
                raise PipelineStepError(f"trainer_backend must be one of {', '.join(TRAINER_BACKENDS)}, got {placement.backend!r}")
    except BaseException as err:
        record_run_failed(run, config_path, round_index, err)
        raise


def local_trainer_command(config_path: str, run: RunDir, nats_url: str, iterations: int, placement: TrainerPlacement) -> list[str]:
    """``trainer_backend=local``: the trainer runs in this step's pod, which the pipeline gives the trainer's
    requests and ``accelerators_per_node`` accelerators. One pod is one node; with more than one
    accelerator, ``torchrun --standalone`` starts a rank per accelerator, as in a job's replica."""
    if placement.nodes != 1:
        raise PipelineStepError(
            f"trainer_backend=local trains inside the step's one pod, so trainer_nodes must be 1 (got {placement.nodes}); "
            "use trainer_backend=trainjob (or pytorchjob) for several nodes"
        )
    args = ["train", config_path, "--run-dir", str(run.root), "--nats-url", nats_url, "--iterations", str(iterations)]
    ranks = placement.accelerators_per_node if cluster.accelerator_profile(placement.accelerator).has_accelerator else 1
    if ranks > 1:
        return [torchrun_executable(), "--standalone", f"--nproc-per-node={ranks}", "--no-python", *tidal_executable(), *args]
    return tidal_executable() + args


def record_run_failed(run: RunDir, config_path: str, round_index: int, reason: BaseException) -> None:
    """Best effort: the step is failing anyway; a NATS error here must not hide the original one."""
    print(f"round {round_index}: the trainer failed ({type(reason).__name__}: {reason}); marking the run failed", flush=True)
    try:
        run_state.mark_run_failed(run, config_path, round_index)
    except Exception as err:
        print(f"could not mark the run failed in the KV bucket: {err}", flush=True)


def train_round_as_job(
    run: RunDir, config_path: str, round_index: int, iterations: int, placement: TrainerPlacement, job_backend=None, policy_api_client=None
) -> None:
    """``policy_api_client``: where the job's NetworkPolicy is created (default: the cluster's, when ``job_backend``
    is too; a test's backend runs no pods that could rendezvous)."""
    from tidal.kube.trainer.shared import TrainerJobSpec, create_rendezvous_network_policy, run_trainer_job

    pod = launcher_pod()
    name = trainer_job_name(placement.pipeline_job_id or run.root.name, round_index, attempt_suffix(pod))
    spec = TrainerJobSpec(
        name=name,
        namespace=placement.namespace or current_namespace(),
        config_path=config_path,
        run_dir=str(run.root),
        iterations=iterations,
        profile=cluster.accelerator_profile(placement.accelerator),
        image=placement.image or None,
        nodes=placement.nodes,
        accelerators_per_node=placement.accelerators_per_node,
        cpu=placement.cpu,
        memory=placement.memory,
        nats_url=nats_url_of(config_path),
        active_deadline_seconds=placement.deadline_s or None,
        owner=pod,
        labels={cluster.RUN_LABEL: cluster.label_value(run.root.name), cluster.TRAINER_JOB_LABEL: name},
        queue_name=placement.queue_name,
    )
    backend = job_backend or default_job_backend(placement.backend, placement.start_timeout_s)
    wait_s = placement.deadline_s + DEADLINE_MARGIN_S if placement.deadline_s else DEFAULT_TRAINER_WAIT_S
    record_trainer_job(run, spec.namespace, spec.name, round_index, placement.backend)  # before creating it: finalize deletes what is left
    if job_backend is None or policy_api_client is not None:
        create_rendezvous_network_policy(spec, policy_api_client)
    run_trainer_job(backend, spec, timeout_s=wait_s)


def check_trainer_backend(kind: str, api_client=None) -> None:
    """At prepare, before anything is staged: a TrainJob needs Kubeflow Trainer >= v2.2 and its torch-distributed
    runtime (:func:`tidal.kube.trainer.trainjob.check_trainer_installed`); the other backends are checked when used."""
    if kind != "trainjob":
        return
    from kubernetes import client as k8s

    from tidal.kube.in_cluster import cluster_api_client
    from tidal.kube.trainer.trainjob import check_trainer_installed

    api_client = api_client or cluster_api_client()
    check_trainer_installed(k8s.ApiextensionsV1Api(api_client), k8s.CustomObjectsApi(api_client))


def default_job_backend(kind: str, start_timeout_s: int = 3600):
    if kind == "trainjob":
        from tidal.kube.trainer.trainjob import TrainJobBackend

        return TrainJobBackend(start_timeout_s=start_timeout_s)
    from tidal.kube.trainer.pytorchjob import PyTorchJobBackend

    return PyTorchJobBackend(start_timeout_s=start_timeout_s)


# ---------------------------------------------------------------- job records: what finalize deletes


def record_trainer_job(run: RunDir, namespace: str, name: str, round_index: int, kind: str = "pytorchjob") -> None:
    records = StepRecords(run).create()
    records.trainer_jobs.append({"namespace": namespace, "name": name, "round": round_index, "kind": kind})


def recorded_trainer_jobs(run: RunDir, with_kind: bool = False) -> list[tuple[str, ...]]:
    """``(namespace, name)`` of every recorded job, once each; ``with_kind`` adds its backend (lines without one are PyTorchJobs)."""
    jobs = StepRecords(run).trainer_jobs.read()
    keys = ((job["namespace"], job["name"], job.get("kind", "pytorchjob")) if with_kind else (job["namespace"], job["name"]) for job in jobs)
    return list(dict.fromkeys(keys))


def delete_trainer_jobs(run: RunDir, job_backend=None) -> list[str]:
    """Delete every recorded job with its own kind's backend (``job_backend``, when given, for all)."""
    backends = {}
    done = []
    for namespace, name, kind in recorded_trainer_jobs(run, with_kind=True):
        backend = job_backend or backends.setdefault(kind, default_job_backend(kind))
        try:
            backend.delete(name, namespace)
            done.append(f"deleted trainer job {namespace}/{name}")
        except Exception as err:
            if not is_not_found(err):
                raise
    return done


# ---------------------------------------------------------------- job naming and ownership


MAX_JOB_NAME = 52
"""The operator names Services ``<job>-master-0`` / ``<job>-worker-<i>``: DNS-1035 labels of at most 63."""


def trainer_job_name(run_name: str, round_index: int, attempt: str = "") -> str:
    """A DNS-1035 name unique per run, round and attempt (a KFP retry must not meet the last attempt's job)."""
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    attempt = "".join(c for c in attempt.lower() if c.isalnum())[:8]
    suffix = f"-r{round_index:03d}" + (f"-{attempt}" if attempt else "")
    return ("tidal-" + slug)[: MAX_JOB_NAME - len(suffix)].rstrip("-") + suffix


def launcher_pod() -> tuple[str, str] | None:
    """``(name, uid)`` of this step's pod from the downward API (set on the train step), else None."""
    name = next((os.environ[k] for k in POD_NAME_ENV if os.environ.get(k)), "")
    uid = next((os.environ[k] for k in POD_UID_ENV if os.environ.get(k)), "")
    return (name, uid) if name and uid else None


def attempt_suffix(pod: tuple[str, str] | None) -> str:
    """Five characters that differ between attempts: the launcher pod's uid, else random."""
    if pod is not None:
        return pod[1].replace("-", "")[:5].lower()
    return secrets.token_hex(3)[:5]

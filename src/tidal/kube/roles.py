"""What each KFP component does, as plain functions (the components only import and call these).

Every step reads and writes the run's storage — the run directory on the shared
PVC, the NATS KV bucket, the MLflow parent run — so a round started by a fresh
pod (or a retried one) picks up where the last round stopped. Tidal's roles run
as ``tidal`` CLI verbs in subprocesses, exactly as on a laptop; nothing crosses
a process boundary pickled (configs are YAML files, results JSON).

Layout inside a run directory (besides what the roles write)::

    config.yaml           the resolved config every step uses
    kube/pipeline.json    the MLflow parent run and tracking URI
    kube/round-NNN.json   what weight_sync and evaluate recorded for round NNN
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.kube import cluster, core_hooks

TRAINER_LANE = "trainer"
WORKER_LANE_PREFIX = "rollout-"
STATE_DIR = "kube"


class PipelineStepError(RuntimeError):
    """A pipeline step cannot go on; the message says which input or file is wrong."""


# ---------------------------------------------------------------- helpers


def tidal_executable() -> list[str]:
    """The ``tidal`` console script of this interpreter (the image's, or the venv's locally)."""
    beside = Path(sys.executable).with_name("tidal")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("tidal")
    if found:
        return [found]
    raise PipelineStepError(f"the 'tidal' command is not installed next to {sys.executable} nor on PATH; install Tidal in the component image")


def run_tidal(args: list[str], capture: bool = False) -> str:
    """Run a ``tidal`` verb; its output streams to this step's log. Raises naming the verb on failure."""
    command = tidal_executable() + args
    print("+ " + " ".join(command), flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE if capture else None, text=True)
    if result.returncode != 0:
        raise PipelineStepError(f"'tidal {args[0]}' exited with status {result.returncode}")
    return result.stdout or ""


def state_dir(run_dir: str) -> Path:
    path = Path(run_dir) / STATE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise PipelineStepError(f"{path} is missing: did the 'prepare' step run for this run directory?")
    return json.loads(path.read_text())


def parse_override_lines(text: str) -> list[str]:
    """``key=value`` per line (or separated by ``;``); blank lines and ``#`` comments ignored."""
    items = [part.strip() for line in text.splitlines() for part in line.split(";")]
    overrides = [item for item in items if item and not item.startswith("#")]
    for item in overrides:
        if "=" not in item:
            raise PipelineStepError(f"override {item!r} must look like key=value")
    return overrides


def worker_lanes(rollout_workers: int) -> list[str]:
    """The round's parallel lanes: the trainer first (kfp.local runs two lanes at a time), then workers."""
    if rollout_workers < 1:
        raise PipelineStepError(f"rollout_workers must be at least 1, got {rollout_workers}")
    return [TRAINER_LANE] + [f"{WORKER_LANE_PREFIX}{i}" for i in range(rollout_workers)]


POD_SANDBOX_ENV = "TIDAL_KFP_LOCAL_PODS"
"""Set by ``tidal run --via kfp-local``: a folder under which each step gets a fresh HOME, cache and
working directory, removed when the step ends, as a pod's would be. Only the run directory is shared."""


def as_separate_pod(step: str):
    """Run the decorated step function as if in its own pod when :data:`POD_SANDBOX_ENV` is set."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            root = os.environ.get(POD_SANDBOX_ENV)
            if not root:
                return function(*args, **kwargs)
            with pod_sandbox(step, Path(root)):
                return function(*args, **kwargs)

        return wrapper

    return decorate


@contextmanager
def pod_sandbox(step: str, root: Path):
    """A fresh HOME, $TIDAL_CACHE and working directory for this process; all removed on exit."""
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    pod = Path(tempfile.mkdtemp(prefix=f"{step}-", dir=root))
    home, work = pod / "home", pod / "work"
    home.mkdir()
    work.mkdir()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(HOME=str(home), TIDAL_CACHE=str(home / ".cache" / "tidal"), XDG_CACHE_HOME=str(home / ".cache"))
    os.chdir(work)
    try:
        yield pod
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(pod, ignore_errors=True)


# ---------------------------------------------------------------- prepare


@dataclass(frozen=True)
class PipelineKnobs:
    """The pipeline parameters that become config overrides (0 / "" keep the config's value)."""

    rounds: int
    iterations_per_round: int
    rollout_workers: int
    group_size: int = 0
    prompts_per_iteration: int = 0
    mode: str = ""
    experiment: str = ""
    nats_url: str = ""
    tracking_uri: str = ""
    overrides: str = ""

    def config_overrides(self) -> list[str]:
        if self.rounds < 1 or self.iterations_per_round < 1:
            raise PipelineStepError(f"rounds ({self.rounds}) and iterations_per_round ({self.iterations_per_round}) must both be at least 1")
        result = [f"trainer.iterations={self.rounds * self.iterations_per_round}", f"rollout.workers={self.rollout_workers}"]
        optional = {
            "rollout.group_size": self.group_size,
            "trainer.prompts_per_iteration": self.prompts_per_iteration,
            "mode": self.mode,
            "tracking.experiment": self.experiment,
            "transport.nats_url": self.nats_url,
            "tracking.uri": self.tracking_uri,
        }
        result += [f"{key}={value}" for key, value in optional.items() if value not in (0, "", None)]
        return result + parse_override_lines(self.overrides)


@dataclass(frozen=True)
class PreparedRun:
    run_dir: str
    config_path: str
    rounds: list[int]
    lanes: list[str]
    parent_run_id: str


def resolve_run_dir(run_dir: str, job_id: str) -> str:
    if run_dir:
        return run_dir
    if not job_id:
        raise PipelineStepError("either run_dir or the pipeline job id must be given")
    return f"{cluster.RUNS_ROOT}/{job_id}"


def stage_config(run_dir: str, config_yaml: str, config_path: str, overrides: list[str]) -> str:
    """Validate the config with the overrides applied and write the resolved one into the run directory.

    Config text (``config_yaml``, what ``tidal submit`` sends) has no folder of its own, so its data
    paths must be absolute: a path in the image or on the data volume (``tidal submit`` rewrites
    the paths of files it can map into the image and refuses the others). A config file in the
    image (``config_path``) may use paths relative to its folder. Either way, the data files must
    exist in this pod, or the step fails here naming the key instead of in a later pod.
    """
    from tidal.config import ConfigError, dump_config, load_config

    record = Path(run_dir) / STATE_DIR / "submitted-config.yaml"
    if config_yaml.strip():
        record.write_text(config_yaml)
        relative = relative_data_paths(config_yaml)
        if relative:
            listed = ", ".join(f"{key}: {value!r}" for key, value in relative.items())
            raise PipelineStepError(
                f"config_yaml has relative data paths ({listed}): config text has no folder to resolve them against. "
                f"Give absolute paths in the image or on the data volume ({cluster.DATA_MOUNT_PATH}), or submit with `tidal submit`, "
                "which maps files of the image's examples/ folder"
            )
        source, base_dir = record, None
    elif config_path:
        if not Path(config_path).is_file():
            raise PipelineStepError(f"config_path {config_path!r} does not exist in the component image")
        shutil.copyfile(config_path, record)
        source, base_dir = Path(config_path), None  # relative data paths: the file's folder in the image
    else:
        raise PipelineStepError("give the config as config_yaml (its text) or config_path (a file in the image)")
    try:
        config = load_config(source, overrides, base_dir)
    except ConfigError as err:
        raise PipelineStepError(str(err)) from None
    missing = {key: value for key, value in data_paths(config).items() if not Path(value).is_file()}
    if missing:
        listed = ", ".join(f"{key}={value}" for key, value in missing.items())
        raise PipelineStepError(f"data files not found in the pipeline's pods: {listed} (put them in the image or on the data volume)")
    from tidal.preflight import check_before_start

    try:  # what `tidal run` checks before it starts anything: reward names, data rows, prompt lengths
        check_before_start(config)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        raise PipelineStepError(str(err)) from None
    staged = Path(run_dir) / "config.yaml"
    staged.write_text(dump_config(config))
    return str(staged)


DATA_PATH_KEYS = ("path", "eval_path")


def relative_data_paths(config_yaml: str) -> dict[str, str]:
    """``data.path`` / ``data.eval_path`` values of config text that are relative paths."""
    import yaml

    try:
        data = (yaml.safe_load(config_yaml) or {}).get("data") or {}
    except (yaml.YAMLError, AttributeError):
        return {}  # the config loader reports the problem
    if not isinstance(data, dict):
        return {}
    return {f"data.{key}": data[key] for key in DATA_PATH_KEYS if isinstance(data.get(key), str) and not Path(data[key]).is_absolute()}


def data_paths(config) -> dict[str, str]:
    """The data files a resolved config reads, by dotted key."""
    return {f"data.{key}": getattr(config.data, key) for key in DATA_PATH_KEYS if getattr(config.data, key, None)}


def tracking_uri_for(run_dir: str, configured: str | None) -> str:
    """Explicit config value (the ``tracking_uri`` parameter), else $MLFLOW_TRACKING_URI (key ``tracking-uri`` of
    Secret ``tidal-mlflow``). Never a silent local store: a run whose metrics vanish into a file in the run
    directory looks like a run that logged nothing. ``tidal run --via kfp-local`` passes its own sqlite URI."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise PipelineStepError(
            f"no MLflow tracking URI: $MLFLOW_TRACKING_URI is unset (key 'tracking-uri' of Secret '{cluster.MLFLOW_SECRET}') "
            "and neither the tracking_uri parameter nor tracking.uri gives one. Create the Secret (docs/kubernetes.md), or pass "
            f"tracking_uri, e.g. sqlite:///{Path(run_dir).resolve()}/mlflow.db for a run without a tracking server"
        )
    return uri


def local_artifact_location(run_dir: str, tracking_uri: str) -> str | None:
    """Artifacts of a local (sqlite) store go into the run directory, not the working directory."""
    if tracking_uri.startswith("sqlite:"):
        return (Path(run_dir) / "mlartifacts").resolve().as_uri()
    return None


@dataclass(frozen=True)
class RunLinks:
    """Where people open KFP and MLflow (pipeline parameters ``kfp_ui_url``, ``mlflow_ui_url``); empty: unknown."""

    kfp_ui_url: str = ""
    mlflow_ui_url: str = ""

    def kfp_run_url(self, job_id: str) -> str:
        return f"{self.kfp_ui_url.rstrip('/')}/#/runs/details/{job_id}" if self.kfp_ui_url and job_id else ""


def kfp_tags(job_id: str, links: RunLinks) -> dict[str, str]:
    """Tags that lead from the MLflow run back to its KFP run."""
    tags = {"kfp.run_id": job_id} if job_id else {}
    url = links.kfp_run_url(job_id)
    if url:
        tags["kfp.run_url"] = url
        tags["mlflow.note.content"] = f"Kubeflow Pipelines run: [{job_id}]({url})"
    return tags


def mlflow_run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_ui_base(links: RunLinks, tracking_uri: str) -> str:
    """Where people open the MLflow UI: the ``mlflow_ui_url`` parameter, else the ``ui-url`` of Secret tidal-mlflow
    (e.g. the Kubeflow gateway's https://kubeflow.example.com/tidal/mlflow/), else an http(s) tracking URI (which on
    a cluster is the in-cluster address, http://tidal-mlflow:5000/tidal/mlflow); empty: no link, the run id only."""
    ui = links.mlflow_ui_url or os.environ.get(cluster.MLFLOW_UI_URL_ENV, "")
    return ui or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else "")


def mlflow_run_markdown(run_dir: str) -> str:
    """What the KFP run page shows for the MLflow run (KFP has no API to annotate a run once it exists)."""
    state = read_json(state_dir(run_dir) / "pipeline.json")
    url = state.get("mlflow_run_url", "")
    link = f"[{state['parent_run_id']}]({url})" if url else f"`{state['parent_run_id']}` on `{state['tracking_uri']}`"
    return f"## MLflow run\n\n{link}\n"


def open_parent_run(run_dir: str, config_path: str, job_id: str = "", links: RunLinks = RunLinks()) -> tuple[str, str]:
    """Create (or, on a retried prepare, reuse) the MLflow parent run of this pipeline run, tagged with the KFP run."""
    from mlflow.tracking import MlflowClient

    from tidal.config import flatten, load_config

    state_file = state_dir(run_dir) / "pipeline.json"
    if state_file.is_file():
        state = read_json(state_file)
        return state["parent_run_id"], state["tracking_uri"]
    config = load_config(config_path)
    uri = tracking_uri_for(run_dir, config.tracking.uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment(config.tracking.experiment, artifact_location=local_artifact_location(run_dir, uri))
    )
    tags = {"tidal.role": "pipeline", "tidal.run_dir": run_dir, **kfp_tags(job_id, links)}
    run = client.create_run(experiment_id, run_name=f"pipeline-{Path(run_dir).name}", tags=tags)
    params = flatten(config)
    for key, value in sorted(params.items()):
        client.log_param(run.info.run_id, key, str(value)[:6000])
    ui = mlflow_ui_base(links, uri)
    url = mlflow_run_url(ui, experiment_id, run.info.run_id) if ui else ""
    write_json_atomically(state_file, {"parent_run_id": run.info.run_id, "tracking_uri": uri, "mlflow_run_url": url})
    return run.info.run_id, uri


@as_separate_pod("prepare")
def prepare(config_yaml: str, config_path: str, run_dir: str, job_id: str, knobs: PipelineKnobs, links: RunLinks = RunLinks()) -> PreparedRun:
    """Validate the config, stage it and its data, create the streams and KV bucket, open the MLflow parent run."""
    run_dir = resolve_run_dir(run_dir, job_id)
    (state_dir(run_dir) / REGISTERED_FILE).unlink(missing_ok=True)  # this pipeline run has not succeeded (yet)
    for earlier in state_dir(run_dir).glob("eval-*.json"):  # nor evaluated: the run metrics are this run's
        earlier.unlink()
    staged = stage_config(run_dir, config_yaml, config_path, knobs.config_overrides())
    parent_run_id, tracking_uri = open_parent_run(run_dir, staged, job_id, links)
    core_prepare(run_dir, staged, tracking_uri, parent_run_id)
    warning = core_hooks.reset_rounds(run_dir, staged, job_id or "local")
    if warning:
        print(f"warning: {warning}", flush=True)
    return PreparedRun(
        run_dir=run_dir, config_path=staged, rounds=list(range(knobs.rounds)), lanes=worker_lanes(knobs.rollout_workers), parent_run_id=parent_run_id
    )


def core_prepare(run_dir: str, config_path: str, tracking_uri: str, parent_run_id: str) -> None:
    """Stage the base model and dataset, write run.json, create the run's streams and KV bucket."""

    core_hooks.prepare_run(run_dir, config_path, tracking_uri, parent_run_id, shared_roots=(cluster.DATA_MOUNT_PATH,))


# ---------------------------------------------------------------- a round


@as_separate_pod("open-round")
def open_round(run_dir: str, config_path: str, round_index: int, job_id: str) -> None:
    """Take the round lease (round ``round_index - 1`` of this pipeline run must have ended: a KFP backend that
    ignores the rounds loop's parallelism=1 starts every round at once, and all but one fail here, saying so,
    instead of sharing the run directory), then mark the run as running round ``round_index`` so this round's
    workers do not exit at once."""
    try:
        core_hooks.begin_round(run_dir, config_path, job_id or "local", round_index)
    except core_hooks.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    core_hooks.open_round(run_dir, config_path, round_index)
    log_to_parent_run(run_dir, metrics={"round/started": float(round_index)}, step=round_index)


WORKER_GRACE_SECONDS = 20.0
STATE_POLL_SECONDS = 2.0


@as_separate_pod("rollout-worker")
def rollout_worker(run_dir: str, config_path: str, lane: str, round_index: int) -> None:
    """One long-running rollout worker; the step ends when the KV run state says the round is over.

    The worker exits by itself at the end of a round; if it is still running
    ``WORKER_GRACE_SECONDS`` after the state says so (stuck in a long generation),
    it is terminated, so a round never outlives its trainer.
    """
    if not lane.startswith(WORKER_LANE_PREFIX):
        raise PipelineStepError(f"lane {lane!r} is not a rollout worker lane")
    worker_id = f"r{round_index:03d}-{lane}"
    command = tidal_executable() + [
        "rollout-worker",
        config_path,
        "--run-dir",
        run_dir,
        "--nats-url",
        nats_url_of(config_path),
        "--worker-id",
        worker_id,
    ]
    print("+ " + " ".join(command), flush=True)
    process = subprocess.Popen(command)
    try:
        supervise_worker(process, lambda: run_state(run_dir, config_path))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def run_state(run_dir: str, config_path: str) -> str:

    try:
        state = core_hooks.read_run_state(run_dir, config_path)
    except Exception as err:  # NATS briefly unreachable: keep the worker, ask again
        print(f"run state unavailable: {err}", flush=True)
        return "unknown"
    return state or "unknown"


def supervise_worker(process: subprocess.Popen, current_state, poll_s: float = STATE_POLL_SECONDS, grace_s: float = WORKER_GRACE_SECONDS) -> None:
    """Wait for the worker; stop it once the round is over; raise if it failed while the round was live."""
    over_since = None
    while True:
        try:
            code = process.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            code = None
        state = current_state()
        if code is not None:
            if code != 0 and state not in core_hooks.ROUND_OVER_STATES:
                raise PipelineStepError(f"'tidal rollout-worker' exited with status {code} while the run was {state!r}")
            return
        if state == "failed":
            process.terminate()
            raise PipelineStepError("the trainer marked the run as failed; stopped this rollout worker")
        if state in core_hooks.ROUND_OVER_STATES:
            over_since = over_since or time.monotonic()
            if time.monotonic() - over_since > grace_s:
                print(f"round is over ({state}); stopping the rollout worker", flush=True)
                process.terminate()
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                return


def nats_url_of(config_path: str) -> str:
    from tidal.config import load_config

    url = load_config(config_path).transport.nats_url
    if not url:
        raise PipelineStepError(f"{config_path}: transport.nats_url is empty; the pipeline needs a NATS server")
    return url


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
    try:
        with termination_as_exception():
            if placement.backend == "local":
                run_command(local_trainer_command(config_path, run_dir, nats_url_of(config_path), iterations, placement), "tidal train")
            elif placement.backend in JOB_BACKENDS:
                train_round_as_job(run_dir, config_path, round_index, iterations, placement, job_backend)
            else:
                raise PipelineStepError(f"trainer_backend must be one of {', '.join(TRAINER_BACKENDS)}, got {placement.backend!r}")
    except BaseException as err:
        record_run_failed(run_dir, config_path, round_index, err)
        raise


def local_trainer_command(config_path: str, run_dir: str, nats_url: str, iterations: int, placement: TrainerPlacement) -> list[str]:
    """``trainer_backend=local``: the trainer runs in this step's pod, which the pipeline gives the trainer's
    requests and ``accelerators_per_node`` accelerators. One pod is one node; with more than one
    accelerator, ``torchrun --standalone`` starts a rank per accelerator, as in a job's replica."""
    if placement.nodes != 1:
        raise PipelineStepError(
            f"trainer_backend=local trains inside the step's one pod, so trainer_nodes must be 1 (got {placement.nodes}); "
            "use trainer_backend=trainjob (or pytorchjob) for several nodes"
        )
    args = ["train", config_path, "--run-dir", run_dir, "--nats-url", nats_url, "--iterations", str(iterations)]
    ranks = placement.accelerators_per_node if cluster.accelerator_profile(placement.accelerator).has_accelerator else 1
    if ranks > 1:
        return [torchrun_executable(), "--standalone", f"--nproc-per-node={ranks}", "--no-python", *tidal_executable(), *args]
    return tidal_executable() + args


def torchrun_executable() -> str:
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.is_file() else (shutil.which("torchrun") or "torchrun")


def run_command(command: list[str], what: str) -> None:
    print("+ " + " ".join(command), flush=True)
    code = subprocess.run(command).returncode
    if code != 0:
        raise PipelineStepError(f"'{what}' exited with status {code}")


def record_run_failed(run_dir: str, config_path: str, round_index: int, reason: BaseException) -> None:
    """Best effort: the step is failing anyway; a NATS error here must not hide the original one."""
    print(f"round {round_index}: the trainer failed ({type(reason).__name__}: {reason}); marking the run failed", flush=True)
    try:
        core_hooks.mark_run_failed(run_dir, config_path, round_index)
    except Exception as err:
        print(f"could not mark the run failed in the KV bucket: {err}", flush=True)


def train_round_as_job(run_dir: str, config_path: str, round_index: int, iterations: int, placement: TrainerPlacement, job_backend=None) -> None:
    from tidal.kube.trainer_job import TrainerJobSpec, run_trainer_job

    pod = launcher_pod()
    spec = TrainerJobSpec(
        name=trainer_job_name(placement.pipeline_job_id or Path(run_dir).name, round_index, attempt_suffix(pod)),
        namespace=placement.namespace or current_namespace(),
        config_path=config_path,
        run_dir=run_dir,
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
        labels={"tidal.run": Path(run_dir).name[:63]},
        queue_name=placement.queue_name,
    )
    backend = job_backend or default_job_backend(placement.backend, placement.start_timeout_s)
    wait_s = placement.deadline_s + DEADLINE_MARGIN_S if placement.deadline_s else DEFAULT_TRAINER_WAIT_S
    record_trainer_job(run_dir, spec.namespace, spec.name, round_index, placement.backend)  # before creating it: finalize deletes what is left
    run_trainer_job(backend, spec, timeout_s=wait_s)


def default_job_backend(kind: str, start_timeout_s: int = 3600):
    if kind == "trainjob":
        from tidal.kube.trainjob import TrainJobBackend

        return TrainJobBackend(start_timeout_s=start_timeout_s)
    from tidal.kube.pytorchjob import PyTorchJobBackend

    return PyTorchJobBackend(start_timeout_s=start_timeout_s)


TRAINER_JOBS_FILE = "trainer-jobs.jsonl"
"""Every trainer job a launcher created (or was about to), one JSON line each: what finalize deletes."""


def record_trainer_job(run_dir: str, namespace: str, name: str, round_index: int, kind: str = "pytorchjob") -> None:
    with (state_dir(run_dir) / TRAINER_JOBS_FILE).open("a") as fh:
        fh.write(json.dumps({"namespace": namespace, "name": name, "round": round_index, "kind": kind}) + "\n")


def recorded_trainer_jobs(run_dir: str, with_kind: bool = False) -> list[tuple[str, ...]]:
    """``(namespace, name)`` of every recorded job, once each; ``with_kind`` adds its backend (lines without one are PyTorchJobs)."""
    path = Path(run_dir) / STATE_DIR / TRAINER_JOBS_FILE
    if not path.is_file():
        return []
    jobs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = ((job["namespace"], job["name"], job.get("kind", "pytorchjob")) if with_kind else (job["namespace"], job["name"]) for job in jobs)
    return list(dict.fromkeys(keys))


MAX_JOB_NAME = 52
"""The operator names Services ``<job>-master-0`` / ``<job>-worker-<i>``: DNS-1035 labels of at most 63."""


def trainer_job_name(run_name: str, round_index: int, attempt: str = "") -> str:
    """A DNS-1035 name unique per run, round and attempt (a KFP retry must not meet the last attempt's job)."""
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    attempt = "".join(c for c in attempt.lower() if c.isalnum())[:8]
    suffix = f"-r{round_index:03d}" + (f"-{attempt}" if attempt else "")
    return ("tidal-" + slug)[: MAX_JOB_NAME - len(suffix)].rstrip("-") + suffix


POD_NAME_ENV = ("TIDAL_POD_NAME", "KFP_POD_NAME")
POD_UID_ENV = ("TIDAL_POD_UID", "KFP_POD_UID")


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


def current_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "tidal"


# ---------------------------------------------------------------- weight sync, evaluation, finalize


@dataclass(frozen=True)
class SyncedWeights:
    version: int
    path: str


@as_separate_pod("weight-sync")
def weight_sync(run_dir: str, round_index: int) -> SyncedWeights:
    """Verify the round's newest snapshot against its manifest, point ``latest`` at it, log it to MLflow."""

    version, path = core_hooks.latest_snapshot(run_dir)
    try:
        core_hooks.verify_snapshot(path)
    except Exception as err:
        raise PipelineStepError(f"round {round_index}: snapshot v{version} failed verification: {err}") from None
    core_hooks.point_latest(run_dir, version)
    synced = SyncedWeights(version=version, path=path)
    write_json_atomically(state_dir(run_dir) / f"round-{round_index:03d}.json", {"round": round_index, **asdict(synced)})
    log_to_parent_run(
        run_dir,
        metrics={"round/policy_version": float(version)},
        step=round_index,
        tags={f"tidal.round{round_index:03d}.weights": path, "tidal.latest_weights": path},
    )
    return synced


@as_separate_pod("evaluate")
def evaluate(run_dir: str, config_path: str, weights_path: str, round_index: int, job_id: str) -> dict[str, float]:
    """Held-out metrics of the round's snapshot (``tidal eval``), logged to MLflow per round; the round's last
    step, so it releases the round lease and the next round may begin."""
    output = run_tidal(["eval", config_path, "--run-dir", run_dir, "--weights", weights_path], capture=True)
    print(output, flush=True)
    metrics = numeric_metrics(last_json_object(output))
    if not metrics:
        raise PipelineStepError(f"'tidal eval' printed no numeric metrics: {output[-500:]!r}")
    log_to_parent_run(run_dir, metrics={f"eval/{k}": v for k, v in metrics.items()}, step=round_index)
    write_json_atomically(state_dir(run_dir) / f"eval-{round_index:03d}.json", {"round": round_index, "metrics": metrics})
    try:
        core_hooks.end_round(run_dir, config_path, job_id or "local", round_index)
    except core_hooks.RoundSequenceError as err:
        raise PipelineStepError(str(err)) from None
    return metrics


def last_json_object(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise PipelineStepError(f"'tidal eval' did not print JSON: {text[-500:]!r}") from None


def final_metrics(run_dir: str, job_id: str) -> dict[str, float]:
    """The held-out metrics of the last evaluated round, and that round (the run's metrics); empty before any."""
    folder = Path(resolve_run_dir(run_dir, job_id)) / STATE_DIR
    evaluations = sorted(folder.glob("eval-*.json")) if folder.is_dir() else []
    if not evaluations:
        return {}
    last = json.loads(evaluations[-1].read_text())
    return {**{f"final_{k}": float(v) for k, v in last["metrics"].items()}, "rounds_evaluated": float(last["round"] + 1)}


def numeric_metrics(payload: dict) -> dict[str, float]:
    return {key: float(value) for key, value in payload.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


@as_separate_pod("register-model")
def register_model(run_dir: str, registered_model_name: str) -> str:
    """Log the final snapshot to the parent run and register it in the MLflow model registry."""
    from mlflow.tracking import MlflowClient

    state = read_json(state_dir(run_dir) / "pipeline.json")
    _, latest_path = core_hooks.latest_snapshot(run_dir)
    core_hooks.verify_snapshot(latest_path)
    latest = Path(latest_path)
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run_id = state["parent_run_id"]
    client.log_artifacts(run_id, str(latest), artifact_path="final_model")
    try:
        client.create_registered_model(registered_model_name)
    except Exception as err:  # already registered: add a version to it
        if "already exists" not in str(err).lower() and "RESOURCE_ALREADY_EXISTS" not in str(err):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/final_model"
    version = client.create_model_version(registered_model_name, source=source, run_id=run_id, tags={"tidal.weights": str(latest)})
    write_json_atomically(
        state_dir(run_dir) / REGISTERED_FILE, {"model": registered_model_name, "version": str(version.version), "weights": str(latest)}
    )
    print(f"registered {registered_model_name} version {version.version} from {latest}", flush=True)
    return str(version.version)


def log_to_parent_run(run_dir: str, metrics: dict[str, float] | None = None, step: int = 0, tags: dict[str, str] | None = None) -> None:
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    state = read_json(state_dir(run_dir) / "pipeline.json")
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    now = int(time.time() * 1000)
    client.log_batch(
        state["parent_run_id"],
        metrics=[Metric(k, v, now, step) for k, v in (metrics or {}).items()],
        tags=[RunTag(k, v) for k, v in (tags or {}).items()],
    )


# ---------------------------------------------------------------- finalize (the pipeline's exit handler)

REGISTERED_FILE = "registered.json"
"""Written by register_model, the run's last step: its presence is how finalize knows the run succeeded.
(An exit task could be handed dsl.PipelineTaskFinalStatus, but KFP backends before 2.14 cannot resolve it.)"""


@as_separate_pod("finalize")
def finalize_run(run_dir: str, job_id: str, namespace: str = "", job_backend=None) -> list[str]:
    """Whatever became of the run (the exit handler runs after success, failure and cancellation): delete
    trainer jobs that are left, end the MLflow parent run FINISHED (register_model got to the end) or
    FAILED, and delete the run's NATS streams and KV bucket. Every part is tried; the step fails
    afterwards if one failed, naming it. Returns what it did, one line per action. Weights, checkpoints
    and the config stay on the volume."""
    run_dir = resolve_run_dir(run_dir, job_id)
    succeeded = (Path(run_dir) / STATE_DIR / REGISTERED_FILE).is_file()
    done: list[str] = []
    problems: list[str] = []

    def attempt(what: str, action) -> None:
        try:
            done.extend(action())
        except Exception as err:
            problems.append(f"{what}: {type(err).__name__}: {err}")

    attempt("deleting trainer jobs", lambda: delete_trainer_jobs(run_dir, job_backend))
    attempt("ending the MLflow run", lambda: end_parent_run(run_dir, succeeded))
    attempt("deleting the NATS streams and KV bucket", lambda: delete_run_transport(run_dir))
    for line in done:
        print(line, flush=True)
    if problems:
        raise PipelineStepError("finalize could not clean up everything:\n  - " + "\n  - ".join(problems))
    return done


def delete_trainer_jobs(run_dir: str, job_backend=None) -> list[str]:
    """Delete every recorded job with its own kind's backend (``job_backend``, when given, for all)."""
    backends = {}
    done = []
    for namespace, name, kind in recorded_trainer_jobs(run_dir, with_kind=True):
        backend = job_backend or backends.setdefault(kind, default_job_backend(kind))
        try:
            backend.delete(name, namespace)
            done.append(f"deleted trainer job {namespace}/{name}")
        except Exception as err:
            if not is_not_found(err):
                raise
    return done


def is_not_found(err: BaseException) -> bool:
    """A Kubernetes 404, also when an SDK wrapped it (TrainingClient and TrainerClient raise RuntimeError from the ApiException)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if getattr(err, "status", None) == 404:
            return True
        err = err.__cause__ or err.__context__
    return False


def end_parent_run(run_dir: str, succeeded: bool) -> list[str]:
    state_file = Path(run_dir) / STATE_DIR / "pipeline.json"
    if not state_file.is_file():
        return []  # prepare never opened one
    from mlflow.tracking import MlflowClient

    state = read_json(state_file)
    status = "FINISHED" if succeeded else "FAILED"
    MlflowClient(tracking_uri=state["tracking_uri"]).set_terminated(state["parent_run_id"], status=status)
    return [f"MLflow run {state['parent_run_id']}: {status}"]


def delete_run_transport(run_dir: str) -> list[str]:
    config_path = Path(run_dir) / "config.yaml"
    if not config_path.is_file():
        return []  # prepare stopped before it created streams
    return [f"deleted {what}" for what in core_hooks.delete_run_transport(run_dir, str(config_path))]

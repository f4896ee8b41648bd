"""What a cluster does to the pipeline that kfp.local does not: pods that do not share a file system,
trainer jobs that never start or die, cancelled runs, retried steps, Istio sidecars.

A real nats-server stands for the cluster's NATS; stand-in trainer backends stand for the Kubernetes
API server (named so in the test names)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tidal.kube import cluster
from tidal.kube.pool import fixed as fixed_pool
from tidal.kube.steps import parent_run, rounds, run_end, run_start, run_state
from tidal.kube.steps.pod_sandbox import pod_sandbox
from tidal.kube.steps.records import PipelineStepError, StepRecords
from tidal.kube.trainer import launch as trainer_launch
from tidal.kube.trainer.pytorchjob import build_pytorchjob, check_pytorchjob, pytorchjob_to_dict
from tidal.kube.trainer.shared import JobOutcome, TrainerJobSpec
from tidal.rundir import RunDir

# ---------------------------------------------------------------- defect 2: the base model outlives the prepare pod


def test_staged_base_model_is_readable_from_another_pods_home(tmp_path, tiny_config_dict, monkeypatch):
    """prepare runs with one HOME and cache, a worker with another; only the run directory is shared."""
    from tidal.model.loading import load_model_and_tokenizer

    config = dict(tiny_config_dict, model={**tiny_config_dict["model"], "warm_start": {"steps": 2, "batch_size": 4}})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setattr(run_start, "create_transport", _no_transport)  # no NATS needed for staging
    monkeypatch.delenv("TIDAL_CACHE", raising=False)

    with pod_sandbox("prepare", tmp_path / "pods") as prepare_pod:
        assert Path.home() == prepare_pod / "home"
        run_start.prepare_run(RunDir(run_dir), str(config_path), "sqlite:///x.db", "mlflow-run")
        cache = Path(os.environ["TIDAL_CACHE"])
        assert any(cache.rglob("config.json"))  # the warm start was built in this pod's cache ...
    assert not prepare_pod.exists()  # ... which is gone with the pod

    base_model = json.loads((run_dir / "run.json").read_text())["base_model"]
    assert base_model == str(run_dir.resolve() / "base-model")
    with pod_sandbox("rollout-worker", tmp_path / "pods"):
        model, tokenizer = load_model_and_tokenizer(base_model, "float32")
        logits = model(**tokenizer("12+30=", return_tensors="pt")).logits  # the staged weights run a forward pass
        assert logits.shape[-1] == model.config.vocab_size and bool(logits.isfinite().all())


def _no_transport(run, config_path):
    return None


def test_stage_base_model_copies_local_dirs_keeps_shared_ones_and_hub_ids(tmp_path):
    model = tmp_path / "home" / ".cache" / "tidal" / "warm-start" / "abc"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    staged = run_start.stage_base_model(model, RunDir(run_dir))
    assert staged == str(run_dir / "base-model") and (run_dir / "base-model" / "config.json").is_file()
    assert run_start.stage_base_model(model, RunDir(run_dir)) == staged  # a retried prepare finds it
    assert run_start.stage_base_model("Qwen/Qwen2.5-0.5B-Instruct", RunDir(run_dir)) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert run_start.stage_base_model(model, RunDir(run_dir), shared_roots=(str(tmp_path / "home"),)) == str(model)
    assert not list(run_dir.glob(".base-model.tmp-*"))


def test_pod_sandbox_gives_each_step_its_own_home_cache_and_cwd(tmp_path):
    before = (os.environ.get("HOME"), os.environ.get("TIDAL_CACHE"), os.getcwd())
    with pod_sandbox("a", tmp_path) as a:
        seen_a = (os.environ["HOME"], os.environ["TIDAL_CACHE"], os.getcwd())
    with pod_sandbox("b", tmp_path) as b:
        seen_b = (os.environ["HOME"], os.environ["TIDAL_CACHE"], os.getcwd())
    assert a != b and not a.exists() and not b.exists()
    assert all(x != y for x, y in zip(seen_a, seen_b, strict=True))
    assert seen_a[2] == str(a / "work")
    assert (os.environ.get("HOME"), os.environ.get("TIDAL_CACHE"), os.getcwd()) == before


# ---------------------------------------------------------------- defect 5: a failed trainer ends the round


class StandInBackend:
    """Stands in for the Kubernetes API server behind PyTorchJobBackend; fails where told."""

    def __init__(self, fail_at: str = "", message: str = ""):
        self.fail_at = fail_at
        self.message = message
        self.calls: list[tuple] = []
        self.specs: list[TrainerJobSpec] = []

    def submit(self, spec):
        self.calls.append(("submit", spec.name))
        self.specs.append(spec)
        build_pytorchjob(spec)  # the real object, checked as the API server would
        if self.fail_at == "submit":
            raise RuntimeError("admission webhook denied the request")
        return spec.name

    def stream_logs(self, name, namespace):
        self.calls.append(("logs", name))
        if self.fail_at == "start":
            raise TimeoutError(f"timed out waiting for {name} to start: {self.message}")

    def wait(self, name, namespace, timeout_s):
        self.calls.append(("wait", name, timeout_s))
        if self.fail_at == "wait-timeout":
            raise TimeoutError(f"{name} did not finish within {timeout_s}s")
        if self.fail_at == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        return JobOutcome(name=name, succeeded=self.fail_at != "failed", message=self.message)

    def delete(self, name, namespace):
        self.calls.append(("delete", name))


@pytest.fixture
def pipeline_run(tmp_path, nats_server, tiny_config_dict):
    """A run directory with a staged config that names the live NATS server, its round 0 open."""
    config = dict(tiny_config_dict, transport={"nats_url": nats_server.url})
    run_dir = tmp_path / "runs" / "run-7"
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_state.open_round(RunDir(run_dir), str(config_path), 0)
    assert run_state.read_run_state(RunDir(run_dir), str(config_path)) == "running"
    return str(run_dir), str(config_path)


PLACEMENT = trainer_launch.TrainerPlacement(backend="pytorchjob", accelerator="nvidia", namespace="team-a", pipeline_job_id="job-7", deadline_s=3600)

FAILURES = {
    # where it fails: (what the job's object sees, whether the job was created and so must be deleted)
    "submit": ("the API server refuses the job", False),
    "start": ("Pending / ImagePullBackOff until the launcher's start timeout", True),
    "failed": ("OOMKilled: the operator marks the job Failed", True),
    "wait-timeout": ("the launcher's wait runs out (deadline + margin)", True),
    "sigterm": ("the KFP run is cancelled: the launcher pod gets SIGTERM", True),
}


@pytest.mark.parametrize("fail_at", sorted(FAILURES))
def test_a_trainer_that_fails_marks_the_run_failed_and_is_deleted_with_a_stand_in_backend(pipeline_run, fail_at):
    run_dir, config_path = pipeline_run
    backend = StandInBackend(fail_at=fail_at, message=FAILURES[fail_at][0])
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises((RuntimeError, TimeoutError)):
        trainer_launch.train_round(run_dir, config_path, 0, 2, PLACEMENT, job_backend=backend)
    assert run_state.read_run_state(RunDir(run_dir), config_path) == "failed"
    deleted = [c for c in backend.calls if c[0] == "delete"]
    assert deleted == ([("delete", backend.specs[0].name)] if FAILURES[fail_at][1] else [])
    assert signal.getsignal(signal.SIGTERM) == handler  # the step's SIGTERM handling is undone


def test_a_trainer_refused_before_any_job_exists_marks_the_run_failed_with_a_stand_in_backend(pipeline_run):
    run_dir, config_path = pipeline_run
    backend = StandInBackend()
    with pytest.raises(PipelineStepError, match="trainer_backend must be one of local, trainjob, pytorchjob"):
        trainer_launch.train_round(run_dir, config_path, 0, 2, trainer_launch.TrainerPlacement(backend="mpijob"), job_backend=backend)
    bad_shape = trainer_launch.TrainerPlacement(backend="pytorchjob", accelerator="nvidia", nodes=0)
    with pytest.raises(ValueError, match="trainer nodes must be at least 1"):
        trainer_launch.train_round(run_dir, config_path, 0, 2, bad_shape, job_backend=backend)
    assert run_state.read_run_state(RunDir(run_dir), config_path) == "failed"
    assert [c[0] for c in backend.calls] == ["submit"]  # refused while building: nothing to delete


def test_a_trainer_that_never_starts_stops_the_rounds_workers_with_a_stand_in_backend(pipeline_run):
    """The chain a cluster runs: the launcher gives up on a Pending job, marks the run failed, and
    the rollout worker steps (which read the KV run state) stop their workers and end."""
    run_dir, config_path = pipeline_run
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(TimeoutError):
            trainer_launch.train_round(run_dir, config_path, 0, 2, PLACEMENT, job_backend=StandInBackend(fail_at="start", message="Pending"))
        with pytest.raises(PipelineStepError, match="trainer marked the run as failed"):
            fixed_pool.supervise_worker(worker, lambda: fixed_pool.current_run_state(RunDir(run_dir), config_path), poll_s=0.1, grace_s=1)
        assert worker.wait(10) == -signal.SIGTERM  # stopped by the step (it sleeps 600 s by itself), not left running
    finally:
        if worker.poll() is None:
            worker.kill()


# ---------------------------------------------------------------- defect 6: deadline, owner, per-attempt names


def test_job_gets_the_deadline_owner_and_a_per_attempt_name_with_a_stand_in_backend(pipeline_run, monkeypatch):
    run_dir, config_path = pipeline_run
    names = []
    for uid in ("6f1c2a9e-0000-4000-8000-000000000001", "a93b7d10-0000-4000-8000-000000000002"):
        monkeypatch.setenv("TIDAL_POD_NAME", "tidal-grpo-xyz-train-123")
        monkeypatch.setenv("TIDAL_POD_UID", uid)
        backend = StandInBackend()
        trainer_launch.train_round(run_dir, config_path, 3, 2, PLACEMENT, job_backend=backend)
        (spec,) = backend.specs
        manifest = pytorchjob_to_dict(build_pytorchjob(spec))
        assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 3600
        assert backend.calls[-1] == ("wait", spec.name, 3600 + trainer_launch.DEADLINE_MARGIN_S)
        (owner,) = manifest["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "tidal-grpo-xyz-train-123",
            "uid": uid,
            "controller": False,
            "blockOwnerDeletion": False,
        }
        assert manifest["metadata"]["namespace"] == "team-a"
        names.append(spec.name)
    assert names[0] != names[1] and all(n.startswith("tidal-job-7-r003-") for n in names)  # a KFP retry gets a new job
    assert run_state.read_run_state(RunDir(run_dir), config_path) == "running"  # success leaves the state to the trainer


def test_job_names_are_unique_per_attempt_and_leave_room_for_service_names():
    long_run = "3F2A_very-long-pipeline-job-id-" + "x" * 80
    name = trainer_launch.trainer_job_name(long_run, 12, "a93b7")
    assert len(name) <= trainer_launch.MAX_JOB_NAME and name.endswith("-r012-a93b7")
    assert len(f"{name}-worker-999") <= 63  # the operator's per-replica Service names are DNS-1035 labels
    random_names = {trainer_launch.trainer_job_name("run", 0, trainer_launch.attempt_suffix(None)) for _ in range(5)}
    assert len(random_names) == 5  # no downward API: a random suffix per attempt
    check_pytorchjob(pytorchjob_to_dict(build_pytorchjob(_spec(name=name))))


def test_train_step_gets_its_pod_name_and_uid_from_the_downward_api(tmp_path):
    from tidal.kube.pipeline.definition import compile_pipeline

    path = compile_pipeline(tmp_path / "p.yaml", "nvidia")
    spec, platform = yaml.safe_load_all(path.read_text())
    fields = {e["name"]: e["fieldPath"] for e in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]["fieldPathAsEnv"]}
    assert fields == {"TIDAL_POD_NAME": "metadata.name", "TIDAL_POD_UID": "metadata.uid"}
    assert set(trainer_launch.POD_NAME_ENV) >= {"TIDAL_POD_NAME"} and set(trainer_launch.POD_UID_ENV) >= {"TIDAL_POD_UID"}
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["trainer_deadline_s"]["defaultValue"] == 24 * 3600
    assert parameters["trainer_start_timeout_s"]["defaultValue"] == 3600


def test_trainer_requests_come_from_pipeline_parameters_with_a_stand_in_backend(pipeline_run):
    run_dir, config_path = pipeline_run
    backend = StandInBackend()
    placement = trainer_launch.TrainerPlacement(backend="pytorchjob", accelerator="nvidia", namespace="team-a", cpu="30", memory="200Gi")
    trainer_launch.train_round(run_dir, config_path, 0, 2, placement, job_backend=backend)
    manifest = pytorchjob_to_dict(build_pytorchjob(backend.specs[0]))
    requests = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert (requests["cpu"], requests["memory"]) == ("30", "200Gi")
    assert "activeDeadlineSeconds" not in manifest["spec"]["runPolicy"]  # deadline_s 0: none


# ---------------------------------------------------------------- defect 7: Istio


def _spec(**extra):
    base = dict(
        name="tidal-demo-r3", config_path="/mnt/tidal/runs/demo/config.yaml", run_dir="/mnt/tidal/runs/demo", profile=cluster.PROFILES["nvidia"]
    )
    return TrainerJobSpec(**{**base, "nodes": 3, **extra})


def test_trainer_pods_opt_out_of_istio_sidecar_injection():
    manifest = pytorchjob_to_dict(build_pytorchjob(_spec()))
    for replica in ("Master", "Worker"):
        annotations = manifest["spec"]["pytorchReplicaSpecs"][replica]["template"]["metadata"]["annotations"]
        assert annotations["sidecar.istio.io/inject"] == "false"


# ---------------------------------------------------------------- defect 12: finalize, the exit handler


class ApiError(Exception):
    """What the kubernetes client raises: an HTTP status on the exception."""

    def __init__(self, status: int):
        super().__init__(f"({status})")
        self.status = status


class StandInJobApi:
    """Stands for the API server's PyTorchJob endpoint: the jobs that still exist; delete answers 404 for others,
    and 403 for every job when ``forbidden`` (RBAC without delete)."""

    def __init__(self, existing: set[str], forbidden: bool = False):
        self.existing, self.forbidden, self.deleted = set(existing), forbidden, []

    def delete(self, name, namespace):
        try:  # TrainingClient wraps the ApiException in a RuntimeError, as here
            if self.forbidden:
                raise ApiError(403)
            if name not in self.existing:
                raise ApiError(404)
        except ApiError:
            raise RuntimeError(f"Failed to delete PyTorchJob: {namespace}/{name}")  # noqa: B904 (the SDK's way: __context__ only)
        self.existing.discard(name)
        self.deleted.append((namespace, name))


@pytest.fixture
def prepared_run(pipeline_run, tmp_path, monkeypatch):
    """``pipeline_run`` with the MLflow parent run that prepare opens (in a sqlite store)."""
    run_dir, config_path = pipeline_run
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    parent_run_id = parent_run.open_parent_run(RunDir(run_dir), config_path).run_id
    return run_dir, config_path, parent_run_id


@pytest.fixture
def finished_pipeline_run(prepared_run):
    """A run as the rounds leave it: streams and KV bucket, an open MLflow parent run, two recorded trainer jobs."""
    run_dir, config_path, parent_run_id = prepared_run
    trainer_launch.record_trainer_job(RunDir(run_dir), "team-a", "tidal-run-7-r000-aaaaa", 0)  # finished and deleted by its TTL
    trainer_launch.record_trainer_job(RunDir(run_dir), "team-a", "tidal-run-7-r001-bbbbb", 1)  # orphaned: its launcher pod was killed
    return run_dir, config_path, parent_run_id


def stream_names_on_server(run_dir, config_path) -> list[str]:
    import asyncio

    from tidal.config import load_config
    from tidal.transport import stream_names

    async def names():
        import nats

        nc = await nats.connect(load_config(config_path).transport.nats_url)
        try:
            mine = set(stream_names(Path(run_dir).name).values())
            return sorted(s.config.name for s in await nc.jetstream().streams_info() if s.config.name.removeprefix("KV_") in mine)
        finally:
            await nc.close()

    return asyncio.run(names())


@pytest.mark.parametrize(("registered", "mlflow_status"), [(False, "FAILED"), (True, "FINISHED")])
def test_finalize_deletes_streams_kv_and_leftover_jobs_and_ends_the_mlflow_run_with_a_stand_in_api_server(
    finished_pipeline_run, registered, mlflow_status
):
    from mlflow.tracking import MlflowClient

    run_dir, config_path, parent_run_id = finished_pipeline_run
    if registered:  # register_model, the run's last step, got to the end
        records = StepRecords(RunDir(run_dir))
        records.write(records.registered, {"version": "1"})
    assert len(stream_names_on_server(run_dir, config_path)) == 3  # WORK, ROLLOUTS, the KV bucket's stream
    api = StandInJobApi(existing={"tidal-run-7-r001-bbbbb"})
    done = run_end.finalize_run(run_dir, "", job_backend=api)
    assert api.deleted == [("team-a", "tidal-run-7-r001-bbbbb")]  # the one already gone (404) is no error
    assert stream_names_on_server(run_dir, config_path) == []
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(parent_run_id).info.status == mlflow_status
    assert any(line.startswith("deleted KV bucket") for line in done)
    assert Path(config_path).is_file()  # the run directory (config, weights, checkpoints) is the run's result: untouched
    again = run_end.finalize_run(run_dir, "", job_backend=api)  # a retried finalize
    assert not [line for line in again if line.startswith("deleted")]


def test_finalize_does_every_part_and_then_fails_naming_the_one_that_failed_with_a_stand_in_api_server(finished_pipeline_run):
    from mlflow.tracking import MlflowClient

    run_dir, config_path, parent_run_id = finished_pipeline_run
    with pytest.raises(PipelineStepError, match="deleting trainer jobs: RuntimeError: Failed to delete PyTorchJob"):
        run_end.finalize_run(run_dir, "", job_backend=StandInJobApi(existing={"tidal-run-7-r001-bbbbb"}, forbidden=True))
    assert stream_names_on_server(run_dir, config_path) == []
    assert MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_run(parent_run_id).info.status == "FAILED"


def test_finalize_after_a_prepare_that_created_nothing_succeeds(tmp_path):
    run_dir = tmp_path / "runs" / "job-1"
    run_dir.mkdir(parents=True)
    assert run_end.finalize_run(str(run_dir), "") == []


def test_the_launcher_records_each_job_before_creating_it_with_a_stand_in_backend(pipeline_run):
    run_dir, config_path = pipeline_run
    backend = StandInBackend(fail_at="submit")
    with pytest.raises(RuntimeError):
        trainer_launch.train_round(run_dir, config_path, 2, 1, PLACEMENT, job_backend=backend)
    assert trainer_launch.recorded_trainer_jobs(RunDir(run_dir)) == [("team-a", backend.specs[0].name)]


# ---------------------------------------------------------------- defect 13: one round at a time


def test_rounds_take_the_lease_in_order_and_a_retried_step_is_let_through(prepared_run):
    run_dir, config_path, _ = prepared_run
    assert run_state.reset_rounds(RunDir(run_dir), config_path, "job-a") is None
    rounds.open_round(run_dir, config_path, 0, "job-a")
    rounds.open_round(run_dir, config_path, 0, "job-a")  # a KFP retry of open_round
    with pytest.raises(PipelineStepError, match=r"round 1 cannot start: round 0 of this run is open\. .*KFP backends honour from 2\.4\.0"):
        rounds.open_round(run_dir, config_path, 1, "job-a")
    run_state.end_round(RunDir(run_dir), config_path, "job-a", 0)
    run_state.end_round(RunDir(run_dir), config_path, "job-a", 0)  # a KFP retry of evaluate
    rounds.open_round(run_dir, config_path, 1, "job-a")
    with pytest.raises(PipelineStepError, match="round 3 cannot start: round 1 of this run is open"):
        rounds.open_round(run_dir, config_path, 3, "job-a")
    assert run_state.read_run_state(RunDir(run_dir), config_path) == "running"


def test_rounds_started_all_at_once_as_by_an_old_kfp_backend_leave_one_running_and_fail_the_others_clearly(prepared_run):
    """KFP backends before 2.4.0 ignore parallelism=1 on the rounds loop: every round's open_round runs at once.
    Exactly one round (0) may go on; each other fails before its trainer or workers touch the run directory."""
    from concurrent.futures import ThreadPoolExecutor

    run_dir, config_path, _ = prepared_run
    run_state.reset_rounds(RunDir(run_dir), config_path, "job-b")

    def start(round_index):
        try:
            rounds.open_round(run_dir, config_path, round_index, "job-b")
            return "started"
        except PipelineStepError as err:
            return str(err)

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(start, range(4)))
    assert outcomes[0] == "started"
    assert all("kubeflow/pipelines#10798" in outcome for outcome in outcomes[1:]), outcomes


def test_a_second_pipeline_run_on_the_same_run_directory_stops_the_first_at_its_next_round(prepared_run):
    run_dir, config_path, _ = prepared_run
    run_state.reset_rounds(RunDir(run_dir), config_path, "job-old")
    rounds.open_round(run_dir, config_path, 0, "job-old")
    warning = run_state.reset_rounds(RunDir(run_dir), config_path, "job-new")  # another run's prepare on the same run_dir
    assert warning and "pipeline run job-old had round 0 of this run directory open" in warning
    with pytest.raises(run_state.RoundSequenceError, match="pipeline run job-new has since taken over this run directory"):
        run_state.end_round(RunDir(run_dir), config_path, "job-old", 0)
    rounds.open_round(run_dir, config_path, 0, "job-new")

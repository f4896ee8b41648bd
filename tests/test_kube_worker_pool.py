"""worker_pool=elastic: the run's rollout-worker Deployment and KEDA ScaledObject (checked against KEDA's CRD and
Kubernetes' own schema, created strictly on a stand-in API server, deleted by finalize), the pool pod's entry and
the fixed pool's step passing SIGTERM on to a real worker process, and the pipeline's pool parameters."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s

from tests.crd_schema import load_crd, schema_errors
from tests.stand_in_api import StandInApi
from tests.test_kube_nats_auth import RUN, running_round, server  # noqa: F401 (fixtures)
from tests.test_kube_pipeline import FakeKfpApi, kfp_api_server  # noqa: F401 (a fixture)
from tidal.kube import cluster
from tidal.kube.pool import elastic, elastic_step, pod_entry
from tidal.kube.pool import fixed as fixed_pool
from tidal.kube.pool.rollout_process import SigtermForward, forward_sigterm
from tidal.kube.steps import run_end, run_start, staging
from tidal.kube.steps.records import PipelineStepError
from tidal.kube.steps.staging import PoolSettings
from tidal.rundir import RunDir

KEDA_CRDS = ["keda-v2.16.1-scaledobjects.json", "keda-v2.18.3-scaledobjects.json"]
NATS_JETSTREAM_SCALER_METADATA = {
    "natsServerMonitoringEndpoint",
    "account",
    "accountID",
    "stream",
    "consumer",
    "lagThreshold",
    "activationLagThreshold",
    "useHttps",
}
"""The trigger metadata kedacore/keda's pkg/scalers/nats_jetstream_scaler.go reads (v2.16.1: parseNATSJetStreamMetadata;
v2.18.3: the natsJetStreamMetadata struct's ``keda:"name=..."`` tags; accountID is v2.18's alternative to account)."""
SCALER_REQUIRED = {"natsServerMonitoringEndpoint", "account", "stream", "consumer"}
WORKFLOW = elastic.OwnerRef(api_version="argoproj.io/v1alpha1", kind="Workflow", name="tidal-grpo-x7k2p", uid="0b9c3e8e-5d2a-4e53-9a57-1c0f3b7a2d11")


def pool_spec(**changes) -> elastic.PoolSpec:
    values = dict(
        name=elastic.pool_name("8f1d2c3a-run"),
        namespace="team-a",
        run_label="8f1d2c3a-run",
        config_path="/mnt/tidal/runs/8f1d2c3a-run/config.yaml",
        run_dir="/mnt/tidal/runs/8f1d2c3a-run",
        stream="TIDAL_8f1d2c3a-run_WORK",
        profile=cluster.PROFILES["nvidia"],
        image=cluster.PROFILES["nvidia"].image,
        min_workers=1,
        max_workers=4,
        lag_threshold=8,
        node_selector={"cloud.google.com/gke-spot": "true"},
        preferred_nodes={"cloud.google.com/gke-provisioning": "spot", "topology.kubernetes.io/zone": "us-central1-a"},
        tolerations=(cluster.Toleration(key="cloud.google.com/gke-spot"),),
        owner=WORKFLOW,
    )
    values.update(changes)
    return elastic.PoolSpec(**values)


# ---------------------------------------------------------------- the objects


@pytest.mark.parametrize("crd", KEDA_CRDS)
def test_the_scaled_object_is_admitted_by_kedas_crd(crd):
    assert schema_errors(elastic.build_scaled_object(pool_spec()), load_crd(crd)) == []


def test_an_unknown_field_in_the_scaled_object_is_an_error():
    scaled = elastic.build_scaled_object(pool_spec())
    scaled["spec"]["maxReplicas"] = 4
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 8  # trigger metadata is a map of strings
    assert schema_errors(scaled, load_crd(KEDA_CRDS[-1])) == [
        "spec.maxReplicas: unknown field",
        "spec.triggers[0].metadata.lagThreshold: 8 is not of type 'string'",
    ]


def test_the_trigger_reads_the_work_streams_workers_consumer_with_the_names_kedas_scaler_knows():
    spec = pool_spec()
    (trigger,) = elastic.build_scaled_object(spec)["spec"]["triggers"]
    metadata = trigger["metadata"]
    assert trigger["type"] == "nats-jetstream"
    assert SCALER_REQUIRED <= set(metadata) <= NATS_JETSTREAM_SCALER_METADATA
    assert metadata["stream"] == spec.stream and metadata["consumer"] == "workers"  # tidal.transport.streams.WORKERS_CONSUMER
    assert metadata["natsServerMonitoringEndpoint"] == f"tidal-nats.team-a.svc:{elastic.NATS_MONITOR_PORT}"
    assert metadata["account"] == "$G" and int(metadata["lagThreshold"]) == 8


def test_the_scaled_object_sizes_the_pools_deployment_between_min_and_max():
    scaled = elastic.build_scaled_object(pool_spec(min_workers=0, max_workers=6))
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": pool_spec().name}
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 6)
    assert scaled["metadata"]["ownerReferences"] == elastic.build_deployment(pool_spec())["metadata"]["ownerReferences"]


def test_the_deployment_validates_strictly_against_kubernetes():
    deployment = elastic.build_deployment(pool_spec())
    kubernetes_validate.validate(deployment, cluster.KUBERNETES_VERSION, strict=True)  # raises if refused
    assert elastic.deployment_violations(deployment) == []


def test_the_deployment_is_owned_by_the_run_and_its_pods_are_workers_that_get_sigterm():
    spec = pool_spec()
    deployment = elastic.build_deployment(spec)
    assert deployment["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "name": WORKFLOW.name,
            "uid": WORKFLOW.uid,
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][elastic.POOL_LABEL] == spec.name == deployment["spec"]["selector"]["matchLabels"][elastic.POOL_LABEL]
    assert cluster.TIDAL_POD_LABEL.items() <= template["metadata"]["labels"].items()  # the NetworkPolicy lets it reach NATS
    pod = template["spec"]
    assert pod["terminationGracePeriodSeconds"] == staging.DEFAULT_TERMINATION_GRACE_S
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == cluster.WORKLOAD_SERVICE_ACCOUNT
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu", "cloud.google.com/gke-spot"}
    (preferred,) = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["weight"] == 100 and preferred["preference"]["matchExpressions"] == [
        {"key": "cloud.google.com/gke-provisioning", "operator": "In", "values": ["spot"]},
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-central1-a"]},
    ]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["nodeAffinity"]  # other nodes stay allowed
    assert "affinity" not in elastic.build_deployment(pool_spec(preferred_nodes={}))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # no shell in between: the pool worker is the container's first process, and the pod's SIGTERM is its
    assert container["command"][:3] == ["python3", "-m", "tidal.kube.pool.pod_entry"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[cluster.NATS_USER_ENV]["value"] == cluster.nats_user("worker")
    assert env[cluster.NATS_PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == {"name": cluster.NATS_SECRET, "key": "worker-password", "optional": False}
    # the public key only, as a file: a worker checks snapshots, it cannot sign one; nor does it log to MLflow
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[cluster.WEIGHTS_PUBLIC_MOUNT_PATH] == "weights-public" and cluster.WEIGHTS_SIGNING_MOUNT_PATH not in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights-public"]["configMap"] == {"name": cluster.WEIGHTS_PUBLIC_CONFIG_MAP, "optional": False}
    assert not [v for v in pod["volumes"] if "secret" in v]
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {cluster.NATS_SECRET, cluster.REWARD_SECRET}
    assert not [e for e in container["env"] if "configMapKeyRef" in e.get("valueFrom", {})]
    assert not [name for name in env if name.startswith("MLFLOW_")]


def test_a_queued_pool_carries_kueues_label_on_the_deployment_itself_and_on_its_pods():
    queued = elastic.build_deployment(pool_spec(queue_name="team-a-queue"))
    assert queued["metadata"]["labels"][cluster.QUEUE_LABEL] == "team-a-queue"  # Kueue's Deployment integration reads this
    assert queued["spec"]["template"]["metadata"]["labels"][cluster.QUEUE_LABEL] == "team-a-queue"
    assert cluster.QUEUE_LABEL not in elastic.build_scaled_object(pool_spec(queue_name="team-a-queue"))["metadata"]["labels"]
    plain = elastic.build_deployment(pool_spec())
    assert cluster.QUEUE_LABEL not in plain["metadata"]["labels"] and cluster.QUEUE_LABEL not in plain["spec"]["template"]["metadata"]["labels"]


def test_deployment_checks_catch_what_the_api_server_refuses():
    deployment = elastic.build_deployment(pool_spec())
    broken = copy.deepcopy(deployment)
    broken["spec"]["selector"]["matchLabels"][elastic.POOL_LABEL] = "another-pool"
    broken["metadata"]["ownerReferences"][0]["uid"] = ""
    broken["metadata"]["ownerReferences"].append({**deployment["metadata"]["ownerReferences"][0], "controller": True, "name": "a"})
    broken["metadata"]["ownerReferences"].append({**deployment["metadata"]["ownerReferences"][0], "controller": True, "name": "b"})
    assert elastic.deployment_violations(broken) == [
        "spec.template.metadata.labels: must match spec.selector",
        "metadata.ownerReferences[0]: uid required",
        "metadata.ownerReferences: at most one controller",
    ]


@pytest.mark.parametrize("run_name", ["demo", "My Run " + "x-" * 40, "8f1d2c3a-5e6f-4a1b-9c0d-123456789abc"])
def test_pool_names_are_dns_labels_unique_per_run_and_leave_room_for_pod_names(run_name):
    name = elastic.pool_name(run_name)
    assert elastic.name_violations({"name": name}) == []
    assert len(name) <= elastic.MAX_POOL_NAME and len(name) + len("-7d9f8c6b5d-x2k4q") <= 63
    assert name != elastic.pool_name(run_name + "2")


def test_pool_sizes_default_from_the_run_and_refuse_bad_bounds():
    for prompts in (1, 5, 6, 32, 100):
        for workers in (1, 3, 4, 8):
            minimum, maximum, lag = elastic.pool_sizes(1, 0, 0, rollout_workers=workers, prompts_per_iteration=prompts)
            assert (minimum, maximum) == (1, workers)  # the run's workers are the pool's maximum
            # at its maximum the pool covers a whole iteration's items within the threshold, and no smaller threshold would
            assert maximum * lag >= prompts and (lag == 1 or maximum * (lag - 1) < prompts), (prompts, workers, lag)
    assert elastic.pool_sizes(0, 8, 5, rollout_workers=3, prompts_per_iteration=32) == (0, 8, 5)
    with pytest.raises(PipelineStepError, match=r"pool_min_workers \(5\) and pool_max_workers \(2\)"):
        elastic.pool_sizes(5, 2, 0, rollout_workers=3, prompts_per_iteration=32)
    with pytest.raises(PipelineStepError, match="pool_node_selector: 'spot' must look like label=value"):
        elastic.parse_node_selector("spot")
    assert elastic.parse_node_selector("a=1, b/c=2") == {"a": "1", "b/c": "2"}
    with pytest.raises(PipelineStepError, match="pool_preferred_nodes: 'spot' must look like label=value"):
        elastic.parse_node_selector("spot", "pool_preferred_nodes")


# ---------------------------------------------------------------- on a stand-in API server


POD_PATH = "/api/v1/namespaces/team-a/pods/tidal-grpo-x7k2p-worker-pool-123"
STEP_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "tidal-grpo-x7k2p-worker-pool-123",
        "namespace": "team-a",
        "ownerReferences": [
            {
                "apiVersion": WORKFLOW.api_version,
                "kind": WORKFLOW.kind,
                "name": WORKFLOW.name,
                "uid": WORKFLOW.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    },
}
KEDA_CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{elastic.KEDA_CRD}"
DEPLOYMENTS = "/apis/apps/v1/namespaces/team-a/deployments"
SCALED_OBJECTS = "/apis/keda.sh/v1alpha1/namespaces/team-a/scaledobjects"


@pytest.fixture
def staged_run(tmp_path, write_config):
    run = RunDir(tmp_path / "8f1d2c3a-run")
    run.root.mkdir()
    config = write_config({"rollout": {"group_size": 4, "max_new_tokens": 8, "groups_per_batch": 2, "workers": 3}})
    return run, str(config)


SCALE_TO_ZERO = PoolSettings(min_workers=0, max_workers=0)


def start_pool(api, run, config_path, monkeypatch, settings=SCALE_TO_ZERO):
    monkeypatch.setenv("TIDAL_POD_NAME", STEP_POD["metadata"]["name"])
    return elastic_step.start_worker_pool(
        worker_pool="elastic",
        run_dir=str(run.root),
        config_path=config_path,
        namespace="team-a",
        accelerator="nvidia",
        image="",
        accelerators=1,
        cpu="8",
        memory="32Gi",
        settings=settings,
        api_client=api.api_client(),
    )


@pytest.mark.parametrize("crd", KEDA_CRDS)
def test_the_pool_step_creates_both_objects_strictly_owned_by_the_run_and_finalize_deletes_them_with_a_stand_in_api(crd, staged_run, monkeypatch):
    run, config_path = staged_run
    with StandInApi([load_crd(crd)], {POD_PATH: STEP_POD}, refuse_duplicates=True) as api:
        done = start_pool(api, run, config_path, monkeypatch)
        assert [path for path, _, _ in api.created] == [DEPLOYMENTS, SCALED_OBJECTS]
        assert all(query.get("fieldValidation") == "Strict" for _, query, _ in api.created)
        deployment, scaled = (body for _, _, body in api.created)
        assert deployment["metadata"]["ownerReferences"][0]["uid"] == scaled["metadata"]["ownerReferences"][0]["uid"] == WORKFLOW.uid
        # the run's config: rollout.workers 3 is the maximum; at it, the pool covers an iteration's 6 prompts
        assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 3)
        assert 3 * int(scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"]) >= 6
        assert scaled["spec"]["triggers"][0]["metadata"]["stream"] == "TIDAL_8f1d2c3a-run_WORK"
        assert done[-1] == "pool of 0 to 3 rollout workers, one more per 2 pending work items of TIDAL_8f1d2c3a-run_WORK"
        # a retried step finds both there and keeps them
        again = start_pool(api, run, config_path, monkeypatch)
        assert len(api.created) == 2 and "already there" in again[0] and "already there" in again[1]
        lines = run_end.delete_worker_pool(run, api.api_client())
        assert api.deleted == [f"{SCALED_OBJECTS}/{deployment['metadata']['name']}", f"{DEPLOYMENTS}/{deployment['metadata']['name']}"]
        assert lines == [
            f"deleted ScaledObject team-a/{deployment['metadata']['name']}",
            f"deleted Deployment team-a/{deployment['metadata']['name']}",
        ]
        assert run_end.delete_worker_pool(run, api.api_client()) == []  # gone already: nothing to do, no error


def test_a_deployment_with_an_unknown_field_is_refused_by_strict_validation_on_a_stand_in_api():
    deployment = elastic.build_deployment(pool_spec(namespace="team-a"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with StandInApi() as api:
        apps = k8s.AppsV1Api(api.api_client())
        with pytest.raises(k8s.ApiException, match="terminationGracePeriod"):
            apps.create_namespaced_deployment("team-a", deployment, field_validation=elastic.STRICT)
    assert api.created == []


def test_without_keda_the_pool_step_creates_nothing_and_says_what_to_install_with_a_stand_in_api(staged_run, monkeypatch):
    run, config_path = staged_run
    with StandInApi([], {POD_PATH: STEP_POD}) as api:
        with pytest.raises(elastic.KedaNotInstalled) as refused:
            start_pool(api, run, config_path, monkeypatch)
    message = str(refused.value)
    assert "\n" not in message and f"KEDA >= {elastic.KEDA_MIN_VERSION}" in message and elastic.KEDA_CRD in message
    assert api.created == []


def test_a_fixed_pool_creates_nothing(staged_run):
    run, config_path = staged_run
    done = elastic_step.start_worker_pool(
        "fixed", str(run.root), config_path, "team-a", "nvidia", "", 1, "8", "32Gi", PoolSettings(), api_client=object()
    )
    assert done == [] and not elastic.pool_record(run).exists()
    with pytest.raises(PipelineStepError, match="worker_pool must be one of fixed, elastic, got 'elastc'"):
        elastic_step.start_worker_pool("elastc", str(run.root), config_path, "team-a", "nvidia", "", 1, "8", "32Gi", PoolSettings())


def test_finalize_deletes_the_pool_too_with_a_stand_in_api(staged_run, monkeypatch):
    run, config_path = staged_run
    with StandInApi([load_crd(KEDA_CRDS[-1])], {POD_PATH: STEP_POD}) as api:
        start_pool(api, run, config_path, monkeypatch)
        try:
            run_end.finalize_run(str(run.root), "", pool_api_client=api.api_client())
        except PipelineStepError as err:  # another part (no MLflow parent run here) may fail: the pool goes anyway
            assert "deleting the worker pool" not in str(err)
        assert [path.rsplit("/", 2)[-2] for path in api.deleted] == ["scaledobjects", "deployments"]


# ---------------------------------------------------------------- lanes and NCCL


def test_an_elastic_pool_leaves_the_trainer_alone_in_each_rounds_lanes():
    assert run_start.worker_lanes(3, "fixed") == ["trainer", "rollout-0", "rollout-1", "rollout-2"]
    assert run_start.worker_lanes(3, "elastic") == ["trainer"]
    with pytest.raises(PipelineStepError, match="worker_pool must be one of fixed, elastic"):
        run_start.worker_lanes(3, "autoscaled")


def test_an_elastic_pool_turns_the_nccl_transfer_off_in_one_line(tmp_path, tiny_config_dict, capsys):
    config = copy.deepcopy(tiny_config_dict)
    config["rollout"] |= {"engine": "vllm", "vllm": {"weight_sync": "nccl"}}
    config_yaml = yaml.safe_dump(config)
    for pool, expected in (("fixed", "nccl"), ("elastic", "store")):
        run = RunDir(tmp_path / pool)
        staged = staging.stage_for_pool(run, config_yaml, "", [], pool)
        assert yaml.safe_load(Path(staged).read_text())["rollout"]["vllm"]["weight_sync"] == expected
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {staging.ELASTIC_NCCL_OFF}"]


# ---------------------------------------------------------------- SIGTERM reaches the worker process

FAKE_WORKER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])

    def stop(signum, frame):
        out.write_text(out.read_text() + "SIGTERM\\n")
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    out.write_text("ready\\n")
    if sys.argv[2] == "exit":
        sys.exit(0)
    time.sleep(600)
    """
)


def said_ready(out: Path) -> bool:
    """The fake worker wrote "ready" (not just created the file: a SIGTERM between the two would lose the line)."""
    return out.is_file() and out.read_text().startswith("ready")


def fake_worker(out: Path, mode: str = "wait") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FAKE_WORKER, str(out), mode], process_group=0)


def sigterm_self_when(condition) -> threading.Thread:
    """SIGTERM to this process (what the kubelet sends the container's first process) once ``condition()`` holds."""

    def send():
        deadline = time.monotonic() + 120
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_the_fixed_pools_step_passes_sigterm_on_to_its_worker(tmp_path):
    out = tmp_path / "worker.log"
    process = fake_worker(out)
    sender = sigterm_self_when(lambda: said_ready(out))
    try:
        with forward_sigterm(process) as sigterm:
            with pytest.raises(PipelineStepError, match=r"this pod got SIGTERM; the rollout worker stopped in order \(status 143\)"):
                fixed_pool.supervise_worker(process, lambda: "running", poll_s=0.2, terminated=lambda: sigterm.received)
    finally:
        sender.join()
        if process.poll() is None:
            process.kill()
        process.wait()
    assert out.read_text() == "ready\nSIGTERM\n"


def test_the_pool_worker_waits_between_rounds_starts_a_worker_per_round_and_passes_sigterm_on(tmp_path):
    """Round 1's worker ends with its round, the pod waits (no exit: the Deployment would restart it), round 2's
    worker starts and gets the pod's SIGTERM; the pod exits with the worker's status."""
    states = iter(["round_done", "running", "running", "round_done", "round_done", "running"])
    last = ["round_done"]

    def current_state():
        last[0] = next(states, "running")
        return last[0]

    started = []

    def start():
        out = tmp_path / f"worker-{len(started)}.log"
        started.append(out)
        return fake_worker(out, "exit" if len(started) == 1 else "wait")

    sigterm = SigtermForward()
    sender = sigterm_self_when(lambda: len(started) == 2 and said_ready(started[1]))
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(sigterm, "received", True))
    try:
        code = pod_entry.serve(current_state, start, sigterm, poll_s=0.1, end_grace_s=5.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join()
    assert code == 143
    assert [out.read_text() for out in started] == ["ready\n", "ready\nSIGTERM\n"]


def test_a_pool_pod_without_its_name_says_what_sets_it():
    with pytest.raises(SystemExit, match="POD_NAME is not set: the pool's Deployment sets it from the pod's metadata.name"):
        pod_entry.pool_worker_id("")
    assert pod_entry.pool_worker_id("tidal-pool-demo-1a2b3c-7d9f8c6b5d-x2k4q") == "tidal-pool-demo-1a2b3c-7d9f8c6b5d-x2k4q"


# ---------------------------------------------------------------- the pipeline


def test_the_pipeline_has_the_pool_parameters_with_defaults_and_the_rounds_wait_for_the_pool(tmp_path):
    from tidal.kube.pipeline.definition import compile_pipeline

    spec, platform = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", "nvidia").read_text())
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["worker_pool"]["defaultValue"] == "fixed"
    assert {name: parameters[name]["defaultValue"] for name in ("pool_min_workers", "pool_max_workers", "pool_lag_threshold")} == {
        "pool_min_workers": 1,
        "pool_max_workers": 0,
        "pool_lag_threshold": 0,
    }
    assert parameters["pool_termination_grace_s"]["defaultValue"] == staging.DEFAULT_TERMINATION_GRACE_S
    (guarded,) = [name for name in spec["root"]["dag"]["tasks"] if name != "finalize"]
    inside = spec["components"][spec["root"]["dag"]["tasks"][guarded]["componentRef"]["name"]]["dag"]["tasks"]
    assert inside["worker-pool"]["dependentTasks"] == ["prepare"]
    assert "worker-pool" in inside["tidal-grpo-loop"]["dependentTasks"]
    assert inside["prepare"]["inputs"]["parameters"]["worker_pool"] == {"componentInputParameter": "pipelinechannel--worker_pool"}
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-worker-pool"]
    assert {e["name"]: e["fieldPath"] for e in executor["fieldPathAsEnv"]} == {"TIDAL_POD_NAME": "metadata.name"}


# ---------------------------------------------------------------- a pool pod's entry with a real worker and NATS

POD_NAME = "tidal-pool-run-9-1a2b3c-7d9f8c6b5d-x2k4q"


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the pool worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_pool_pod_runs_a_real_worker_per_round_waits_between_rounds_and_passes_sigterm_on(tmp_path, nats_server, tiny_config_dict):
    """``python3 -m tidal.kube.pool.pod_entry`` as the container would run it (POD_NAME from the downward API): round 0's
    worker heartbeats under the pod's name, ends with its round while the pod stays, round 1 gets a new worker
    process under the same id, and the pod's SIGTERM stops that worker in order (status 143, the worker's)."""
    from tidal.config import load_config
    from tidal.kube.steps import run_state
    from tidal.protocol import KVKey
    from tidal.transport import RunNats, run_in_session

    config_path = tmp_path / "runs" / "run-9" / "config.yaml"
    config_path.parent.mkdir(parents=True)
    config_path.write_text(yaml.safe_dump(dict(tiny_config_dict, transport={"nats_url": nats_server.url})))
    run, cfg = RunDir(config_path.parent), load_config(config_path)
    run_start.prepare_run(run, str(config_path), f"sqlite:///{tmp_path / 'mlflow.db'}", "")
    run_state.open_round(run, str(config_path), 0)

    def heartbeat():
        return run_in_session(nats_server.url, run.run_id, cfg.transport, lambda t: t.get(KVKey.worker(POD_NAME)))

    log = tmp_path / "pod.log"
    command = [sys.executable, "-m", "tidal.kube.pool.pod_entry", "--config", str(config_path), "--run-dir", str(run.root)]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "POD_NAME": POD_NAME})
    try:
        wait_for(lambda: heartbeat() is not None, proc, log)
        first = heartbeat()["incarnation"]
        RunNats(run, nats_server.url, cfg.transport).record_run_state("round_done")
        wait_for(lambda: "the rollout worker ended with its round; waiting for the next one" in log.read_text(), proc, log)
        assert proc.poll() is None  # between rounds the pod waits: exiting would make the Deployment restart it
        run_state.open_round(run, str(config_path), 1)
        wait_for(lambda: heartbeat()["incarnation"] != first, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "passing it on to the rollout worker" in text and "rollout worker stopped by SIGTERM" in text
    assert text.count("rollout-worker " + str(config_path)) == 2  # one worker process per round


ELASTIC_PARAMS = {
    "worker_pool": "elastic",
    "pool_min_workers": 0,
    "pool_max_workers": 8,
    "pool_lag_threshold": 4,
    "pool_node_selector": "cloud.google.com/gke-spot=true",
    "pool_preferred_nodes": "topology.kubernetes.io/zone=us-central1-a",
    "pool_toleration_key": "cloud.google.com/gke-spot",
    "pool_termination_grace_s": 60,
}


@pytest.mark.parametrize("pool", ["fixed", "elastic"])
def test_submit_sends_the_pool_parameters_the_compiled_pipeline_declares_with_mocked_kfp_api_server(pool, kfp_api_server, monkeypatch):  # noqa: F811
    from tidal.kube.submit.client import submit_run

    monkeypatch.setenv("KFP_TOKEN", "t")
    params = ELASTIC_PARAMS if pool == "elastic" else {"worker_pool": "fixed"}
    submit_run(str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"), host=kfp_api_server, params=params)
    (create_run,) = [r for r in FakeKfpApi.requests if r[:2] == ("POST", "/apis/v2beta1/runs")]
    body = create_run[3]
    sent = body["runtime_config"]["parameters"]
    declared = body["pipeline_spec"]["pipeline_spec"]["root"]["inputDefinitions"]["parameters"]
    assert {name: sent[name] for name in params} == params and set(params) <= set(declared)


# ---------------------------------------------------------------- what KEDA's scaler reads, from a real nats-server


def keda_lag(jsz: dict, account: str, stream: str, consumer: str) -> int:
    """KEDA's nats_jetstream_scaler.go: the account's stream's consumer, ``num_pending + num_ack_pending``."""
    (details,) = [a for a in jsz["account_details"] if account in (a["name"], a["id"])]
    (found,) = [s for s in details["stream_detail"] if s["name"] == stream]
    (detail,) = [c for c in found["consumer_detail"] if c["name"] == consumer]
    return detail["num_pending"] + detail["num_ack_pending"]


def test_the_monitoring_endpoint_reports_the_work_streams_lag_where_kedas_scaler_looks(server, running_round):  # noqa: F811
    """The cluster's own nats.conf and auth.conf on a real nats-server, the trainer's two work items published: the
    URL KEDA builds from the trigger (``/jsz?acc=<account>&consumers=true&config=true``) shows them as lag."""
    import json
    import re
    import urllib.request

    from tidal.transport import stream_names

    http_port = re.search(r"(?m)^http_port: (\d+)$", (server.dir / "nats.conf").read_text()).group(1)
    spec = pool_spec(stream=stream_names(RUN)["work_stream"])
    (trigger,) = elastic.build_scaled_object(spec)["spec"]["triggers"]
    metadata = trigger["metadata"]
    url = f"http://127.0.0.1:{http_port}/jsz?acc={metadata['account']}&consumers=true&config=true"
    with urllib.request.urlopen(url, timeout=60) as answer:
        jsz = json.load(answer)
    assert keda_lag(jsz, metadata["account"], metadata["stream"], metadata["consumer"]) == 2


def test_a_negative_grace_period_is_refused_naming_the_parameter(staged_run):
    run, config_path = staged_run
    with pytest.raises(PipelineStepError, match=r"^pool_termination_grace_s must be 0 or more seconds, got -5$"):
        elastic_step.start_worker_pool(
            "elastic", str(run.root), config_path, "team-a", "nvidia", "", 1, "8", "32Gi", PoolSettings(termination_grace_s=-5), api_client=object()
        )
    assert not elastic.pool_record(run).exists()


def pool_pod_nats_env() -> dict:
    """The NATS env of the pool Deployment's container, as tests/test_kube_nats_auth.py's as_pod takes it."""
    (container,) = elastic.build_deployment(pool_spec())["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in container["env"]:
        if e["name"].startswith("NATS_"):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            env[e["name"]] = ("secret", ref["name"], ref["key"]) if ref else e["value"]
    return env


def test_a_pool_pod_pulls_work_and_heartbeats_under_its_name_as_the_worker_user_on_the_clusters_nats(server, running_round, monkeypatch):  # noqa: F811
    import asyncio

    from tests.test_kube_nats_auth import as_pod
    from tidal.protocol import decode_work_item
    from tidal.transport import Transport, permission_violations
    from tidal.transport.health import WorkerHealth

    as_pod(monkeypatch, server, pool_pod_nats_env())
    assert os.environ[cluster.NATS_USER_ENV] == cluster.nats_user("worker")

    async def pool_worker_part():
        t = await Transport.connect(server.url, RUN, running_round, create=False)
        msgs = await t.fetch(await t.work_subscription(), 2, timeout=2.0, linger=0.2)
        for m in msgs:
            await m.ack()
        await t.put_worker_health(WorkerHealth(POD_NAME).record())
        await asyncio.sleep(0.3)
        refused = permission_violations(t.nc)
        await t.close()
        return sorted(decode_work_item(m.data).prompt_id for m in msgs), refused

    assert asyncio.run(pool_worker_part()) == ([0, 1], [])


def test_a_sigterm_that_comes_while_a_worker_starts_still_reaches_it(tmp_path):
    out = tmp_path / "worker.log"
    sigterm = SigtermForward()
    started = []

    def start():
        sigterm.received = True  # what the pod's handler records when SIGTERM comes before the worker runs
        started.append(fake_worker(out))
        return started[-1]

    code = pod_entry.serve(lambda: "running", start, sigterm, poll_s=0.1, end_grace_s=5.0)
    assert code == 143  # the worker's handler ran, or SIGTERM's default action ended it (reported as 128 + 15)
    assert len(started) == 1 and started[0].returncode in (143, -signal.SIGTERM)

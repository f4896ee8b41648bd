"""The cluster NATS's per-role users, proven on a real nats-server.

The server runs the very ``nats.conf`` and ``auth.conf`` that ``kubectl kustomize`` renders into ConfigMap
``tidal-nats-config`` (only its port and store directory moved here), with the passwords in the environment
variables the StatefulSet maps from Secret ``tidal-nats``. Each client gets the NATS environment its pod gets
(the compiled pipeline's executors, the trainer job's containers) and runs Tidal's own transport code."""

import asyncio
import re
import secrets
import socket
import subprocess
import time

import numpy as np
import pytest
import yaml
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import BadRequestError

from tests.test_kube_manifests import build_overlay, by_kind
from tidal.config import TransportConfig
from tidal.kube import cluster
from tidal.kube.pipeline.definition import compile_pipeline
from tidal.kube.steps import run_start, run_state
from tidal.kube.trainer.shared import secret_env
from tidal.protocol import Group, KVKey, RunState, Sample, WorkItem, decode_group, decode_work_item
from tidal.rundir import RunDir
from tidal.transport import (
    WORKERS_CONSUMER,
    NatsPermissionError,
    NatsUnavailableError,
    Transport,
    delete_run,
    inbox_prefix,
    permission_violations,
    stream_names,
    weight_handshake,
)
from tidal.transport.health import WorkerHealth
from tidal.transport.server import TOKEN_ENV, free_port, nats_server_binary

RUN = "run-auth"


def rendered_server_files(overlay: str, tmp_path) -> tuple[dict[str, str], dict[str, str]]:
    """The overlay's ConfigMap files (port and store moved into ``tmp_path``) and the server's Secret-mapped env names."""
    objects = build_overlay(overlay)
    files = dict(by_kind(objects, "ConfigMap")["tidal-nats-config"]["data"])
    container = by_kind(objects, "StatefulSet")["tidal-nats"]["spec"]["template"]["spec"]["containers"][0]
    secret_env_of_server = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {}) and e["valueFrom"]["secretKeyRef"]["name"] == cluster.NATS_SECRET
    }
    conf = files["nats.conf"]
    for pattern, replacement in (
        (r"(?m)^port: 4222$", f"port: {free_port()}\nhost: 127.0.0.1"),
        (r"(?m)^http_port: 8222$", f"http_port: {free_port()}"),
        (r"store_dir: /data/jetstream", f"store_dir: {tmp_path / 'jetstream'}"),
    ):
        conf, count = re.subn(pattern, replacement, conf)
        assert count == 1, f"the manifest's nats.conf no longer has {pattern!r}"
    files["nats.conf"] = conf
    return files, secret_env_of_server


class ClusterNats:
    def __init__(self, tmp_path, overlay: str = "gpu"):
        self.dir = tmp_path / "etc-nats"
        self.dir.mkdir()
        files, server_env = rendered_server_files(overlay, tmp_path)
        for name, text in files.items():  # a ConfigMap volume: one file per key
            (self.dir / name).write_text(text)
        self.secret = {key: secrets.token_hex(12) for key in server_env.values()}  # what the operator creates
        env = {"POD_NAME": "tidal-nats-0", "PATH": "/usr/bin:/bin", **{name: self.secret[key] for name, key in server_env.items()}}
        self.port = int(re.search(r"(?m)^port: (\d+)$", files["nats.conf"]).group(1))
        self.log = tmp_path / "nats.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.dir / "nats.conf")], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 20
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline, self.log.read_text()
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def compiled_env(tmp_path_factory) -> dict[str, dict]:
    """Per executor of the compiled pipeline: its NATS env, values literal or ``("secret", name, key)``."""
    out = tmp_path_factory.mktemp("compiled")
    spec, platform = list(yaml.safe_load_all(compile_pipeline(out / "cpu.yaml", "cpu").read_text()))
    envs = {}
    for name, executor in spec["deploymentSpec"]["executors"].items():
        env = {e["name"]: e["value"] for e in executor["container"].get("env", [])}
        config = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].get(name, {})
        for s in config.get("secretAsEnv", []):
            env.update({k["envVar"]: ("secret", s["secretName"], k["secretKey"]) for k in s["keyToEnv"]})
        envs[name] = {k: v for k, v in env.items() if k.startswith("NATS_")}
    return envs


def trainer_job_env() -> dict:
    """The NATS env of a trainer job's containers (PyTorchJob replicas and TrainJob nodes share it)."""
    env = {}
    for e in secret_env():
        if e.name.startswith("NATS_"):
            ref = e.value_from.secret_key_ref if e.value_from else None
            env[e.name] = ("secret", ref.name, ref.key) if ref else e.value
    return env


@pytest.fixture
def server(tmp_path):
    nats = ClusterNats(tmp_path)
    yield nats
    nats.stop()


def as_pod(monkeypatch, server: ClusterNats, env: dict) -> None:
    """This process's environment becomes the pod's: NATS_USER literal, NATS_PASSWORD from the Secret."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv("NATS_TOKEN", raising=False)
    assert set(env) == {cluster.NATS_USER_ENV, cluster.NATS_PASSWORD_ENV}, env
    for name, value in env.items():
        if isinstance(value, tuple):
            _, secret, key = value
            assert secret == cluster.NATS_SECRET
            value = server.secret[key]  # a key the Secret lacks: KeyError, as the pod would not start
        monkeypatch.setenv(name, value)


def role_env(compiled_env, executor: str) -> dict:
    return compiled_env[executor]


def executor_of_role(compiled_env, role: str, among: tuple[str, ...]) -> str:
    (executor,) = [e for e in among if compiled_env[e].get(cluster.NATS_USER_ENV) == cluster.nats_user(role)]
    return executor


def test_every_nats_step_and_the_trainer_job_log_in_as_their_roles_user(compiled_env):
    users = {executor: env.get(cluster.NATS_USER_ENV) for executor, env in compiled_env.items()}
    assert users["exec-rollout-worker"] == "tidal-worker"
    for executor in ("exec-prepare", "exec-open-round", "exec-evaluate", "exec-finalize"):
        assert users[executor] == "tidal-control", executor
    assert sorted([users["exec-train"], users["exec-train-2"]]) == ["tidal-control", "tidal-trainer"]  # launcher, in-step trainer
    assert users["exec-weight-sync"] is None and users["exec-register-model"] is None  # no NATS at all
    assert trainer_job_env()[cluster.NATS_USER_ENV] == "tidal-trainer"
    for executor, env in compiled_env.items():
        if env:
            role = env[cluster.NATS_USER_ENV].removeprefix("tidal-")
            assert env[cluster.NATS_PASSWORD_ENV] == ("secret", cluster.NATS_SECRET, cluster.nats_password_key(role)), executor


def item(i: int) -> WorkItem:
    return WorkItem(0, i, f"{i}+1=", str(i + 1))


def group(i: int) -> Group:
    return Group(0, i, 0, "r000-0", np.array([1, 2], dtype=np.int32), [Sample(np.array([3, 4], dtype=np.int32), np.zeros(2, dtype=np.float32), 1.0)])


def config_file(tmp_path, url: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"transport": {"nats_url": url}}))
    return str(path)


async def eventually(check, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_each_role_can_do_its_part_of_a_round_on_the_clusters_nats(server, compiled_env, monkeypatch, tmp_path):
    """prepare/open_round (control) → trainer publishes policy and work → a worker pulls, keeps, answers and acks →
    the trainer consumes the group → the launcher marks the run failed → finalize deletes the run."""
    run = RunDir(tmp_path / RUN)
    config = config_file(tmp_path, server.url)
    cfg = TransportConfig(nats_url=server.url, ack_wait_seconds=5.0)

    as_pod(monkeypatch, server, role_env(compiled_env, "exec-prepare"))
    run_start.create_transport(run, config)  # what prepare_run does after staging the model
    assert run_state.reset_rounds(run, config, "job-1") is None
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-open-round"))
    run_state.begin_round(run, config, "job-1", 0)
    run_state.open_round(run, config, 0)

    as_pod(monkeypatch, server, trainer_job_env())

    async def trainer_starts():
        t = await Transport.connect(server.url, RUN, cfg, create=True)
        await t.put_policy(0, "/mnt/tidal/runs/run-auth/weights/v000000")
        for i in range(3):
            await t.publish_work(item(i))
        depth = await t.work_queue_depth()
        await t.close()
        return depth

    assert asyncio.run(trainer_starts()) == 3

    as_pod(monkeypatch, server, role_env(compiled_env, "exec-rollout-worker"))
    assert run_state.read_run_state(run, config) == RunState.RUNNING.value  # the worker step's supervisor

    async def worker_answers():
        t = await Transport.connect(server.url, RUN, cfg, create=False)
        assert (await t.policy()).version == 0 and not await t.stopping()
        sub = await t.work_subscription()
        msgs = await t.fetch(sub, 3, timeout=2.0, linger=0.2)
        assert sorted(decode_work_item(m.data).prompt_id for m in msgs) == [0, 1, 2]
        for m in msgs:
            await m.in_progress()
        await t.publish_group(group(decode_work_item(msgs[0].data).prompt_id))
        await msgs[0].ack()
        await t.put_worker_health(WorkerHealth("r000-1").record())  # its heartbeat
        await t.put(f"{weight_handshake.READY_PREFIX}0", {"version": 0, "offer": "x"})
        await weight_handshake.refuse(t, "joined late")  # the NCCL transfer, which only the trainer turns off
        await t.close()
        return decode_work_item(msgs[0].data).prompt_id

    answered = asyncio.run(worker_answers())

    as_pod(monkeypatch, server, trainer_job_env())

    async def trainer_consumes():
        t = await Transport.connect(server.url, RUN, cfg, create=True)
        await eventually(lambda: _depth_is(t, 2))  # the worker's ack was accepted: the item left the work queue
        sub = await t.rollouts_subscription()
        (m,) = await t.fetch(sub, 5, timeout=2.0)
        got = decode_group(m.data)
        await m.ack()
        assert [r["worker_id"] for r in await t.worker_health()] == ["r000-1"]
        assert await weight_handshake.off_reason(t) == "joined late" and (await t.get(KVKey.NCCL))["state"] == "off"
        described = [await t.describe_work(seq) for seq in (1, 2, 3)]  # naming an item JetStream gave up on (acked ones are gone)
        assert sum(d.startswith("work item 0/") for d in described) == 2, described
        await t.on_undeliverable_work(lambda seq: None)  # the max-deliveries advisory
        await asyncio.sleep(0.3)
        assert permission_violations(t.nc) == []  # nothing of this was refused, subscriptions included
        await t.close()
        return got.prompt_id

    assert asyncio.run(trainer_consumes()) == answered

    as_pod(monkeypatch, server, role_env(compiled_env, executor_of_role(compiled_env, "control", ("exec-train", "exec-train-2"))))
    run_state.mark_run_failed(run, config, 0)  # the launcher of a failed trainer job
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-evaluate"))
    assert run_state.read_run_state(run, config) == RunState.FAILED.value
    run_state.end_round(run, config, "job-1", 0)
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-finalize"))
    assert sorted(run_state.delete_run_transport(run, config)) == sorted(
        [
            f"stream {stream_names(RUN)['work_stream']}",
            f"stream {stream_names(RUN)['rollouts_stream']}",
            f"KV bucket {stream_names(RUN)['kv_bucket']}",
        ]
    )


async def _depth_is(t: Transport, depth: int) -> bool:
    return await t.work_queue_depth() == depth


@pytest.fixture
def running_round(server, monkeypatch):
    """A run the trainer has set up: policy v0, two work items, one group on ROLLOUTS."""
    cfg = TransportConfig(nats_url=server.url, ack_wait_seconds=5.0)
    as_pod(monkeypatch, server, trainer_job_env())

    async def setup():
        t = await Transport.connect(server.url, RUN, cfg, create=True)
        await t.put_policy(0, "/weights/v000000")
        await t.publish_work(item(0))
        await t.publish_work(item(1))
        await t.close()

    asyncio.run(setup())
    return cfg


def test_a_worker_may_not_move_the_policy_consume_rollouts_or_publish_work(server, compiled_env, monkeypatch, running_round, caplog):
    cfg = running_round
    caplog.set_level("WARNING", logger="tidal.transport")
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-rollout-worker"))

    async def attempts():
        t = await Transport.connect(server.url, RUN, cfg, create=False)
        await t.publish_group(group(0))  # allowed: what a worker is for
        outcomes = {}
        for what, attempt in {
            "policy": lambda: t.put_policy(1, "/elsewhere/v000001"),
            "run state": lambda: t.put_run_state(RunState.DONE),
            "work": lambda: t.publish_work(item(7)),
            "rollouts": lambda: _pull_rollouts(t),
        }.items():
            with pytest.raises(NatsPermissionError) as refused:
                await attempt()
            outcomes[what] = (str(refused.value), [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()])
            # raised when the server's refusal came in, not after the request timed out
            assert not isinstance(refused.value.__context__, NatsTimeout), what
        # nor through a consumer of its own, nor by reading ROLLOUTS messages by sequence (the server drops
        # these: each ends at its timeout, here a short one)
        js, names = t.nc.jetstream(timeout=1.0), t.names
        mark = len(_violations(t))
        with pytest.raises(Exception):  # noqa: B017 - dropped by the server: a timeout, named in the violations
            await js.add_consumer(names["rollouts_stream"], durable_name="mine", timeout=1.0)
        with pytest.raises(Exception):  # noqa: B017
            await js.get_msg(names["rollouts_stream"], seq=1, direct=False)
        with pytest.raises(Exception):  # noqa: B017 - direct gets are allowed, but ROLLOUTS does not answer them
            await js.get_msg(names["rollouts_stream"], seq=1, direct=True)
        with pytest.raises(Exception):  # noqa: B017
            await js.delete_stream(names["work_stream"])
        await asyncio.sleep(0.2)
        later = _violations(t)[mark:]
        await t.close()
        return outcomes, later

    outcomes, later = asyncio.run(attempts())
    policy_message, retries = outcomes["policy"]
    # (nats-py lowercases the server's message)
    assert "tidal-worker" in policy_message and f'"$kv.{stream_names(RUN)["kv_bucket"]}.policy"'.lower() in policy_message.lower()
    assert retries == [], "a refusal must be reported at once, not retried as an outage"
    assert ".msg.next." in outcomes["rollouts"][0].lower() and '.trainer"' in outcomes["rollouts"][0].lower()
    later = [v.lower() for v in later]
    assert any(".consumer.durable.create." in v for v in later), later
    assert any(".stream.msg.get." in v for v in later) and any(".stream.delete." in v for v in later), later

    # the trainer's view is untouched: policy v0, the run still running, no extra work item, the group still there
    as_pod(monkeypatch, server, trainer_job_env())

    async def trainer_view():
        t = await Transport.connect(server.url, RUN, cfg, create=False)
        policy, depth = await t.policy(), await t.work_queue_depth()
        groups = await t.fetch(await t.rollouts_subscription(), 5, timeout=2.0)
        await t.close()
        return policy.version, depth, len(groups)

    assert asyncio.run(trainer_view()) == (0, 2, 1)


async def _pull_rollouts(t: Transport):
    sub = await t.rollouts_subscription()
    return await t.fetch(sub, 1, timeout=1.0)


def _violations(t: Transport) -> list[str]:
    return permission_violations(t.nc)


def test_the_pipeline_steps_may_not_publish_the_policy_or_work(server, compiled_env, monkeypatch, running_round):
    """Only the trainer moves the policy pointer: the control user (prepare, launcher, evaluate, finalize) may not."""
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-prepare"))

    async def attempts():
        t = await Transport.connect(server.url, RUN, running_round, create=True)
        refused = []
        for attempt in (lambda: t.put_policy(1, "/elsewhere"), lambda: t.publish_work(item(9)), lambda: _pull_rollouts(t)):
            with pytest.raises(NatsPermissionError) as err:
                await attempt()
            refused.append(str(err.value))
        await t.close()
        return refused

    refused = asyncio.run(attempts())
    assert all("tidal-control" in r for r in refused) and ".policy" in refused[0] and ".work" in refused[1]


@pytest.mark.parametrize("credentials", ["none", "wrong password", "another role's password"])
def test_the_clusters_nats_refuses_clients_without_their_roles_password(server, monkeypatch, credentials, caplog):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    if credentials != "none":
        monkeypatch.setenv(cluster.NATS_USER_ENV, cluster.nats_user("trainer"))
        password = "x" * 24 if credentials == "wrong password" else server.secret[cluster.nats_password_key("worker")]
        monkeypatch.setenv(cluster.NATS_PASSWORD_ENV, password)
    else:
        monkeypatch.delenv(cluster.NATS_USER_ENV, raising=False)
    caplog.set_level("WARNING", logger="tidal.transport")
    with pytest.raises(NatsUnavailableError, match="refused the connection: .*(wrong password for user tidal-trainer|has none)"):
        asyncio.run(delete_run(server.url, RUN))
    refusals = [r for r in caplog.records if "authorization violation" in r.getMessage().lower()]
    assert len(refusals) == 1, "refused credentials are reported at once, not after every reconnect attempt"


def test_the_server_does_not_start_without_every_roles_password(tmp_path):
    """A Secret without a role's key stops the pod (CreateContainerConfigError); should the variable still be
    missing, nats-server refuses to start, naming it, rather than letting that user in without a password."""
    files, server_env = rendered_server_files("cpu-dev", tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert set(server_env.values()) == {cluster.nats_password_key(role) for role in cluster.NATS_ROLES}
    missing = sorted(server_env)[0]
    env = {"POD_NAME": "tidal-nats-0", **{name: "p" * 12 for name in server_env if name != missing}}
    result = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True, env=env, timeout=20)
    assert result.returncode != 0 and missing in result.stderr + result.stdout


ROLE_ENVS = {"trainer": None, "worker": "exec-rollout-worker", "control": "exec-prepare"}


def env_of_role(compiled_env, role: str) -> dict:
    return trainer_job_env() if ROLE_ENVS[role] is None else role_env(compiled_env, ROLE_ENVS[role])


async def _new_violations(nc, mark: int, count: int) -> list[str]:
    """The ``count`` permission violations the server reports to ``nc`` after the first ``mark``."""
    await nc.flush()
    await eventually(lambda: _has_violations(nc, mark + count))
    return [v.lower() for v in permission_violations(nc)[mark:]]


async def _has_violations(nc, count: int) -> bool:
    return len(permission_violations(nc)) >= count


@pytest.mark.parametrize("role", sorted(ROLE_ENVS))
def test_each_role_hears_replies_in_its_own_inbox_only(server, compiled_env, monkeypatch, running_round, role):
    """Replies (publish acks, pulled messages, KV gets) go to ``_INBOX_<user>``: a role may not subscribe to every
    inbox, nor to another role's, so it cannot read their pulled messages or KV replies."""
    as_pod(monkeypatch, server, env_of_role(compiled_env, role))
    others = [f"{inbox_prefix({'user': cluster.nats_user(other)})}.>" for other in sorted(ROLE_ENVS) if other != role]

    async def attempts():
        t = await Transport.connect(server.url, RUN, running_round, create=False)
        own_replies = []

        async def keep(msg) -> None:
            own_replies.append(msg)

        await t.nc.subscribe(f"{inbox_prefix({'user': cluster.nats_user(role)})}.>", cb=keep)
        mark = len(permission_violations(t.nc))
        for subject in ["_INBOX.>", *others]:
            await t.nc.subscribe(subject)
        refused = await _new_violations(t.nc, mark, 1 + len(others))
        policy = await t.policy()  # its own reply comes to its own inbox: to the wildcard subscription too
        await eventually(lambda: _nonempty(own_replies))
        await t.close()
        return refused, policy.version

    refused, version = asyncio.run(attempts())
    assert version == 0
    for subject in ["_INBOX.>", *others]:
        assert any(f'subscription to "{subject.lower()}"' in v for v in refused), (subject, refused)
    assert len(refused) == 1 + len(others), refused  # its own inbox was not refused


async def _nonempty(items: list) -> bool:
    return bool(items)


def test_only_the_trainer_writes_the_nccl_offer(server, compiled_env, monkeypatch, running_round):
    """The offer names the NCCL group the engines join and what they take from it: a worker may write its lane's
    ready key, its heartbeat and a refusal, never the offer."""
    forged = {"state": "offer", "id": "forged", "version": 1, "lanes": 1, "rendezvous": {"group": "elsewhere", "formed": False}, "update_info": {}}
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-rollout-worker"))

    async def worker():
        t = await Transport.connect(server.url, RUN, running_round, create=False)
        with pytest.raises(NatsPermissionError) as refused:
            await t.put(KVKey.NCCL, forged)
        await t.put(f"{weight_handshake.READY_PREFIX}0", {"version": 1, "offer": "o-1"})
        await t.put_worker_health(WorkerHealth("r000-0").record())
        later = permission_violations(t.nc)[1:]
        await t.close()
        return str(refused.value), later

    refused, later = asyncio.run(worker())
    assert "tidal-worker" in refused and f'"$kv.{stream_names(RUN)["kv_bucket"]}.weight_sync.nccl"'.lower() in refused.lower()
    assert later == []  # its ready key and heartbeat were not refused
    as_pod(monkeypatch, server, trainer_job_env())

    async def trainer():
        t = await Transport.connect(server.url, RUN, running_round, create=True)
        before = await weight_handshake.pending_offer(t)
        await t.put(KVKey.NCCL, {**forged, "id": "trainers"})
        after = await weight_handshake.pending_offer(t)
        ready, beats = await t.get(f"{weight_handshake.READY_PREFIX}0"), await t.worker_health()
        await t.close()
        return before, after["id"], ready["offer"], [b["worker_id"] for b in beats]

    assert asyncio.run(trainer()) == (None, "trainers", "o-1", ["r000-0"])


def test_the_pipeline_steps_may_not_add_a_consumer_that_reads_rollouts(server, compiled_env, monkeypatch, running_round):
    """Control creates the run's two durables (by name); a push consumer of its own on ROLLOUTS, named or
    ephemeral, is refused, and so is a second one named like WORK's (each stream holds one consumer)."""
    as_pod(monkeypatch, server, role_env(compiled_env, "exec-prepare"))

    async def attempts():
        t = await Transport.connect(server.url, RUN, running_round, create=True)  # its own part: streams, durables, bucket
        js, stream, deliver = t.js, t.names["rollouts_stream"], t.nc.new_inbox()
        mark = len(permission_violations(t.nc))
        for named in ({"durable_name": "spy"}, {}):
            with pytest.raises(NatsTimeout):  # dropped by the server, named in the violations
                await js.add_consumer(stream, deliver_subject=deliver, timeout=1.0, **named)
        refused = await _new_violations(t.nc, mark, 2)
        with pytest.raises(BadRequestError) as over_limit:
            await js.add_consumer(stream, durable_name=WORKERS_CONSUMER, deliver_subject=deliver)
        await t.close()
        return refused, over_limit.value

    refused, over_limit = asyncio.run(attempts())
    stream = stream_names(RUN)["rollouts_stream"].lower()
    assert any(f'"$js.api.consumer.durable.create.{stream}.spy"' in v for v in refused), refused
    assert any(f'"$js.api.consumer.create.{stream}"' in v for v in refused), refused
    assert "maximum consumers limit" in over_limit.description.lower(), over_limit
    as_pod(monkeypatch, server, trainer_job_env())

    async def trainer_view():
        t = await Transport.connect(server.url, RUN, running_round, create=False)
        info = await t.js.stream_info(t.names["rollouts_stream"])
        await t.close()
        return info.state.consumer_count

    assert asyncio.run(trainer_view()) == 1

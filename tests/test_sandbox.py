"""User code (rollout.agent.tools, reward functions, environment classes) gets nothing of the run: hostile code
run in the real tool, reward and environment processes, in the sandbox (tidal.sandbox), tries to take
the run, and each attempt fails or is cut. The unconfined control (sandbox.enabled false) shows the
same attempts succeed there, so the attempts are real."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_misbehaving_once
from tests.hostile import SECRETS
from tidal import sandbox
from tidal.config.schema import ConfigError, SandboxConfig
from tidal.envs import EnvironmentFactory, Trajectory
from tidal.envs.env_host import Problem
from tidal.envs.isolation import ToolHost, ToolLimits
from tidal.envs.sandboxed import EnvLimits
from tidal.envs.tools import tool_function
from tidal.rewards.pool import remote_reward, reward_process
from tidal.transport.server import EmbeddedNats

REFUSED = ("PermissionError", "ConnectionRefusedError", "OSError", "FileNotFoundError", "TimeoutError")


def test_readable_roots_carve_the_hidden_run_directory_out_of_a_root_that_holds_it(tmp_path):
    for name in ("src", "runs/a/weights", "runs/b", "notes"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "README").write_text("x")
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "a")
    roots = sandbox.readable_roots([str(tmp_path), "/usr"], [str(tmp_path / "runs" / "a")])
    assert sorted(roots) == sorted([str(tmp_path / n) for n in ("README", "notes", "runs/b", "src")] + ["/usr"])
    assert sandbox.readable_roots([str(tmp_path / "runs" / "a" / "weights")], [str(tmp_path / "runs" / "a")]) == []


def test_user_code_is_blind_to_the_key_files_a_config_names_as_to_the_run_directory(tmp_path):
    """a pod's snapshot keys are mounted files outside the run directory (weights.*_key_file): their folders are hidden too."""
    from tidal.config import config_from_dict

    before = sandbox.current()
    files = {"public_key_file": str(tmp_path / "public" / "public-key"), "signing_key_file": str(tmp_path / "signing" / "private-key")}
    try:
        sandbox.confine_user_code(config_from_dict({"weights": files}), tmp_path / "run")
        assert sandbox.current().hidden == tuple(str(tmp_path / n) for n in ("run", "public", "signing"))
        sandbox.confine_user_code(config_from_dict({}), tmp_path / "run")
        assert sandbox.current().hidden == (str(tmp_path / "run"),)
    finally:
        sandbox.configure(before)


def test_the_host_environment_holds_allow_listed_names_and_never_a_run_secret(tmp_path):
    environ = {"PATH": "/bin", "LANG": "C", "TIDAL_WEIGHTS_KEY": "k", "TIDAL_NATS_TOKEN": "t", "MY_API_KEY": "a", "OTHER": "o"}
    environ[sandbox.PASS_ENV] = "TIDAL_NATS_TOKEN,OTHER"
    env = sandbox.host_environment(sandbox.SandboxPolicy(env=("MY_API_KEY",)), environ, tmp_path, ["/code"])
    assert env == {
        "PATH": "/bin",
        "LANG": "C",
        "MY_API_KEY": "a",
        "OTHER": "o",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path / "tmp"),
        "XDG_CACHE_HOME": str(tmp_path / ".cache"),
        "PYTHONPATH": "/code",
    }
    with pytest.raises((ConfigError, ValueError), match="TIDAL_WEIGHTS_KEY"):
        SandboxConfig(env=["TIDAL_WEIGHTS_KEY"])


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run directory as a worker sees it (secret files 0600, weights/), the run's secrets in the
    worker's environment, and the targets for tests.hostile."""
    run = tmp_path / "run"
    (run / "weights" / "v000000").mkdir(parents=True)
    for name in ("weights-key", "nats-token"):
        (run / name).write_text("secret")
        (run / name).chmod(0o600)
    (run / "weights" / "v000000" / "manifest.json").write_text("{}")
    for name in SECRETS:
        monkeypatch.setenv(name, "secret")
    return run


def hostile_report(kind: str, run: Path, markers: Path, policy: sandbox.SandboxPolicy) -> dict:
    """tests.hostile.attempts as a tool, a reward function or an environment (in its reset), in its
    real host process under `policy`."""
    sandbox.configure(policy)
    try:
        if kind == "env":
            hostile_environment_trajectory()
        elif kind == "tool":
            host = ToolHost(["tests.hostile:hostile_tool"], ToolLimits())
            try:
                result = host.run(host.isolate(tool_function_tool("tests.hostile:hostile_tool")), {})
            finally:
                host.close()
            assert not result.error, result.text
        else:
            process = reward_process(["tests.hostile:hostile_reward"], 60.0, 4096, 60)
            try:
                assert remote_reward(process, "tests.hostile:hostile_reward")("c", "a") == 0.0
            finally:
                process.close()
    finally:
        sandbox.configure(sandbox.SandboxPolicy())
    (report,) = [json.loads(p.read_text()) for p in markers.glob("hostile-*.json")]
    return report


def hostile_environment_trajectory() -> None:
    """One trajectory of tests.hostile:CallsHostileTool in its environment process: reset (where it
    makes its attempts and forks), then reward (where it notes which of its children still run)."""
    factory = EnvironmentFactory.from_names("tests.hostile:CallsHostileTool", hosting=EnvLimits(processes=1))
    try:
        env = factory()
        messages = env.reset(Problem(0, "1+1=", "2"))
        assert env.reward(Trajectory(Problem(0, "1+1=", "2"), messages, env.stats)) is None
    finally:
        factory.close()


def tool_function_tool(name: str):
    from tidal.envs.tools import Tool

    return Tool.from_function(tool_function(name), reference=name)


@pytest.mark.parametrize("kind", ["tool", "reward", "env"])
def test_hostile_user_code_gets_nothing_of_the_run(kind, run_dir, tmp_path, monkeypatch):
    """Secrets in the environment and /proc, the run directory's files, weights/, the run's NATS, a
    signal to the worker, 200 children: each attempt fails or is cut; its own directory works. An
    environment's children end with the call that started them, while the instance lives on."""
    markers = tmp_path / "markers"
    markers.mkdir()
    with EmbeddedNats(tmp_path / "nats") as nats:
        port = int(nats.url.rsplit(":", 1)[1])
        monkeypatch.setenv("TIDAL_TEST_TARGETS", json.dumps({"run_dir": str(run_dir), "nats_port": port}))
        monkeypatch.setenv("TIDAL_TEST_MARKERS", str(markers))
        policy = sandbox.SandboxPolicy(hidden=(str(run_dir),), write_paths=(str(markers),))
        report = hostile_report(kind, run_dir, markers, policy)
    assert report["env"] == "none"
    for attempt in ("proc_environ", "run_dir_read", "weights_write", "run_dir_write", "nats", "signal"):
        assert report[attempt].startswith(REFUSED), (attempt, report[attempt])
    forked = int(report["fork"].split()[1])
    assert forked < policy.processes, report["fork"]  # the tree's process limit, not each process's
    assert report["own_dir_write"] == "ok: 1"
    assert not (run_dir / "planted").exists() and not (run_dir / "weights" / "planted").exists()
    assert Path(report["cwd"]).name.startswith(sandbox.BOX_PREFIX) and not Path(report["cwd"]).exists()  # removed with its host
    if kind == "env":
        (after,) = [json.loads(p.read_text()) for p in markers.glob("env-after-*.json")]
        assert after == {"forked": forked, "running": 0}


@pytest.mark.parametrize("kind", ["tool", "reward", "env"])
def test_unconfined_the_same_attempts_succeed(kind, run_dir, tmp_path, monkeypatch):
    """The control: with sandbox.enabled false the attempts are made as above and work."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("TIDAL_TEST_TARGETS", json.dumps({"run_dir": str(run_dir)}))
    monkeypatch.setenv("TIDAL_TEST_MARKERS", str(markers))
    report = hostile_report(kind, run_dir, markers, sandbox.SandboxPolicy(enabled=False))
    assert set(report["env"].split(",")) == set(SECRETS)
    for attempt in ("proc_environ", "run_dir_read", "weights_write", "signal"):
        assert report[attempt].startswith("ok"), (attempt, report[attempt])


def alive(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(pid)
    return found


def test_a_call_that_times_out_ends_every_process_it_started_even_those_that_left_its_session():
    host = ToolHost(["tests.hostile:fork_and_hang"], ToolLimits(timeout_seconds=4.0))
    tool = host.isolate(tool_function_tool("tests.hostile:fork_and_hang"))
    seen: list[int] = []

    def watch() -> None:
        deadline = time.time() + 3.5
        while time.time() < deadline:
            if host.processes and host.processes[0].box is not None:
                seen[:] = host.processes[0].box.members() or seen
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = host.run(tool, {"n": 20})
    finally:
        watcher.join()
        host.close()
    assert result.failure == "timeout"
    assert len(seen) == 21, seen  # the host and its 20 children, each in a session of its own
    time.sleep(0.5)
    assert alive(seen) == []


def test_what_a_call_starts_ends_with_the_call():
    host = ToolHost(["tests.hostile:leave_a_daemon", "tests.tools:pid"], ToolLimits())
    try:
        daemon = int(host.run(host.isolate(tool_function_tool("tests.hostile:leave_a_daemon")), {}).text)
        time.sleep(0.2)
        assert alive([daemon]) == []
        assert not host.run(host.isolate(tool_function_tool("tests.tools:pid")), {}).error  # the host itself goes on
    finally:
        host.close()


def test_the_memory_limit_holds_for_the_whole_tree():
    """4 children of 400 MB each under a 1 GB limit: each is under the per-process limit, together they
    are not; the tree is cut (the call fails, or its children are killed), it never holds 1.6 GB."""
    host = ToolHost(["tests.hostile:allocate_in_children"], ToolLimits(memory_mb=1024, timeout_seconds=60))
    try:
        result = host.run(host.isolate(tool_function_tool("tests.hostile:allocate_in_children")), {"children": 4, "megabytes": 400})
    finally:
        host.close()
    assert result.error or "children ended: [0, 0, 0, 0]" not in result.text, result.text
    if not result.error:
        assert "9" in result.text  # a child was killed (SIGKILL, by the limit)


def test_a_flood_on_a_raw_descriptor_is_cut(capfd):
    host = ToolHost(["tests.hostile:flood_descriptor", "tests.tools:pid"], ToolLimits())
    try:
        assert host.run(host.isolate(tool_function_tool("tests.hostile:flood_descriptor")), {"megabytes": 100}).text == "flooded"
        host.run(host.isolate(tool_function_tool("tests.tools:pid")), {})  # the next call says what was dropped
    finally:
        host.close()
    err = capfd.readouterr().err
    assert 60_000 < err.count("z") < 100_000
    assert "bytes written by user code were dropped" in err


@pytest.mark.parametrize("mode", ["periodic", "sync"])
def test_a_run_with_hostile_tools_and_rewards_finishes_and_they_got_nothing(mode, tmp_path, write_config, monkeypatch):
    """A real run: the environment class, the tool and the reward function try everything on the
    process that started them (a worker; sync mode's trainer), the run directory and the run's NATS
    (its address from the worker's command line); every attempt fails and the run finishes as if
    they were not there."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TIDAL_TEST_TARGETS", json.dumps({"run_dir": str(run_dir.resolve())}))
    config = write_config(
        {
            "mode": mode,
            "rollout.agent.env": "tests.hostile:CallsHostileTool",
            "rollout.agent.tools": ["tests.hostile:hostile_tool"],
            "rollout.agent.max_turns": 2,
            "reward.functions": [{"name": "exact_match"}, {"name": "tests.hostile:hostile_reward", "weight": 0.0}],
            "trainer.iterations": 2,
            "trainer.prompts_per_iteration": 2,
            "eval.enabled": False,
        }
    )
    proc, run_dir, markers = run_misbehaving_once(config, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / "markers" / name).read_text()) for name in markers if name.startswith("hostile-")]
    assert {r["kind"] for r in reports} == {"tool", "reward", "env"}
    afters = [json.loads((tmp_path / "markers" / name).read_text()) for name in markers if name.startswith("env-after-")]
    assert afters and all(a["forked"] > 0 and a["running"] == 0 for a in afters), afters  # the environment's children ended with its call
    for report in reports:
        assert report["env"] == "none", report
        for attempt in ("proc_environ", "run_dir_read", "weights_write", "run_dir_write", "signal", *(["nats"] if mode == "periodic" else [])):
            assert report[attempt].startswith(REFUSED), (attempt, report[attempt])
    assert not list(run_dir.rglob("planted"))
    assert len(read_jsonl(run_dir / "groups.jsonl")) == 4


def test_without_a_control_group_the_watch_holds_the_process_and_memory_limits(monkeypatch):
    """Where no control group can be made (no delegation: most non-root machines), the worker measures
    the host's session and kills the whole tree past the limits; the call fails, naming which."""
    monkeypatch.setattr(sandbox, "make_cgroups", lambda *args: [])
    host = ToolHost(["tests.hostile:fork_and_hang", "tests.hostile:allocate_in_children"], ToolLimits(memory_mb=1024, timeout_seconds=60))
    try:
        forks = host.run(host.isolate(tool_function_tool("tests.hostile:fork_and_hang")), {"n": 100})
        memory = host.run(host.isolate(tool_function_tool("tests.hostile:allocate_in_children")), {"children": 4, "megabytes": 400})
    finally:
        host.close()
    assert forks.failure == "crash" and "over 64 processes (sandbox.processes)" in forks.text, forks.text
    assert memory.failure == "crash" and "over 1024 MB resident" in memory.text, memory.text


FORK_FOREVER = """
import os, sys, time
for _ in range(2000):
    if os.fork() == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
time.sleep(60)
"""


def test_killing_a_tree_that_forks_as_fast_as_it_can_leaves_no_process_behind():
    """Without a control group, a tree whose processes fork while it is being stopped: a child made
    between one look at the tree and the moment its parent's SIGSTOP took effect must not outlive it."""
    import os
    import subprocess
    import sys

    marker = f"tidal-fork-forever-{os.getpid()}"
    survivors = []
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, "-c", FORK_FOREVER, marker], start_new_session=True)
        box = sandbox.HostBox(Path("/nonexistent"), processes=10_000)
        box.pid = proc.pid
        while len(box.members()) < 30:
            time.sleep(0.005)
        box.kill_tree()
        proc.wait()
        time.sleep(0.05)
        survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)]
        if survivors:
            break
    for pid in survivors:
        os.kill(int(pid), 9)
    assert not survivors, f"{len(survivors)} processes outlived kill_tree"


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False

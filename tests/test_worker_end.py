"""Whatever a rollout worker started ends with it, however the worker ends: its reward and tool
processes get the kernel's parent-death signal (even while user code holds the interpreter), and the
launcher kills what is left of a dead worker's process group before it restarts it. Real processes,
a real `tidal run`, a real SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

from tests.conftest import ROOT, read_jsonl, run_misbehaving_once
from tests.processes import kill, left_running, running

WORKER = textwrap.dedent(
    """
    import json, os, signal, threading, time
    from tests.processes import descendants_of, started_at
    from tidal.envs import ToolHost, ToolLimits, resolve_tool
    from tidal.rewards.pool import reward_process

    tools = ToolHost(["tests.tools:grip", "tests.tools:pid"], ToolLimits(timeout_seconds=600, cpu_seconds=None, processes=1))
    pid = tools.isolate(resolve_tool("tests.tools:pid"))
    # the tool process is started on a thread that ends at once: it must outlive that thread
    first = threading.Thread(target=lambda: print(pid({}).text, flush=True))
    first.start()
    first.join()
    time.sleep(1.0)
    print(pid({}).text, flush=True)
    rewards = reward_process(["tests.rewards:digit_count"], 60.0)
    rewards.request({"fn": "tests.rewards:digit_count", "completion": "1", "answer": "1"})
    print(rewards.proc.pid, flush=True)
    threading.Thread(target=tools.isolate(resolve_tool("tests.tools:grip")), args=({},), daemon=True).start()
    time.sleep(1.0)
    print(json.dumps({pid: started_at(pid) for pid in descendants_of(os.getpid())}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


CLIENT = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from tests.processes import descendants_of, started_at
    from tidal import reaper

    reaper.start()
    time.sleep(1.0)
    # started after the watcher: a child that starts a grandchild (as vLLM's engine core starts its worker)
    subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"])
    own_group = subprocess.Popen(["sleep", "601"], process_group=0)  # a role of a launcher: stopped by the launcher, not the watcher
    while len(descendants_of(os.getpid())) < 4:  # the watcher, the child, its grandchild, own_group
        time.sleep(0.05)
    time.sleep(3.0)  # several of the watcher's looks (it looks twice a second)
    print(json.dumps({"own_group": own_group.pid, "started": {p: started_at(p) for p in descendants_of(os.getpid())}}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_the_reaper_kills_what_its_process_started_after_it_in_its_group_once_it_is_killed(tmp_path):
    """tidal.reaper (what a vLLM client starts before its engine): the processes started after it, a
    grandchild among them, end when the client is SIGKILLed; one in a group of its own is left alone."""
    out = tmp_path / "out"
    with out.open("w") as stdout:
        proc = subprocess.run([sys.executable, "-c", CLIENT], stdout=stdout, cwd=ROOT, timeout=300)
    assert proc.returncode == -9
    record = json.loads(out.read_text())
    started = {int(pid): at for pid, at in record["started"].items()}
    own_group = record["own_group"]
    left = left_running({p: s for p, s in started.items() if p != own_group}, 30)
    own_group_ran = running(own_group, started[own_group])
    kill([*left, own_group])
    assert len(started) == 4 and not left, f"{started}: still running {left}"
    assert own_group_ran


def test_a_killed_workers_hosts_end_even_while_a_tool_holds_the_interpreter(tmp_path):
    """A tool stuck in C code starves the host's own watcher thread: only the kernel's parent-death
    signal ends it. The tool process was started on a thread that ended long before the worker."""
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:  # files, not pipes: a host left running would hold a pipe open
        proc = subprocess.run([sys.executable, "-c", WORKER], stdout=stdout, stderr=stderr, cwd=ROOT, timeout=300)
    assert proc.returncode == -9, err.read_text()[-2000:]
    tool_first, tool_second, reward, descendants = out.read_text().splitlines()
    assert tool_first == tool_second  # the tool process outlived the thread that started it
    started = {int(pid): at for pid, at in json.loads(descendants).items()}
    assert set(started) == {int(tool_first), int(reward)}  # the tool process, gripped, and the reward process
    left = left_running(started, 30)
    kill(left)
    assert not left, f"still running after their worker was killed: {left}"


def processes_left_by(tmp_path, marker: str) -> tuple[dict, dict[int, float], list]:
    """The misbehaving role's record (written just before the worker was stopped), the processes it had
    started, and those still running a while later (killed here, so the test leaves nothing behind)."""
    record = json.loads((tmp_path / "markers" / f"{marker}.json").read_text())
    started = {int(pid): at for pid, at in record["started"].items()}
    left = left_running(started, 30)
    kill(left)
    return record, started, left


def assert_each_group_trained_once(run_dir, groups: int) -> None:
    trained = Counter((r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl"))
    assert len(trained) == groups and set(trained.values()) == {1}


def test_a_killed_worker_takes_its_reward_and_tool_processes_with_it_and_the_run_finishes(tmp_path, write_config):
    """A tool SIGKILLs its worker mid-iteration and then holds its interpreter: every process the worker
    had started (its tool and reward processes) ends, the launcher restarts the worker, no group is lost."""
    iterations, prompts = 2, 4
    config = write_config(
        {
            "rollout.agent.env": "tests.tools:WorkerKiller",
            "rollout.agent.tools": ["tests.tools:kill_worker_once"],
            # user code that signals its own worker is what the sandbox refuses (tests/test_sandbox.py); here the
            # worker's death is the subject, so its user code runs unconfined
            "sandbox.enabled": False,
            "rollout.agent.max_turns": 2,
            "reward.functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.0}],
            "trainer.iterations": iterations,
            "trainer.prompts_per_iteration": prompts,
            "eval.enabled": False,
        }
    )
    proc, run_dir, _ = run_misbehaving_once(config, tmp_path)
    record, started, left = processes_left_by(tmp_path, "worker-killed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left, f"processes of the killed worker {record['worker']} still running: {left}"
    commands = " | ".join(record["commands"])
    assert "-m tidal.envs.host" in commands and "-m tidal.rewards.host" in commands, commands  # the test tested both kinds
    assert "rollout worker worker-0 exited with code -9; restarting" in (run_dir / "logs" / "launcher.log").read_text()
    assert_each_group_trained_once(run_dir, iterations * prompts)


def test_a_worker_stopped_by_sigterm_ends_in_order_with_its_processes_and_the_run_finishes(tmp_path, write_config):
    """SIGTERM (a preemption) mid-iteration: the worker stops in order (its task cancelled, its engine
    shut down, its work handed back, exit code 143) instead of dying where it stands; its reward process
    ends with it; the launcher replaces it and no group is lost."""
    iterations, prompts = 2, 4
    config = write_config(
        {
            "reward.functions": [{"name": "exact_match"}, {"name": "tests.rewards:terminates_worker_once", "weight": 0.0}],
            # user code that signals its own worker is what the sandbox refuses (tests/test_sandbox.py); here the
            # worker's death is the subject, so its user code runs unconfined
            "sandbox.enabled": False,
            "trainer.iterations": iterations,
            "trainer.prompts_per_iteration": prompts,
            "eval.enabled": False,
        }
    )
    proc, run_dir, _ = run_misbehaving_once(config, tmp_path)
    record, started, left = processes_left_by(tmp_path, "worker-terminated")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert started and not left, f"processes of the stopped worker {record['worker']}: {started}, still running: {left}"
    assert "tidal: rollout worker stopped by SIGTERM" in (run_dir / "logs" / "worker-0.log").read_text()
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert "rollout worker worker-0 was stopped by SIGTERM (preempted); starting a replacement" in launcher
    assert "worker-0 exited with code" not in launcher  # a preemption is not counted as a crash
    assert "worker worker-0 stopping (SIGTERM): handed back" in (run_dir / "logs" / "worker-0.log").read_text()
    assert_each_group_trained_once(run_dir, iterations * prompts)

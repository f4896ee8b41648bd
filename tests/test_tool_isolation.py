"""The run's tools (rollout.agent.tools) run in a process of the worker's own: a tool that hangs, crashes,
exits, spins, hogs memory, raises or floods fails only its own call, with an error text the model
reads, counted; the process is replaced, and the process never outlives its worker. Real
processes, a real `tidal run`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_jsonl, run_misbehaving_once
from tidal.envs import EnvironmentFactory, ToolCall, ToolHost, ToolLimits, resolve_tool


@contextmanager
def isolated(*names: str, **limits):
    """tests.tools:NAME for each name, run in one tool process with these limits."""
    host = ToolHost([f"tests.tools:{n}" for n in names], ToolLimits(**limits))
    try:
        yield host, {n: host.isolate(resolve_tool(f"tests.tools:{n}")) for n in names}
    finally:
        host.close()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that is not there counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_a_hanging_tool_is_an_error_after_its_timeout_and_its_process_is_replaced():
    with isolated("hang", "pid", timeout_seconds=1.0) as (host, tools):
        first = tools["pid"]({}).text
        started = time.monotonic()
        result = tools["hang"]({})
        waited = time.monotonic() - started
        assert result.error and result.failure == "timeout"
        assert result.text == "error: hang failed: no answer within 1s (rollout.agent.tool_timeout_seconds); its process was replaced"
        assert 1.0 <= waited < 30  # the timeout, not the tool's hour
        second = tools["pid"]({})
        assert not second.error and second.text != first and host.processes[0].started == 2


@pytest.mark.parametrize(
    "name, limits, said",
    [
        ("crash", {}, "exited with code -9 (killed by SIGKILL)"),
        ("exit_now", {}, "exited with code 3 (a crash, sys.exit or os._exit)"),
        ("spin", {"cpu_seconds": 1, "timeout_seconds": 120.0}, "exited with code -24 (over its CPU-time limit)"),
    ],
)
def test_a_tool_that_kills_its_process_is_an_error_and_the_process_is_replaced(name, limits, said):
    with isolated(name, "pid", **limits) as (host, tools):
        result = tools[name]({})
        assert result.error and result.failure == "crash"
        assert result.text.startswith(f"error: {name} failed: its process ") and said in result.text
        assert not tools["pid"]({}).error and host.processes[0].started == 2


def test_the_cpu_limit_is_per_call_not_per_process_lifetime():
    """RLIMIT_CPU counts a process's whole life: the host re-arms it before each call, so cheap calls
    never add up to the limit."""
    with isolated("pid", cpu_seconds=1) as (host, tools):
        for _ in range(3):
            assert not tools["pid"]({}).error
        assert len(host.processes) == 1 and host.processes[0].started == 1


def test_a_tool_over_its_memory_limit_is_an_error_and_the_process_is_replaced():
    with isolated("hog", "pid", memory_mb=512) as (host, tools):
        result = tools["hog"]({})
        assert result.error and result.failure is None
        assert result.text == "error: hog raised MemoryError: over its memory limit (512 MB, rollout.agent.tool_memory_mb)"
        assert not tools["pid"]({}).error and host.processes[0].started == 2


def test_a_tool_that_raises_is_an_error_in_the_same_process():
    with isolated("boom", "pid") as (host, tools):
        pid = tools["pid"]({}).text
        result = tools["boom"]({"reason": "no luck"})
        assert result.text == "error: boom raised RuntimeError: no luck" and result.error and result.failure is None
        assert tools["pid"]({}).text == pid and host.processes[0].started == 1
        bad = tools["boom"]({"reason": 3})  # checked against the schema in the worker: never sent
        assert bad.text == "error: boom: argument 'reason' must be string, got int"


def test_a_flooding_tool_is_cut_at_the_byte_cap_and_its_prints_are_capped(capfd):
    with isolated("flood", "shout", output_bytes=1000) as (host, tools):
        result = tools["flood"]({})
        assert not result.error and result.cut
        assert result.text == "x" * 1000 + "… [cut: 10000000 bytes, over rollout.agent.tool_output_bytes]"
        said = tools["shout"]({})
        assert said.text == "said" and not said.cut and host.processes[0].started == 1
    err = capfd.readouterr().err
    assert "y" * 1000 in err and len(err) < 200_000  # 5 MB printed, 64 KiB of it kept
    assert "characters printed by one call were dropped" in err


def test_calc_in_the_worker_and_isolated_say_the_same():
    factory = EnvironmentFactory.from_names("tools", ["calc"], isolation=ToolLimits())
    try:
        env, local = factory(), resolve_tool("calc")
        for expression in ("123*456", "1/0", "9**99", "x+1"):
            assert env.call(ToolCall("calc", {"expression": expression}))["content"] == local({"expression": expression}).text
        assert factory.host.processes[0].started == 1 and env.stats.tool_errors == 3
    finally:
        factory.close()
    assert factory.host.processes[0].proc is None


def test_the_tool_process_ends_when_its_worker_is_killed_mid_call(tmp_path):
    """A worker SIGKILLed while a tool hangs: the tool process sees its parent gone and exits."""
    worker = textwrap.dedent(
        """
        import os, signal, sys, threading, time
        from tidal.envs import ToolHost, ToolLimits, resolve_tool
        host = ToolHost(["tests.tools:hang", "tests.tools:pid"], ToolLimits(timeout_seconds=600))
        print(host.isolate(resolve_tool("tests.tools:pid"))({}).text, flush=True)
        threading.Thread(target=host.isolate(resolve_tool("tests.tools:hang")), args=({},), daemon=True).start()
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    host_pid = int(proc.stdout.split()[0])
    assert gone_within(host_pid, 30)


def processes_with(marker: str) -> list[int]:
    """Running processes of this user whose environment holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_run_survives_tools_that_hang_crash_exit_raise_and_flood(tmp_path, write_config):
    """Every trajectory's first turn calls six misbehaving tools (tests.tools:Saboteur): each failure
    is an error observation, counted; no group is lost, the worker never dies, and no tool process
    outlives the run. Before isolation the hang held the worker forever and the crash killed it."""
    iterations, prompts = 2, 4
    config = write_config(
        {
            "rollout.agent.env": "tests.tools:Saboteur",
            "rollout.agent.tools": [f"tests.tools:{n}" for n in ("hang_once", "crash_once", "exit_once", "boom", "flood", "shout")],
            "rollout.agent.max_turns": 2,
            "rollout.max_new_tokens": 24,  # long enough for the barely warm-started model to end turns with EOS
            "rollout.agent.max_env_tokens_per_turn": 64,  # the six results, cut to fit: the second turn reads them
            "model.tiny.max_position_embeddings": 512,  # room for the six tool names, two turns and the results
            "rollout.agent.tool_timeout_seconds": 2.0,
            "rollout.agent.tool_output_bytes": 4096,
            "trainer.iterations": iterations,
            "trainer.prompts_per_iteration": prompts,
            "eval.enabled": False,
        }
    )
    proc, run_dir, misbehaved = run_misbehaving_once(config, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert misbehaved == ["crash", "exit", "hang"]  # each misbehaved, once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == iterations * prompts
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == iterations
    assert sum(m["agent_tool_timeouts"] for m in metrics) == 1
    assert sum(m["agent_tool_crashes"] for m in metrics) == 2
    stepped = sum(m["agent_tool_outputs_cut"] for m in metrics)  # every trajectory that called the tools: flood, cut
    assert stepped >= 1 and any(m["agent_turns_mean"] > 1 and m["agent_masked_token_fraction"] > 0 for m in metrics)
    for m in metrics:  # boom fails every time: at least one call in six
        assert m["agent_tool_error_rate"] >= 1 / 6 or not m["agent_tool_outputs_cut"]
    log = (run_dir / "logs" / "worker-0.log").read_text()
    assert "characters printed by one call were dropped" in log and len(log) < 100_000 * stepped  # shout printed 5 MB a call
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()  # the worker itself never died
    assert gone_within_all(str(tmp_path / "markers"), 10)


def gone_within_all(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not processes_with(marker)


@pytest.mark.parametrize("processes", [1, 3])
def test_overlapping_calls_run_in_up_to_tool_processes_processes(processes):
    with isolated("slow_pid", processes=processes) as (host, tools):
        with ThreadPoolExecutor(3) as pool:
            pids = {r.text for r in pool.map(lambda _: tools["slow_pid"]({}), range(3))}
        assert len(pids) == processes and len(host.processes) == processes
    assert all(p.proc is None for p in host.processes)

"""The built-in `python` tool: a real child interpreter per call, with its time, CPU, memory and
output limits, its process group killed when the call ends, and its limits set by the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tidal.config import ConfigError, config_from_dict
from tidal.envs import EnvironmentFactory, ToolHost, ToolLimits, resolve_tool, run_arguments
from tidal.envs.python_tool import NO_OUTPUT, ProgramFailed, python

LIMITS = {"timeout_seconds": 5.0, "cpu_seconds": 5, "memory_mb": 256, "output_bytes": 200}

# forks three sleepers (each in the program's process group) and prints their pids
FORK_SLEEPERS = """
import os, time
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    print(pid, flush=True)
"""


def run(code: str, **limits) -> str:
    return python(code, **{**LIMITS, **limits})


def alive(pid: int) -> bool:
    """Running, not a zombie: a killed orphan may wait a moment for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def all_gone(pids: list[int], within: float = 3.0) -> bool:
    """SIGKILL is delivered asynchronously: allow it a moment."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def test_it_returns_what_the_program_prints():
    assert run("print(417 * 382)") == "159294\n"
    assert run("import sys; sys.stdout.write('a'); print('b', file=sys.stderr)") == "a"  # stderr is not the result
    assert run("x = 417 * 382") == NO_OUTPUT  # a program that forgot to print is told so


def test_a_failing_program_returns_its_output_and_the_error_tail():
    with pytest.raises(ProgramFailed, match=r"(?s)^\s*File \"<string>\", line 1.*SyntaxError"):
        run("print(417 * 382")
    with pytest.raises(ProgramFailed) as failed:
        run("print('so far'); 1 / 0")
    assert str(failed.value).startswith("so far\nTraceback") and str(failed.value).endswith("ZeroDivisionError: division by zero")


def test_a_timeout_kills_the_whole_process_group():
    started = time.monotonic()
    with pytest.raises(ProgramFailed, match=r"no result within 1s \(rollout.agent.python_timeout_seconds\)") as failed:
        run(FORK_SLEEPERS + "time.sleep(600)", timeout_seconds=1.0)
    assert time.monotonic() - started < 4
    pids = [int(line) for line in str(failed.value).splitlines()[:-1]]
    assert len(pids) == 3 and all_gone(pids)


def test_what_a_program_leaves_running_ends_with_it():
    # the sleepers hold the output pipes open: the call must not wait for them, and they must not outlive it
    started = time.monotonic()
    pids = [int(line) for line in run(FORK_SLEEPERS).split()]
    assert time.monotonic() - started < 3
    assert len(pids) == 3 and all_gone(pids)


def test_the_memory_limit_cuts_an_allocation():
    assert run("print(len(bytearray(32 << 20)))") == f"{32 << 20}\n"  # under the limit: it runs
    with pytest.raises(ProgramFailed, match="MemoryError"):
        run("print(len(bytearray(512 << 20)))")


def test_the_cpu_limit_ends_a_busy_program():
    with pytest.raises(ProgramFailed, match=r"over its CPU-time limit \(1s, rollout.agent.tool_cpu_seconds\)"):
        run("while True: pass", cpu_seconds=1)


def test_output_past_the_cap_is_cut_and_the_program_stopped():
    started = time.monotonic()
    text = run("while True: print('x' * 50)", output_bytes=120)
    assert time.monotonic() - started < 3  # stopped at the cap, not at the timeout
    printed, note = text.rsplit("\n[", 1)
    assert len(printed.encode()) == 120 and note.startswith("output cut at 120 bytes")


def test_the_program_gets_a_fresh_directory_and_none_of_the_callers_environment(monkeypatch):
    monkeypatch.setenv("TIDAL_SECRET_FOR_TEST", "x")
    env, cwd = run("import os; print(sorted(os.environ)); print(os.getcwd())").splitlines()
    assert env == "['HOME', 'LC_ALL', 'PATH', 'TMPDIR']"
    assert cwd != os.getcwd() and not Path(cwd).exists()  # removed after the call


def test_the_run_sets_the_limits_and_the_model_sees_only_the_code():
    cfg = config_from_dict(
        {
            "rollout": {"agent": {"env": "tools", "tools": ["python"], "python_timeout_seconds": 2, "tool_memory_mb": 300, "tool_output_bytes": 99}},
            "eval": {"enabled": False},
        }
    )
    fixed = run_arguments("python", cfg.rollout.agent)
    assert fixed == {"timeout_seconds": 2.0, "cpu_seconds": 60, "memory_mb": 300, "output_bytes": 99}
    assert run_arguments("calc", cfg.rollout.agent) == {}
    tool = resolve_tool("python", fixed)
    assert tool.parameters["properties"].keys() == {"code"} and tool.parameters["required"] == ["code"]
    refused = tool({"code": "print(1)", "timeout_seconds": 1000})
    assert refused.error and "unknown argument(s) ['timeout_seconds']" in refused.text
    cut = tool({"code": "print('y' * 500)"})
    assert not cut.error and "output cut at 99 bytes" in cut.text  # the run's output_bytes reached the call


def test_its_deadline_must_come_before_the_tool_process_timeout():
    with pytest.raises(ConfigError, match="python_timeout_seconds .30. must be under rollout.agent.tool_timeout_seconds .30."):
        config_from_dict({"rollout": {"agent": {"env": "tools", "tools": ["python"], "python_timeout_seconds": 30}}, "eval": {"enabled": False}})


def test_in_the_tool_process_errors_and_limits_reach_the_model():
    factory = EnvironmentFactory.from_names(
        "tools", ["python"], isolation=ToolLimits(timeout_seconds=10, memory_mb=512), fixed={"python": {**LIMITS, "timeout_seconds": 1.0}}
    )
    try:
        tool = factory.tools[0]
        assert tool.host is not None and tool({"code": "print(6 * 7)"}).text == "42\n"
        failed = tool({"code": "import time; time.sleep(60)"})
        assert failed.error and failed.failure is None  # the program's deadline, not the process's: the host lives on
        assert failed.text == "error: python raised ProgramFailed: no result within 1s (rollout.agent.python_timeout_seconds); the program was killed"
        assert tool({"code": "print(len(bytearray(400 << 20)))"}).text.endswith("MemoryError")
        assert factory.host.processes[0].started == 1
    finally:
        factory.close()


def test_the_host_runs_the_built_in_by_name():
    host = ToolHost(["python"], ToolLimits(memory_mb=512))
    try:
        assert host.isolate(resolve_tool("python", LIMITS))({"code": "print(2 ** 10)"}).text == "1024\n"
    finally:
        host.close()

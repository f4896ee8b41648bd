"""The built-in `python` tool: runs the model's program in a fresh interpreter and returns what it prints.

The program runs in a child of the process that calls the tool (for rollout.agent.tools, the tool host:
tidal.envs.isolation), so it inherits that process's sandbox. Each call gets a fresh `python -I -S`
(no site-packages, no user site, no PYTHON* variables), stdin closed, a minimal environment, and a
temporary working directory removed after the call. The child leads a process group of its own:
when the call ends, in time or not, the whole group is killed, so a program that forks sleepers
leaves nothing behind (a process that calls setsid itself escapes the group; the sandbox around the
tool host bounds the whole tree). RLIMIT_AS and RLIMIT_CPU are set in the child before the
program's interpreter starts, and what it prints is read up to a byte cap: past it the program is
stopped and its output cut.

The limits are arguments the run fixes (not the model): `tidal.envs.tools.run_arguments` fills them
from rollout.agent.python_timeout_seconds, tool_cpu_seconds, tool_memory_mb and tool_output_bytes.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ERROR_TAIL_BYTES = 1024  # of stderr: a traceback's last lines say what went wrong
MAX_CODE_BYTES = 64 << 10  # the program travels as one argv string (Linux caps one at 128 KiB)
NO_OUTPUT = "(no output)"  # said rather than an empty message: a program that forgot to print

# The first interpreter only sets the limits and replaces itself with the program's: rlimits must be
# set in the child before the program runs, and Popen's preexec_fn is not safe in a threaded process.
# The parent-death signal (prctl PR_SET_PDEATHSIG = 1, SIGKILL) ends the program with the process
# that called the tool, however that one ends.
_LAUNCHER = """\
import os, resource, sys
parent, cpu, memory = (int(a) for a in sys.argv[1:4])
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
except Exception:
    pass
if os.getppid() != parent:
    os._exit(1)
if cpu:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
if memory:
    resource.setrlimit(resource.RLIMIT_AS, (memory << 20, memory << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-X", "utf8", "-c", sys.argv[4]])
"""


class ProgramFailed(Exception):
    """The program exited with an error, was killed, or ran past its time: the text is what the model reads."""


@dataclass(frozen=True)
class ProgramRun:
    stdout: bytes  # at most the cap
    stderr_tail: bytes  # the last ERROR_TAIL_BYTES
    returncode: int  # negative: the signal that ended it
    timed_out: bool  # killed at the deadline
    cut: bool  # stdout passed the cap: the program was stopped there


def python(code: str, timeout_seconds: float = 10.0, cpu_seconds: int | None = 10, memory_mb: int | None = 1024, output_bytes: int = 4096) -> str:
    """Runs a Python program and returns what it prints.

    Args:
        code: The program, for example "print(417 * 382)".
        timeout_seconds: Wall-clock limit (set by the run, not the model).
        cpu_seconds: CPU-time limit (set by the run, not the model).
        memory_mb: Address-space limit (set by the run, not the model).
        output_bytes: Most bytes of output read (set by the run, not the model).
    """
    if len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
        raise ProgramFailed(f"the program is over {MAX_CODE_BYTES} bytes")
    if "\x00" in code:
        raise ProgramFailed("the program contains a NUL character")
    run = run_program(code, timeout_seconds, cpu_seconds, memory_mb, output_bytes)
    return report(run, timeout_seconds, cpu_seconds, output_bytes)


def report(run: ProgramRun, timeout_seconds: float, cpu_seconds: int | None, output_bytes: int) -> str:
    """What the model reads: the output of a program that ran; ProgramFailed with its output and error tail otherwise."""
    printed = run.stdout.decode("utf-8", "replace")
    if run.cut:
        return f"{printed}\n[output cut at {output_bytes} bytes (rollout.agent.tool_output_bytes); the program was stopped]"
    if run.timed_out:
        raise ProgramFailed(_joined(printed, f"no result within {timeout_seconds:g}s (rollout.agent.python_timeout_seconds); the program was killed"))
    if run.returncode == -signal.SIGXCPU:
        raise ProgramFailed(_joined(printed, f"over its CPU-time limit ({cpu_seconds}s, rollout.agent.tool_cpu_seconds)"))
    if run.returncode < 0:
        raise ProgramFailed(_joined(printed, f"killed by {signal.Signals(-run.returncode).name}"))
    if run.returncode > 0:
        tail = run.stderr_tail.decode("utf-8", "replace").strip() or f"exit code {run.returncode}"
        raise ProgramFailed(_joined(printed, tail))
    return printed or NO_OUTPUT


def _joined(printed: str, problem: str) -> str:
    return f"{printed.rstrip()}\n{problem}" if printed.strip() else problem


def program_command(code: str, cpu_seconds: int | None, memory_mb: int | None) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), str(cpu_seconds or 0), str(memory_mb or 0), code]


def program_env(home: str) -> dict[str, str]:
    """The program's whole environment: nothing of the caller's (no credentials, no run paths)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8"}


def run_program(code: str, timeout_seconds: float, cpu_seconds: int | None, memory_mb: int | None, output_bytes: int) -> ProgramRun:
    """`code` in a child interpreter with the limits; its process group is killed when this returns."""
    with tempfile.TemporaryDirectory(prefix="tidal-python-", ignore_cleanup_errors=True) as cwd:
        proc = subprocess.Popen(
            program_command(code, cpu_seconds, memory_mb),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=program_env(cwd),
            start_new_session=True,
        )
        try:
            stdout, stderr, timed_out, cut = collect(proc, time.monotonic() + timeout_seconds, output_bytes)
        finally:
            kill_group(proc.pid)  # before the directory goes: a leftover process could still write there
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    return ProgramRun(bytes(stdout), bytes(stderr), proc.returncode, timed_out, cut)


def collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytearray, bytearray, bool, bool]:
    """The program's stdout (up to `cap` bytes) and stderr's tail, until both pipes close or the
    deadline; a leftover process that holds the pipes open is killed once the program has exited."""
    stdout, stderr = bytearray(), bytearray()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    open_fds = [out_fd, err_fd]
    while open_fds:
        if exited(proc.pid):
            kill_group(proc.pid)  # what it started ends with it, and the pipes close
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            kill_group(proc.pid)
            return stdout, stderr, True, False
        for fd in select.select(open_fds, [], [], min(remaining, 0.1))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
            elif fd == out_fd:
                stdout += chunk
                if len(stdout) > cap:
                    kill_group(proc.pid)
                    return stdout[:cap], stderr, False, True
            else:
                stderr += chunk
                del stderr[:-ERROR_TAIL_BYTES]
    return stdout, stderr, False, False


def exited(pid: int) -> bool:
    """Whether the program has exited, without reaping it: its pid, and so its process group's id,
    stay taken until proc.wait(), so killing the group never reaches a stranger's."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already

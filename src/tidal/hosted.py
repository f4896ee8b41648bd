"""User code in a process of the worker's own: a hang, a crash, `sys.exit` or a flood in it costs one
call, never the worker. The reward host (`tidal.rewards.host`), the tool host (`tidal.envs.host`) and
the environment host (`tidal.envs.env_host`) are built from the two halves here.

Parent side, `HostProcess`: starts `python -m MODULE ARG...` (a fresh interpreter) and feeds it JSON
lines over stdin; nothing is pickled. A call that outlives its timeout, a process that dies, or a
reply over the byte cap fails that call (`HostCallError`) and the process is killed; the next call
starts a new one.

Host side, `serve`: the protocol has the process's real stdout to itself (user code that prints
writes to stderr, the worker's log, at most `PRINT_CHARS` a call), the process ends with its parent
(SIGKILL from the kernel on Linux, however the parent ended; a polling thread elsewhere), it leaves
no core file, and optional rlimits bound its memory (RLIMIT_AS, from the start)
and each call's CPU time (RLIMIT_CPU, re-armed before every call: SIGXCPU ends the process)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tidal import sandbox
from tidal.parentdeath import set_parent_death_signal

log = logging.getLogger(__name__)

STARTUP_SECONDS = 120.0  # importing a user's module may load a model of its own
MAX_REPLY_BYTES = 8 << 20  # one reply line; a longer one is a broken host, replaced
PRINT_CHARS = 64 << 10  # what user code may print per call; the rest is dropped, with a line saying how much
PARENT_ENV = "TIDAL_HOST_PARENT"  # the pid a host belongs to: one whose parent is already gone when it starts exits

# Every host process is started on this one thread, which lives as long as the process: the kernel's
# parent-death signal follows the thread that started a child, and calls come from pool threads that may end.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-host-spawner")


class HostStartError(ValueError):
    """The host process could not load its functions, or did not start in time."""


class HostCallError(Exception):
    """One call failed in the host's process: `kind` is Timeout, ProcessDied or ReplyTooLarge (the
    process was replaced), or the exception type user code raised (it was not)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class LineTooLong(Exception):
    pass


class LineReader:
    """Lines from a pipe with a deadline (select + os.read: a hung writer never blocks the reader)."""

    def __init__(self, fd: int, max_bytes: int = MAX_REPLY_BYTES):
        self.fd, self.buffer, self.max_bytes = fd, b"", max_bytes

    def line(self, deadline: float) -> bytes | None:
        """The next line; None at EOF; TimeoutError past `deadline` (time.monotonic()); LineTooLong
        past `max_bytes`."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.max_bytes:
                raise LineTooLong
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        if len(line) > self.max_bytes:
            raise LineTooLong
        return line


def exit_cause(code: int) -> str:
    if code == -signal.SIGXCPU:
        return "over its CPU-time limit"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return "a crash, sys.exit or os._exit"


class HostProcess:
    """One host process (`python -m module *args`); started at the first call, replaced after a failure.
    `timeout_key` names the config key of `timeout` in the error a timeout gives. It runs in the
    sandbox of `policy` (tidal.sandbox; the process's current policy when None), and `memory_mb`
    bounds the memory of its whole tree where the machine gives a control group or the watch runs."""

    def __init__(
        self,
        module: str,
        args: list[str],
        timeout: float,
        timeout_key: str,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        memory_mb: int | None = None,
        policy: sandbox.SandboxPolicy | None = None,
    ):
        self.command = [sys.executable, "-m", module, *args]
        self.timeout, self.timeout_key, self.max_reply_bytes = timeout, timeout_key, max_reply_bytes
        self.memory_mb, self.policy = memory_mb, policy
        self.proc: subprocess.Popen | None = None
        self.reader: LineReader | None = None
        self.box: sandbox.HostBox | None = None
        self.stderr: CappedOutput | None = None
        self.watching: threading.Event | None = None
        self.started = 0  # processes started so far (a replacement is the second one on)
        self.ready = False  # the running process has said it loaded its functions
        self.closed = False  # close() was called: no call starts a process again
        self.lock = threading.Lock()

    def prestart(self) -> None:
        """Starts the process now, without waiting for it: its interpreter and the user's imports
        then overlap with the caller's own start-up (a worker's model load); the first call waits."""
        with self.lock:
            if self.proc is None:
                self._spawn()

    def _spawn(self) -> None:
        if self.closed:
            raise HostCallError("Closed", "its worker is shutting down")
        policy = self.policy or sandbox.current()
        self.box = sandbox.open_box(policy, self.memory_mb)
        paths = sandbox.import_paths(os.getcwd(), sys.path)
        env = sandbox.host_environment(policy, os.environ, self.box.home, paths) if policy.enabled else dict(os.environ)
        env[sandbox.SANDBOX_ENV] = self.box.spec(policy, paths)  # unconfined, it still joins its control group
        env[PARENT_ENV] = str(os.getpid())
        popen = functools.partial(
            subprocess.Popen, self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
        )
        if policy.enabled:
            popen = functools.partial(popen, cwd=self.box.home)
        self.proc = _spawner.submit(popen).result()
        self.box.pid = self.proc.pid
        self.stderr = CappedOutput(self.proc.stderr, PRINT_CHARS + (4 << 10))  # room for the host's own line on what it dropped
        if not self.box.cgroups:
            self.watching = threading.Event()
            threading.Thread(target=self.box.watch, args=(self.memory_mb, self.watching), daemon=True).start()
        self.reader = LineReader(self.proc.stdout.fileno(), self.max_reply_bytes)
        self.ready = False
        self.started += 1

    def _start(self) -> None:
        """Spawns the process unless `prestart` did, and waits for its ready line."""
        if self.proc is None:
            self._spawn()
        try:
            first = self.reader.line(time.monotonic() + max(STARTUP_SECONDS, self.timeout))
        except (TimeoutError, LineTooLong):
            self.stop()
            raise HostStartError(f"{self.command[2]}: its process did not start within {STARTUP_SECONDS:.0f}s") from None
        reply = json.loads(first) if first else {"fatal": f"its process exited with code {self.proc.wait()} while starting"}
        if "fatal" in reply:
            self.stop()
            raise HostStartError(reply["fatal"])
        warn_once(self.command[2], reply.get("unconfined", []))
        self.ready = True

    def stop(self) -> None:
        """Kills the host and everything it started, and removes its directory and control group."""
        if self.box is not None:
            self.box.kill_tree()  # first: a host killed alone leaves its children to the init process, out of reach
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
        if self.watching is not None:
            self.watching.set()
        if self.box is not None:
            self.box.close()
        if self.stderr is not None:
            self.stderr.join()  # its last lines, now that no process of the tree holds the pipe
        self.proc = self.reader = self.box = self.stderr = self.watching = None
        self.ready = False

    def close(self) -> None:
        """For good, from any thread: a call in flight fails (its process is killed under it) and no
        call starts a process again."""
        self.closed = True
        proc = self.proc
        if proc is not None:
            proc.kill()
        with self.lock:
            self.stop()

    def load(self) -> None:
        """Starts the process unless it runs, and waits until it has loaded its functions (HostStartError when it cannot)."""
        with self.lock:
            if self.proc is None or not self.ready:
                self._start()

    def request(
        self, message: dict, timeout: float | None = None, asked: Callable[[dict], dict] | None = None, whole: tuple[float, str] | None = None
    ) -> dict:
        """Sends one call and returns the host's reply; HostCallError when the process failed it (the
        process is then replaced at the next call). `timeout`: this call's, instead of the host's.
        `asked`: answers the questions the host puts mid-call (`serve(..., asks=True)`); the timeout
        counts the host's own time between them, not the time `asked` takes. `whole`: (seconds, the
        key that sets them), a bound on the whole call, questions included (a host that asks for ever)."""
        timeout = self.timeout if timeout is None else timeout
        end = time.monotonic() + whole[0] if whole else float("inf")
        with self.lock:
            if self.proc is None or not self.ready:
                self._start()
            self.stderr.new_call()
            try:
                self._send(message)
                line = self.reader.line(min(time.monotonic() + timeout, end))
                while line is not None and asked is not None and line.startswith(ASK_PREFIX):
                    self._send(answer_question(asked, line))
                    line = self.reader.line(min(time.monotonic() + timeout, end))
            except TimeoutError:
                self.stop()
                seconds, key = (whole[0], f"{whole[1]}, its questions included") if time.monotonic() >= end else (timeout, self.timeout_key)
                raise HostCallError("Timeout", f"no answer within {seconds:g}s ({key}); its process was replaced") from None
            except LineTooLong:
                self.stop()
                raise HostCallError("ReplyTooLarge", f"its answer was over {self.max_reply_bytes} bytes; its process was replaced") from None
            except BrokenPipeError:
                line = None
            if line is None:
                code = self.proc.wait()
                over = self.box.over
                self.stop()
                if self.closed:
                    raise HostCallError("Closed", "its worker is shutting down")
                cause = over or exit_cause(code)
                raise HostCallError("ProcessDied", f"its process exited with code {code} ({cause}); it was replaced")
            self.box.end_children()  # what the call started ends with it
        return json.loads(line)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()


ASK_PREFIX = b'{"ask":'  # a line a host writes mid-call: a question for its parent, not the call's reply


def answer_question(asked: Callable[[dict], dict], line: bytes) -> dict:
    """The parent's answer to one question of its host; a question it cannot answer is an error the host reads."""
    try:
        return asked(json.loads(line)["ask"])
    except Exception as err:  # noqa: BLE001 - the host asked something malformed, or answering it failed: the host is told
        return {"error": f"{type(err).__name__}: {err}"}


_warned: set[tuple[str, str]] = set()


def warn_once(module: str, unconfined: list[str]) -> None:
    """One warning per host kind and missing layer, in the worker's log."""
    text = "; ".join(unconfined)
    if text and (module, text) not in _warned:
        _warned.add((module, text))
        log.warning("user code in %s runs without: %s (the kernel refused it; docs/agents.md#what-user-code-can-do)", module, text)


class CappedOutput:
    """A host's stderr (user code's prints and whatever its children write to their inherited
    descriptors), copied to the worker's stderr up to `limit` bytes a call; the rest is dropped,
    with one line saying how much.

    Only the copying thread reads the pipe and starts a new call's count: when asked, it first
    drains what the pipe already holds (the last call's writes still in flight), so a flood that
    fills the pipe is charged to the call that wrote it, not to the next one."""

    def __init__(self, pipe, limit: int):
        self.pipe, self.limit, self.written, self.dropped = pipe, limit, 0, 0
        self.wake_read, self.wake_write = os.pipe()
        self.reset_done = threading.Event()
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        fd = self.pipe.fileno()
        try:
            while True:
                readable, _, _ = select.select([fd, self.wake_read], [], [])
                if fd in readable and not self._take(fd):
                    break
                if self.wake_read in readable:
                    os.read(self.wake_read, 64)
                    while select.select([fd], [], [], 0)[0] and self._take(fd):
                        pass  # what the last call left in the pipe is the last call's
                    self._start_count()
        finally:
            self.pipe.close()
            self.reset_done.set()  # nobody waits on a thread that has ended

    def _take(self, fd: int) -> bool:
        chunk = _read_some(fd)
        kept = chunk[: max(0, self.limit - self.written)]
        self.written += len(kept)
        self.dropped += len(chunk) - len(kept)
        if kept:
            _write_all(2, kept)
        return bool(chunk)

    def _start_count(self) -> None:
        if self.dropped:
            _write_all(2, f"\n[{self.dropped} more bytes written by user code were dropped: over {self.limit} a call]\n".encode())
        self.written, self.dropped = 0, 0
        self.reset_done.set()

    def new_call(self) -> None:
        if not self.thread.is_alive():
            return
        self.reset_done.clear()
        try:
            os.write(self.wake_write, b"x")
        except OSError:
            return
        self.reset_done.wait(timeout=5)

    def join(self) -> None:
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            for end in (self.wake_read, self.wake_write):
                with contextlib.suppress(OSError):
                    os.close(end)
            self.wake_read = self.wake_write = -1


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass


# --- the host's side ---------------------------------------------------------------------------


def tie_to_parent() -> None:
    """Makes this host end with the process that started it: the kernel's SIGKILL when its parent
    is gone (Linux: also while user code holds the interpreter in C), and a polling thread that
    exits (elsewhere, and a second line of defence). A parent already gone by now: exits at once."""
    parent = int(os.environ.pop(PARENT_ENV, os.getppid()))
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Exits when the worker is gone, even while a user function hangs in Python (the closed stdin is
    seen only between calls)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class CappedPrints(io.TextIOBase):
    """sys.stdout and sys.stderr of user code: written to the real stderr up to `limit` characters a
    call; the rest is dropped and `end_call` writes one line that says how much."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.written, self.dropped = stream, limit, 0, 0

    def write(self, text: str) -> int:
        kept = text[: max(0, self.limit - self.written)]
        if kept:
            self.stream.write(kept)
        self.written += len(kept)
        self.dropped += len(text) - len(kept)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def end_call(self) -> None:
        if self.dropped:
            self.stream.write(f"\n[{self.dropped} more characters printed by one call were dropped: over {self.limit} a call]\n")
            self.stream.flush()
        self.written = self.dropped = 0


def limit_memory(megabytes: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash or SIGXCPU in user code leaves no core file in the run's directory
    if megabytes:
        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))


def reap_children() -> None:
    """Waits for what the last call started (its worker killed it after the call): a zombie would
    count against sandbox.processes for the rest of the host's life."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def limit_next_call_cpu(seconds: int | None) -> None:
    """RLIMIT_CPU counts the process's whole life: the next call gets `seconds` more than used so far."""
    if seconds:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime) + 1 + seconds
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


class Parent:
    """The host's side of the protocol: replies, and questions to the parent mid-call (`ask`)."""

    def __init__(self, protocol, replies):
        self.protocol, self.replies = protocol, replies

    def say(self, message: dict) -> None:
        self.protocol.write(json.dumps(message, ensure_ascii=False) + "\n")

    def ask(self, question: dict) -> dict:
        """Puts `question` to the parent and waits for its answer (a parent gone: this process ends)."""
        self.say({"ask": question})
        line = self.replies.readline()
        if not line:
            os._exit(0)
        return json.loads(line)


def serve(load: Callable[..., Callable[[dict], dict]], memory_mb: int | None = None, cpu_seconds: int | None = None, asks: bool = False) -> int:
    """The host's main loop. `load()` imports the user's functions and returns the function that
    answers one call (a dict in, a JSON-able dict out); after it the host says `{"ready": true}`, or
    `{"fatal": message}` when it raised, and exits. `asks`: `load(ask)`, where `ask(question) ->
    answer` puts a question to the parent in the middle of a call (the parent's `request(asked=...)`)."""
    unconfined = sandbox.enter()  # first: user namespaces need a process of one thread
    tie_to_parent()
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(2, 1)
    prints = CappedPrints(sys.__stderr__, PRINT_CHARS)
    sys.stdout = sys.stderr = prints
    limit_memory(memory_mb)
    parent = Parent(protocol, sys.stdin)
    try:
        answer = load(parent.ask) if asks else load()
    except Exception as err:  # noqa: BLE001 - user imports: the parent reports it
        parent.say({"fatal": str(err) or type(err).__name__})
        return 1
    parent.say({"ready": True, "unconfined": unconfined})
    for line in iter(sys.stdin.readline, ""):
        reap_children()
        limit_next_call_cpu(cpu_seconds)
        reply = answer(json.loads(line))
        prints.end_call()
        parent.say(reply)
    return 0

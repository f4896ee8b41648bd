"""The sandbox user code runs in: rollout.agent.tools, user reward functions and user environment
classes (tidal.hosted's host processes) get nothing of the run.

The worker starts each host with an allow-listed environment (none of the run's secrets or tokens),
a working directory, HOME and TMPDIR of its own (removed with the host), in a session and a process
group of its own, and, where the machine allows it, in a control group that bounds the memory and
the number of processes of everything the host starts. The host, before it imports any user code,
confines itself (`enter`): a network namespace of its own (no route to the run's NATS or MLflow),
Landlock (read and execute only the interpreter, the import paths and the system's directories,
never the run directory; write only its own directory; no TCP; no signal to, and no /proc view
into, any process outside its sandbox), and no capabilities. Each layer the kernel refuses is named
in one warning; the others still hold.

This module is the parent's side; the host's (`enter`) is tidal.confine. Everything here is Linux;
elsewhere the host runs with the environment and directory rules only."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tidal.confine import SANDBOX_ENV, enter, readable_roots  # noqa: F401 - the host's side (tidal.confine)

PASS_ENV = "TIDAL_SANDBOX_PASS_ENV"  # names (comma-separated) a wrapper adds to sandbox.env: CI tags, test markers
# What any process needs and tells nothing of the run: the locale, the time zone, the thread counts.
BASE_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
WATCH_SECONDS = 0.1  # how often a tree without a control group is measured


@dataclass(frozen=True)
class SandboxPolicy:
    """sandbox.* of the config, and the run directories no user code may see."""

    enabled: bool = True
    env: tuple[str, ...] = ()  # variables passed through, by name
    read_paths: tuple[str, ...] = ()  # readable beside the interpreter, the import paths and the system's directories
    write_paths: tuple[str, ...] = ()  # writable beside the host's own directory
    network: bool = False
    processes: int = 64  # at once, in one host's tree (the host itself counted)
    hidden: tuple[str, ...] = ()  # never readable: the run directory

    @classmethod
    def from_config(cls, cfg, hidden: tuple[str, ...] = ()) -> SandboxPolicy:
        return cls(cfg.enabled, tuple(cfg.env), tuple(cfg.read_paths), tuple(cfg.write_paths), cfg.network, cfg.processes, hidden)


_policy = SandboxPolicy()


def configure(policy: SandboxPolicy) -> None:
    """The policy for every host this process starts from now on (a role sets it from its config and run)."""
    global _policy
    _policy = policy


def current() -> SandboxPolicy:
    return _policy


def confine_user_code(cfg, run_root: str | Path) -> None:
    """Every tool and reward process this process starts from now on runs in cfg.sandbox, blind to the run directory
    and to the folders of the snapshot keys' files where the config names others (a pod's mounted Secret)."""
    key_files = [f for f in (cfg.weights.public_key_file, cfg.weights.signing_key_file) if f]
    hidden = [str(Path(run_root).resolve()), *(str(Path(f).parent.resolve()) for f in key_files)]
    configure(SandboxPolicy.from_config(cfg.sandbox, hidden=tuple(dict.fromkeys(hidden))))


# --- the parent's side ---------------------------------------------------------------------------


def is_run_secret(name: str) -> bool:
    """The run's own credentials (signing keys, NATS and MLflow credentials, served rewards' API keys):
    never passed to user code, whatever a config or PASS_ENV names."""
    return name.startswith(("TIDAL_", "MLFLOW_", "NATS_")) and any(word in name for word in ("KEY", "TOKEN", "PASSWORD", "USERNAME", "SECRET"))


def passed_names(policy: SandboxPolicy, environ: dict) -> list[str]:
    extra = [n.strip() for n in environ.get(PASS_ENV, "").split(",") if n.strip()]
    return [n for n in (*BASE_ENV, *policy.env, *extra) if not is_run_secret(n)]


def host_environment(policy: SandboxPolicy, environ: dict, home: Path, import_paths: list[str]) -> dict:
    """The whole environment of a host: the allow-listed names that are set, a HOME and TMPDIR of its
    own, and PYTHONPATH naming where user modules are found (its working directory is not the worker's)."""
    env = {name: environ[name] for name in passed_names(policy, environ) if name in environ}
    env.setdefault("PATH", os.defpath)
    tmp = home / "tmp"
    env.update(HOME=str(home), TMPDIR=str(tmp), XDG_CACHE_HOME=str(home / ".cache"), PYTHONPATH=os.pathsep.join(import_paths))
    return env


def import_paths(cwd: str, path: list[str]) -> list[str]:
    """Where the worker finds modules: its working directory first (where `module:function` names resolve),
    then its sys.path; entries that are not directories or zip files are dropped."""
    found = []
    for entry in [cwd, *path]:
        entry = os.path.abspath(entry or cwd)
        if entry not in found and os.path.exists(entry):
            found.append(entry)
    return found


@dataclass
class HostBox:
    """One host's directory and, where the machine gives one, its control group(s); `close` kills
    everything in them and removes them."""

    home: Path
    cgroups: list[Path] = field(default_factory=list)
    memory_bytes: int | None = None
    processes: int = 64
    pid: int | None = None  # the host, once started: its session's id (start_new_session)
    over: str | None = None  # why the watch killed the tree

    def spec(self, policy: SandboxPolicy, paths: list[str]) -> str:
        return json.dumps(
            {
                "home": str(self.home),
                "cgroups": [str(c) for c in self.cgroups],
                "read": sorted({*paths, *policy.read_paths, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}),
                "write": list(policy.write_paths),
                "hidden": list(policy.hidden),
                "confine": policy.enabled,
                "network": policy.network,
                "processes": policy.processes,
            }
        )

    def members(self) -> list[int]:
        """Every live process of the tree: the control group's; without one, the host's session and
        the host's descendants (a process that left the session and lost its parent escapes this)."""
        if self.cgroups:
            return cgroup_members(self.cgroups[0])
        if self.pid is None:
            return []
        return sorted({*session_members(self.pid), *descendants(self.pid)})

    def kill_tree(self, spare_host: bool = False) -> None:
        """Stops every process of the tree (SIGSTOP: a stopped process forks no more, and its children
        stay its children), again until no new one shows, then kills them all and waits until they
        have ended (the host's next call must not meet them still running). Each round waits until
        its signals have taken effect: a process signalled on another core may still fork before it
        stops, and a child it made after the next look would outlive the tree."""
        stopped: set[int] = set()
        for _ in range(100):
            new = {p for p in self.members() if not (spare_host and p == self.pid)} - stopped
            if not new:
                break
            for pid in new:
                _signal(pid, signal.SIGSTOP)
            wait_stopped(new)
            stopped |= new
        for pid in stopped:
            _kill(pid)
        wait_ended(stopped)

    def end_children(self) -> None:
        """Kills every process of the tree but the host: what a call started ends with the call."""
        self.kill_tree(spare_host=True)

    def close(self) -> None:
        """Kills what is left of the tree, removes the group(s) and the directory."""
        self.kill_tree()
        for group in self.cgroups:
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # its last processes are still exiting
                    for pid in cgroup_members(group):
                        _kill(pid)
                    time.sleep(0.02)
        shutil.rmtree(self.home, ignore_errors=True)

    def watch(self, memory_mb: int | None, stop: threading.Event) -> None:
        """Without a control group: measures the session every WATCH_SECONDS and kills the whole tree
        when it holds more processes or memory (resident) than allowed."""
        limit = memory_mb << 20 if memory_mb else None
        while not stop.wait(WATCH_SECONDS):
            members = self.members()
            if len(members) > self.processes:
                self.over = f"over {self.processes} processes (sandbox.processes)"
            elif limit and sum(resident_bytes(p) for p in members) > limit:
                self.over = f"over {memory_mb} MB resident, its processes together"
            else:
                continue
            self.kill_tree()


BOX_PREFIX = "tidal-sandbox-"
_BOX_NAME = re.compile(rf"^{BOX_PREFIX}(\d+)-")


def open_box(policy: SandboxPolicy, memory_mb: int | None) -> HostBox:
    home = Path(tempfile.mkdtemp(prefix=f"{BOX_PREFIX}{os.getpid()}-"))
    (home / "tmp").mkdir()
    os.chmod(home, 0o700)
    box = HostBox(home, processes=policy.processes, memory_bytes=memory_mb << 20 if memory_mb else None)
    box.cgroups = make_cgroups(home.name, box.memory_bytes, policy.processes)
    sweep_once(tuple(g.parent for g in box.cgroups))
    return box


@functools.cache
def sweep_once(cgroup_parents: tuple[Path, ...]) -> None:
    """Removes what hosts of workers that died by SIGKILL left (their directories, their empty control
    groups): a box's name carries its worker's pid."""
    for parent in (Path(tempfile.gettempdir()), *cgroup_parents):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for entry in entries:
            match = _BOX_NAME.match(entry.name)
            if match and not _alive(int(match.group(1))):
                try:
                    entry.rmdir() if parent in cgroup_parents else shutil.rmtree(entry, ignore_errors=True)
                except OSError:
                    pass


def wait_ended(pids: set[int], seconds: float = 2.0) -> None:
    """Until each of `pids` has ended (a zombie has: its parent waits for it later), or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _running(pid)}
        if pids:
            time.sleep(0.002)


def wait_stopped(pids: set[int], seconds: float = 2.0) -> None:
    """Until each of `pids` is stopped (or ended), or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _state(pid) not in "TtZX"}
        if pids:
            time.sleep(0.001)


def _state(pid: int) -> str:
    """The process's state letter from /proc/PID/stat; "X" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _running(pid: int) -> bool:
    return _state(pid) not in "ZX"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid: int) -> None:
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def session_members(sid: int) -> list[int]:
    """Live processes whose session is `sid` (zombies aside): a host and what it started, unless
    one left the session (only a control group holds those)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """The live processes `pid` started, and theirs (from /proc/PID/task/*/children)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def resident_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def cgroup_members(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def own_cgroups() -> dict[str, str]:
    """This process's control group per controller ("" for the unified hierarchy), from /proc/self/cgroup."""
    found = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                found[name] = path
    except OSError:
        pass
    return found


def make_cgroups(name: str, memory_bytes: int | None, processes: int) -> list[Path]:
    """A control group (v2), or one per controller (v1, memory and pids), beside this process's own,
    with the tree's limits set; [] where none can be made (no delegation, another OS)."""
    mine = own_cgroups()
    root = Path("/sys/fs/cgroup")
    unified = root if (root / "cgroup.controllers").exists() else root / "unified"
    if "" in mine and {"memory", "pids"} <= set(_read(unified / mine[""].lstrip("/") / "cgroup.controllers").split()):
        group = unified / mine[""].lstrip("/") / name
        made = _make(group, {"memory.max": memory_bytes, "pids.max": processes, "memory.swap.max": 0 if memory_bytes else None})
        return [group] if made else []
    groups = []
    for controller, limits in (("memory", {"memory.limit_in_bytes": memory_bytes}), ("pids", {"pids.max": processes})):
        if controller not in mine or not (root / controller).is_dir():
            break
        group = root / controller / mine[controller].lstrip("/") / name
        if not _make(group, limits):
            break
        groups.append(group)
    else:
        return groups
    for group in groups:
        group.rmdir()
    return []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _make(group: Path, limits: dict) -> bool:
    try:
        group.mkdir()
    except OSError:
        return False
    try:
        for key, value in limits.items():
            if value is not None and (group / key).exists():
                (group / key).write_text(str(value))
    except OSError:
        group.rmdir()
        return False
    return True

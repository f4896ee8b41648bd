"""The sandbox's host side: what a host process (tidal.hosted.serve) does to itself before it imports
user code (`enter`), from the spec its parent (tidal.sandbox) left in its environment: join its control
group, leave the network (a network namespace of its own), Landlock (read and execute only the
interpreter, the import paths and the system's directories, never the run directory; write only its
own directory; no TCP; no signal to, and no /proc view into, any process outside its sandbox), and no
capabilities. Each layer the kernel refuses is returned, named; the others still hold."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from pathlib import Path

SANDBOX_ENV = "TIDAL_SANDBOX"  # the host's own spec (JSON), read and removed by `enter`
SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev")
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


def fs_rights(abi: int) -> int:
    """Every filesystem right Landlock knows at `abi` (each is then denied unless a rule grants it)."""
    last = {1: 12, 2: 13, 3: 14}.get(abi, 15)
    return (1 << (last + 1)) - 1


def readable_roots(roots: list[str], hidden: list[str]) -> list[str]:
    """`roots` with every `hidden` path carved out: a root that holds a hidden path is replaced by its
    entries, recursively, leaving out the one on the way to it (Landlock only grants; it cannot deny
    inside a grant). A root inside a hidden path is dropped; so is an entry that resolves into one."""
    hidden_real = [os.path.realpath(h) for h in hidden]

    def inside(path: str, top: str) -> bool:
        return path == top or path.startswith(top.rstrip("/") + "/")

    def expand(root: str) -> list[str]:
        real = os.path.realpath(root)
        if any(inside(real, h) for h in hidden_real):
            return []
        if not any(inside(h, real) for h in hidden_real):
            return [real]
        try:
            entries = sorted(os.listdir(real))
        except OSError:
            return []
        return [p for entry in entries for p in expand(os.path.join(real, entry))]

    found: list[str] = []
    for root in roots:
        if os.path.exists(root):
            found += [p for p in expand(root) if p not in found]
    return found


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (an older kernel, not enabled, not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, version)


def apply_landlock(read: list[str], write: list[str], network: bool) -> list[str]:
    """Restricts this process and all it starts; what the kernel's ABI cannot restrict is returned, named."""
    abi = landlock_abi()
    if abi == 0:
        return ["Landlock (no filesystem, signal or TCP restriction)"]
    libc = _libc()
    handled = fs_rights(abi)
    attr = _RulesetAttr(handled, 0, 0)
    size = 8
    missing = []
    if abi >= 4 and not network:
        attr.handled_access_net, size = NET_BIND_TCP | NET_CONNECT_TCP, 16
    elif not network:
        missing.append(f"TCP restriction (Landlock ABI {abi} < 4)")
    if abi >= 6:
        attr.scoped, size = SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET, 24
    else:
        missing.append(f"signal and abstract-socket scoping (Landlock ABI {abi} < 6)")
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return [f"Landlock ({os.strerror(ctypes.get_errno())})"]
    try:
        for paths, rights in ((read, FS_READ_FILE | FS_READ_DIR | FS_EXECUTE), (write, handled)):
            for path in paths:
                _add_rule(libc, ruleset, path, rights & handled)
        for device in DEVICE_FILES:
            _add_rule(libc, ruleset, device, (FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE) & handled)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            return [f"Landlock ({os.strerror(ctypes.get_errno())})"]
    finally:
        os.close(ruleset)
    return missing


def _add_rule(libc, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not os.path.isdir(path):
            rights &= FILE_ONLY
        rule = _PathBeneath(rights, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"Landlock rule for {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def leave_network() -> str | None:
    """A network namespace of this process's own (only a loopback that is down): no route anywhere.
    Root gets one directly, others inside a user namespace; None, or what the kernel said."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNET) == 0:
        return None
    first = os.strerror(ctypes.get_errno())
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return None
    return f"a network namespace ({first}; in a user namespace: {os.strerror(ctypes.get_errno())})"


def drop_capabilities() -> None:
    """No capability left, none to regain: root in a host is an ordinary user to the kernel."""
    libc = _libc()
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    number = SYS_CAPSET.get(os.uname().machine)
    if number is not None:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()
        libc.syscall(number, header, data)


def join_cgroups(groups: list[str]) -> None:
    for group in groups:
        Path(group, "cgroup.procs").write_text("0")


def enter(environ: dict | None = None) -> list[str]:
    """Confines this host before it imports user code (call it while the process has one thread: a
    user namespace needs that). Returns the layers the kernel refused, named; [] when all hold."""
    environ = os.environ if environ is None else environ
    raw = environ.pop(SANDBOX_ENV, None)
    if raw is None:
        return []
    spec = json.loads(raw)
    missing = []
    try:
        join_cgroups(spec["cgroups"])
    except OSError as err:
        missing.append(f"its control group ({err.strerror})")
    if not spec["cgroups"]:
        import resource

        if os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC: the worker's watch counts its processes
            resource.setrlimit(resource.RLIMIT_NPROC, (spec["processes"], spec["processes"]))
    if not spec["confine"]:
        return []
    if not sys.platform.startswith("linux"):
        return ["every kernel layer (not Linux)"]
    if not spec["network"]:
        refused = leave_network()
        if refused:
            missing.append(refused)
    read = readable_roots([*SYSTEM_READ, *spec["read"]], spec["hidden"])
    missing += apply_landlock(read, [spec["home"], *spec["write"]], spec["network"])
    drop_capabilities()
    return missing

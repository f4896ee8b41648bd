"""The run directory: its layout, its record of the run (run.json), its append-only logs of iterations
and groups, its lock (one launcher at a time), and where the optimizer checkpoint is (read by the
trainer and by the launcher, which imports no torch). The secrets kept in it: tidal.run_keys."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)
LOCK_FILE = "lock"


class RunDirError(ValueError):
    """The run directory cannot be used (a file, or in use by another launcher); one line."""


class RunDirLock:
    """An exclusive flock on `RUN_DIR/lock` for as long as the launcher runs. The launcher hands the
    open descriptor to its children (roles, nats-server), so the directory stays locked while any of
    them is alive, even if the launcher itself was killed."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        path = self.run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"run directory {self.run_dir} is in use by another `tidal run` ({describe_holder(holder)}): stop it, or use another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def held(self) -> bool:
        """Whether a launcher (or a process it started) holds the lock now; asks without taking it for long."""
        path = self.run_dir / LOCK_FILE
        if not path.is_file():
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing also lets go of a shared lock just taken
        return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def describe_holder(pid_text: str) -> str:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return f"launcher pid {pid_text} is gone, but a process it started still holds the lock"
    except PermissionError:
        pass
    return f"launcher pid {pid_text}"


@dataclass
class RunInfo:
    """Written once per run (run.json); every role reads it from the shared run directory."""

    run_id: str
    base_model: str
    tracking_uri: str
    mlflow_run_id: str


def new_run_id(run_dir: Path, unique_name: bool = False) -> str:
    """The run's id, which names its NATS streams and KV bucket: the directory's name, with a random
    suffix unless the name is unique by itself (a pipeline's run directory is named by its KFP job; a
    local `runs/arithmetic` is reused, and a server outside the run may still hold an old run's streams)."""
    name = Path(run_dir).name
    return name if unique_name else f"{name}-{uuid.uuid4().hex[:8]}"


class Records:
    """One of the run's append-only JSON-lines files; every reader and writer of run records goes
    through this class (one record per line; a blank line is skipped)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> list[dict]:
        return self.read_from(0)[0]

    def read_from(self, seen: int) -> tuple[list[dict], int]:
        """The records after the first `seen` lines, and the new line count: to follow a file as it grows.
        A last line without its newline is a record still being written (a reader can see an append
        half done), or one cut short: it is not read, nor counted."""
        if not self.path.is_file():
            return [], seen
        lines = self.path.read_text().split("\n")[:-1]  # the text after the last newline is not a whole record
        return [json.loads(line) for line in lines[seen:] if line.strip()], len(lines)

    def append(self, record: dict) -> None:
        self.append_many([record])

    def append_many(self, records: list[dict]) -> None:
        with self.path.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)

    def drop(self, drop: Callable[[dict], bool]) -> int:
        """Removes the records `drop` selects (replacing the file atomically); how many were removed."""
        if not self.path.is_file():
            return 0
        *lines, torn = self.path.read_text().split("\n")  # torn: what a writer killed mid-append left after the last newline
        kept = [line for line in lines if line.strip() and not drop(json.loads(line))]
        if len(kept) == len(lines) and not torn:
            return 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        return len(lines) - len(kept)


@dataclass
class RunDir:
    """The run directory: the one place that knows its layout. Launchers, roles, pipeline steps,
    reports and benchmarks take this handle instead of path strings.

    RUN_DIR/
      config.yaml        the resolved config every role reads (threads and workers as planned)
      run.json           RunInfo: run id, base model, MLflow run
      data.sha256.json   the digests of the data files the last start read (a resume compares them)
      metrics.jsonl      one record per iteration (the trainer's)
      groups.jsonl       one record per trained group
      eval.jsonl         the held-out curve (one record per evaluated version)
      summary.json       the result of a finished `tidal run`
      report.html        `tidal report`'s page
      mlflow.db          the run's MLflow store (unless tracking.uri names another)
      workers.request    the rollout worker count `tidal scale` asked the running launcher for
      weights/           the weight store (one snapshot per version)
      checkpoint/        optimizer checkpoints (vNNNNNN/ folders)
      logs/              one log (and pid file) per process of the run
      nats/              the embedded NATS server's JetStream store
      weights-signing-key  the trainer's Ed25519 private key (0600; read by trainer processes alone, tidal.run_keys)
      weights-public-key   its public key: every role that loads or checks a snapshot reads it
      weights-key        a run from before Ed25519 signing: its HMAC key, until a launch re-signs its snapshots
      nats-token         the embedded NATS server's token of this launch (0600): roles read it to log in
      reward-servers.json  {reward label: url} of the reward servers this launch started (`serve:` entries)
    """

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    config = property(lambda self: self.root / "config.yaml")
    info_file = property(lambda self: self.root / "run.json")
    data_digests = property(lambda self: self.root / "data.sha256.json")
    summary = property(lambda self: self.root / "summary.json")
    report = property(lambda self: self.root / "report.html")
    mlflow_store = property(lambda self: self.root / "mlflow.db")
    weights = property(lambda self: self.root / "weights")
    checkpoint = property(lambda self: self.root / "checkpoint")
    logs = property(lambda self: self.root / "logs")
    nats_store = property(lambda self: self.root / "nats")
    metrics = property(lambda self: Records(self.root / "metrics.jsonl"))
    groups = property(lambda self: Records(self.root / "groups.jsonl"))
    evals = property(lambda self: Records(self.root / "eval.jsonl"))
    workers_request = property(lambda self: self.root / "workers.request")
    signing_key_file = property(lambda self: self.root / "weights-signing-key")
    public_key_file = property(lambda self: self.root / "weights-public-key")
    hmac_key_file = property(lambda self: self.root / "weights-key")
    nats_token_file = property(lambda self: self.root / "nats-token")
    reward_servers_file = property(lambda self: self.root / "reward-servers.json")

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def pid_file(self, process: str) -> Path:
        return self.logs / f"{process}.pid"

    def stop_file(self, process: str) -> Path:
        """Why `process` stopped the run on purpose ({"code", "message"}): a trainer of several ranks exits
        through torchrun, whose own exit code (1) says only that a rank failed."""
        return self.logs / f"{process}.stop.json"

    def record_stop(self, process: str, code: int, message: str) -> None:
        """Writes `stop_file` (any rank may, all write the same); nothing where the run has no logs folder."""
        path = self.stop_file(process)
        if path.parent.is_dir():
            tmp = path.with_name(f"{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"code": code, "message": message}))
            tmp.replace(path)

    def recorded_stop(self, process: str) -> tuple[int, str] | None:
        """(code, message) from `stop_file`, if `process` wrote one."""
        try:
            record = json.loads(self.stop_file(process).read_text())
            return int(record["code"]), str(record["message"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def records(self, name: str) -> Records:
        return Records(self.root / name)

    def request_workers(self, count: int) -> None:
        """Asks the running launcher for `count` rollout workers (written atomically: it never reads half a number)."""
        tmp = self.workers_request.with_name(f".{self.workers_request.name}.{os.getpid()}")
        tmp.write_text(f"{count}\n")
        tmp.replace(self.workers_request)

    def requested_workers(self) -> int | None:
        """The rollout worker count `tidal scale` asked for; None when nothing was asked."""
        try:
            return int(self.workers_request.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def save_reward_servers(self, urls: dict[str, str]) -> None:
        """{reward label: url} of the reward servers a launch started, for its roles to read (replaced atomically,
        so a role never reads half of it, nor an earlier launch's ports)."""
        tmp = self.reward_servers_file.with_name(f".{self.reward_servers_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(urls, indent=1))
        tmp.replace(self.reward_servers_file)

    def reward_server_urls(self) -> dict[str, str]:
        """What save_reward_servers wrote; {} when this launch started no reward server."""
        return json.loads(self.reward_servers_file.read_text()) if self.reward_servers_file.is_file() else {}

    @property
    def started(self) -> bool:
        """Whether a run was prepared here (its run.json exists)."""
        return self.info_file.is_file()

    def info(self) -> RunInfo:
        if not self.info_file.is_file():
            raise FileNotFoundError(f"{self.info_file} not found: start the run with `tidal run` (or the pipeline's prepare step) first")
        return RunInfo(**json.loads(self.info_file.read_text()))

    def save_info(self, info: RunInfo) -> None:
        tmp = self.info_file.with_name(f".run.json.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(info), indent=1))
        tmp.replace(self.info_file)

    @property
    def run_id(self) -> str:
        return self.info().run_id

    def latest_checkpoint(self) -> Checkpoint | None:
        return latest_checkpoint(self.checkpoint)

    def checkpoint_version(self) -> int:
        """The iteration a (re-)run starts from: the last checkpointed boundary, else 0."""
        found = self.latest_checkpoint()
        return found.next_version if found else 0

    def rehome_moved_store(self, locked: bool = False) -> Path | None:
        """A run directory moved or copied since it started still records its own MLflow store (RUN_DIR/mlflow.db,
        the default) at the old place, and the store records its artifacts there: a resume, an export's
        registration or `tidal ui` would open a store that is gone (or, for a copy, the original's). Rewrites
        run.json and the store's paths to this directory; returns the old directory, or None when nothing moved.
        Runs on a tracking server, or on a store they did not carry, are left alone; so is a live run, unless
        the caller holds its lock (`locked`, the launcher)."""
        from tidal.tracking import local_store_uri, rewrite_store_paths

        if not self.started:
            return None
        if not locked and RunDirLock(self.root).held():
            # its processes log to the recorded paths: this is the same directory seen from another mount
            # (a container's bind mount, a network share), and rewriting would send their artifacts there
            return None
        info, own = self.info(), self.mlflow_store
        recorded = Path(info.tracking_uri.removeprefix("sqlite:///"))
        if not info.tracking_uri.startswith("sqlite:///") or recorded.name != own.name or not own.is_file():
            return None
        if not recorded.is_absolute():  # a tracking.uri relative to some working directory: not where the run was
            return None
        old_root, new_root = recorded.parent.resolve(), self.root.resolve()
        if old_root == new_root:
            return None
        rewrite_store_paths(own, old_root, new_root)
        if self.summary.is_file():  # its paths are printed again when a finished run is re-run
            summary = json.loads(self.summary.read_text())
            moved = {k: moved_path(v, old_root, new_root) if isinstance(v, str) else v for k, v in summary.items()}
            self.summary.write_text(json.dumps(moved, indent=1))
        info.tracking_uri = local_store_uri(new_root)
        self.save_info(info)  # last: a rewrite cut short is done again on the next call
        return old_root

    def tracker(self):
        """The run's MLflow run (tidal.tracking.Tracker), as run.json records it."""
        from tidal.tracking import Tracker

        info = self.info()
        return Tracker(info.tracking_uri, info.mlflow_run_id)


def moved_path(value: str, old_root: Path, new_root: Path) -> str:
    """`value` with the directory `old_root` it starts with replaced by `new_root`, also behind a sqlite URI's
    `sqlite:///` (the summary's tracking_uri); other values as they are."""
    scheme = "sqlite:///" if value.startswith("sqlite:///") else ""
    path = value[len(scheme) :]
    if path == str(old_root) or path.startswith(f"{old_root}/"):
        return f"{scheme}{new_root}{path[len(str(old_root)) :]}"
    return value


CHECKPOINT_STATE = "state.json"
CHECKPOINT_FOLDER = re.compile(r"v(\d{6,})")
CHECKPOINT_TEMP_PREFIX = ".tmp-v"


def checkpoint_folder_name(version: int) -> str:
    return f"v{version:06d}"


def shard_name(rank: int, world_size: int) -> str:
    """A rank's optimizer shard in a checkpoint folder; also what the oldest layout called it in checkpoint/ itself."""
    return f"optimizer-rank{rank}-of-{world_size}.safetensors"


def versioned_shard_name(rank: int, world_size: int, version: int) -> str:
    """The layout before checkpoint folders: shards named by version beside checkpoint/state.json."""
    return f"optimizer-v{version:06d}-rank{rank}-of-{world_size}.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: `folder` holds its state.json and one optimizer shard per rank. That is
    checkpoint/vNNNNNN/, or checkpoint/ itself for a checkpoint written in one of the two older layouts."""

    folder: Path
    next_version: int
    world_size: int

    @property
    def state_file(self) -> Path:
        return self.folder / CHECKPOINT_STATE

    def shard(self, rank: int) -> Path:
        names = [versioned_shard_name(rank, self.world_size, self.next_version), shard_name(rank, self.world_size)]
        paths = [self.folder / n for n in names]
        return next((p for p in paths if p.is_file()), paths[-1])

    def owns(self, entry: Path) -> bool:
        """Whether `entry` (a name directly in checkpoint/) is part of this checkpoint."""
        if self.folder != entry.parent:
            return entry == self.folder
        ranks = range(self.world_size)
        return entry.name in {CHECKPOINT_STATE} | {versioned_shard_name(r, self.world_size, self.next_version) for r in ranks} | {
            shard_name(r, self.world_size) for r in ranks
        }


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest committed checkpoint under `root` (the run's checkpoint/), None on a fresh run. A
    vNNNNNN folder exists only once it is complete (it is renamed into place with its state.json)."""
    root = Path(root)
    found = [(int(m[1]), p) for p in root.glob("v*") if (m := CHECKPOINT_FOLDER.fullmatch(p.name)) and (p / CHECKPOINT_STATE).is_file()]
    if (root / CHECKPOINT_STATE).is_file():
        found.append((json.loads((root / CHECKPOINT_STATE).read_text())["next_version"], root))
    if not found:
        return None
    folder = max(found)[1]  # a tie is a folder and checkpoint/ itself: the folder, the newer layout
    state = json.loads((folder / CHECKPOINT_STATE).read_text())
    return Checkpoint(folder, state["next_version"], state.get("world_size", 1))


def stale_checkpoint_entries(root: Path, keep: Checkpoint | None) -> list[Path]:
    """What Tidal wrote in checkpoint/ that is not part of `keep`: superseded checkpoints (folders, or
    an older layout's files) and what an interrupted write left (.tmp-v… folders, *.tmp files)."""
    root = Path(root)
    if not root.is_dir():
        return []

    def ours(p: Path) -> bool:
        return bool(CHECKPOINT_FOLDER.fullmatch(p.name)) or p.name.startswith((CHECKPOINT_TEMP_PREFIX, CHECKPOINT_STATE, "optimizer-"))

    return sorted(p for p in root.iterdir() if ours(p) and not (keep and keep.owns(p)))

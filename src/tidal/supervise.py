"""The launcher's processes: starting the roles of a local run, restarting the ones that die,
stopping all of them together (signals, the parent-death signal, the run directory's lock)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tidal.config import TidalConfig
from tidal.protocol import NATS_LOST_EXIT, REWARD_SERVER_FAILED_EXIT, WEIGHTS_DID_NOT_ARRIVE_EXIT
from tidal.rundir import RunDir, RunDirLock
from tidal.threads import split_cores
from tidal.transport.server import EmbeddedNats, reachable

log = logging.getLogger(__name__)
MAX_WORKER_RESTARTS = 3
MAX_TRAINER_RESTARTS = 2
MAX_NATS_RESTARTS = 3
RETIRE_GRACE_SECONDS = 60.0  # a worker stopped by `tidal scale` that has not exited by then is killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# a rollout worker ended by SIGTERM: in order (tidal.cli's exit code), or by the signal itself while it was still starting
PREEMPTED_EXITS = (128 + signal.SIGTERM, -signal.SIGTERM)


class RoleFailed(RuntimeError):
    """A role process exited with an error; the message carries the end of its log."""


class Stopped(KeyboardInterrupt):
    """The launcher got SIGINT, SIGTERM or SIGHUP: every process of the run is stopped, the run can be resumed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.resume_at: int | None = None  # the iteration a re-run starts from


@contextmanager
def stop_on_signals():
    """SIGINT, SIGTERM and SIGHUP raise Stopped in the launcher's main thread (once: a second signal
    during the shutdown is ignored, so the shutdown itself is not interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum, frame):
        nonlocal raised
        if raised:
            log.warning("got %s while stopping: still stopping", signal.Signals(signum).name)
            return
        raised = True
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _parent_death_signal():
    """Linux: a function that makes a child get SIGTERM when the launcher dies, even by SIGKILL, so
    no role or nats-server is left orphaned; None elsewhere."""
    from tidal.parentdeath import prctl, set_parent_death_signal

    if prctl() is None:
        return None

    def set_signal() -> None:
        set_parent_death_signal(signal.SIGTERM)

    return set_signal


def child_options(lock: RunDirLock | None) -> dict:
    """Popen options for every process the launcher starts: its own process group (a terminal's
    Ctrl-C reaches the launcher alone, which stops the others in order), the run directory's lock
    descriptor (the directory stays locked while any of them lives) and the parent-death signal."""
    options: dict = {"process_group": 0}
    if lock is not None and lock.fd is not None:
        options["pass_fds"] = (lock.fd,)
    preexec = _parent_death_signal()
    if preexec is not None:
        options["preexec_fn"] = preexec
    return options


def end_group(proc: subprocess.Popen) -> None:
    """SIGKILL to what is left of the process group `proc` led (started with process_group 0), once
    `proc` has exited: what it started and did not end, vLLM's engine processes among them. A
    group id stays reserved while any member lives, so no newer process can own it."""
    if proc.returncode is None:
        raise ValueError(f"process {proc.pid} still runs: its group is ended after it exits")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty (a pid not leading a group is one too)
        pass


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM to all at once, then SIGKILL to whatever still runs after `grace` seconds."""
    procs = [p for p in procs if p is not None and p.poll() is None]
    for p in procs:
        p.terminate()
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_LOG_RECORD = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")  # a line of the role's own log (tidal.logs' format)


def one_line_error(path: Path) -> str | None:
    """The role's own one-line error (`tidal: ...`, what its CLI prints for a known failure) when it is the
    last thing the role wrote: what follows it may only be output of the interpreter's and its children's
    shutdown (vLLM's environment prints triton's nanobind leak reports there), no record of the role's log."""
    return last_error_line(tail(path, 400).splitlines())


def last_error_line(lines: list[str]) -> str | None:
    for line in reversed(lines):
        if line.startswith("tidal: "):
            return line.strip().removeprefix("tidal: ").removeprefix("error: ")
        if _LOG_RECORD.match(line):
            return None
    return None


def tail(path: Path, lines: int = 25) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def local_accelerator_env(cfg: TidalConfig, environ: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Role -> the visible-devices variable that places it (rollout.vllm.placement); {} to share."""
    environ = os.environ if environ is None else environ
    from tidal.devices import VISIBLE_DEVICES_ENV, accelerator_placement, visible_accelerators, visible_device_ids

    visible = visible_accelerators()
    kind = "cuda" if visible["cuda"] else "npu" if visible["npu"] else None
    if kind is None or cfg.rollout.engine != "vllm" or cfg.rollout.vllm.placement == "shared":
        return {}
    devices = visible_device_ids(kind, environ, visible[kind])
    placement = accelerator_placement(devices, cfg.rollout.initial_workers, cfg.rollout.vllm.tensor_parallel_size, cfg.trainer.ranks)
    if placement is None:
        log.info("%d %s device(s) for the trainer and %d worker(s): every role shares them", len(devices), kind, cfg.rollout.initial_workers)
        return {}
    log.info("device placement (%s): %s", kind, placement)
    return {role: {VISIBLE_DEVICES_ENV[kind]: ",".join(ids)} for role, ids in placement.items()}


class RoleProcesses:
    """Trainer and rollout workers as child processes; dead workers are restarted (their work is
    redelivered). Each reads its threads from the run's config.yaml (resolved by `tidal run`), so a
    worker that joins on `tidal scale` gets the per-worker threads the run resolved at its start.
    The worker count follows RUN_DIR/workers.request: workers join as `worker-K` with K continuing,
    and the highest-numbered ones leave on SIGTERM (retiring: their exit is not a crash to restart)."""

    def __init__(
        self,
        run: RunDir,
        nats_url: str,
        cfg: TidalConfig,
        options: dict | None = None,
        reopen_run=None,
        nats_token_file: Path | None = None,
    ):
        self.run, self.nats_url, self.cfg = run, nats_url, cfg
        # Marks the run running again before a restarted trainer: a dying trainer rank may have recorded
        # "failed" (a peer's death surfaces as an error in a collective), and workers exit on it.
        self.reopen_run = reopen_run or (lambda: None)
        self.nats_token_file = nats_token_file  # the embedded server's token: each role reads it from the file
        self.options = options or {}  # child_options
        trainer_total, self.worker_threads = split_cores(cfg)
        self.trainer_threads = max(1, trainer_total // cfg.trainer.ranks)  # per rank
        self.workers: dict[str, subprocess.Popen] = {}
        self.retiring: dict[str, tuple[subprocess.Popen, float]] = {}  # worker id -> (process, when it was told to stop)
        self.target_workers = cfg.rollout.initial_workers
        self.refused_request: int | None = None
        self.worker_started: dict[str, float] = {}
        self.trainer_restarted_at = 0.0
        self.restarts: dict[str, int] = {}
        self.trainer: subprocess.Popen | None = None
        self.devices = local_accelerator_env(cfg)

    def _spawn(self, args: list[str], role: str, threads: int) -> subprocess.Popen:
        """`role` ("trainer" or a worker id) names its log and its device placement. The role sets its threads
        from the config; OMP_NUM_THREADS gives the OpenMP pool that size before any code of the role runs."""
        env = self.role_env(role, threads)
        cmd = [*self._launcher(role), "tidal.cli", *args, str(self.run.config), "--run-dir", str(self.run.root), "--nats-url", self.nats_url]
        if self.nats_token_file is not None:
            cmd += ["--nats-token-file", str(self.nats_token_file)]
        with self.run.log(role).open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **self.options)
        self.run.pid_file(role).write_text(str(proc.pid))
        return proc

    def role_env(self, role: str, threads: int) -> dict[str, str]:
        """The launcher's environment, the role's thread count and device placement: none of the run's secrets
        (each role reads its key and token files; the private key only the trainer)."""
        return {**os.environ, "OMP_NUM_THREADS": str(threads), **self.devices.get(role, {})}

    def _launcher(self, role: str) -> list[str]:
        """`python -m`, or for several trainer ranks torchrun (standalone rendezvous on this machine).
        torchrun's own restarts are not used: a restarted worker group was seen hanging in gloo's
        connect (torch 2.13, agent store); a fresh torchrun starts clean."""
        ranks = self.cfg.trainer.ranks
        if role != "trainer" or ranks == 1:
            return [sys.executable, "-m"]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]

    def spawn_trainer(self) -> subprocess.Popen:
        self.run.stop_file("trainer").unlink(missing_ok=True)  # an earlier start's reason is not this one's
        return self._spawn(["train"], "trainer", self.trainer_threads)

    def start(self) -> None:
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.trainer = self.spawn_trainer()
        for i in range(self.cfg.rollout.initial_workers):
            self.start_worker(f"worker-{i}")

    def leads_group(self) -> bool:
        return self.options.get("process_group") == 0

    def end(self, proc: subprocess.Popen) -> None:
        """After a role exits: whatever it started goes with it (its group)."""
        if self.leads_group():
            end_group(proc)

    def start_worker(self, worker_id: str) -> None:
        self.worker_started[worker_id] = time.time()
        self.workers[worker_id] = self._spawn(["rollout-worker", "--worker-id", worker_id], worker_id, self.worker_threads)

    def follow_request(self) -> None:
        """Takes up a new worker count from RUN_DIR/workers.request (`tidal scale` checked it; a count
        out of range written by other means is refused here, in the log)."""
        wanted = self.run.requested_workers()
        if wanted is None or wanted in (self.target_workers, self.refused_request):
            return
        fewest, most = self.cfg.rollout.worker_bounds
        if wanted < fewest or (most is not None and wanted > most):
            log.warning("ignored a request for %d rollout worker(s): the run allows %d to %s", wanted, fewest, most or "any number")
            self.refused_request = wanted
            return
        log.info("scaling rollout workers: %d -> %d", self.target_workers, wanted)
        self.target_workers = wanted

    def scale(self) -> None:
        """Starts or stops workers until `target_workers` run. A new worker waits until the retiring
        one of the same id has exited (two processes of one id would share its log and heartbeat)."""
        while len(self.workers) > self.target_workers:
            wid = f"worker-{len(self.workers) - 1}"
            proc = self.workers.pop(wid)
            log.info("stopping rollout worker %s (SIGTERM; its unacked work items are redelivered)", wid)
            if proc.poll() is None:
                proc.terminate()
            self.retiring[wid] = (proc, time.time())
        while len(self.workers) < self.target_workers:
            wid = f"worker-{len(self.workers)}"
            if wid in self.retiring:
                return
            if self.devices and wid not in self.devices:
                log.warning("rollout worker %s has no device of its own in the placement: it shares every visible device", wid)
            log.info("starting rollout worker %s", wid)
            self.start_worker(wid)

    def reap_retiring(self) -> None:
        """Retiring workers that exited are done (their group ended); one past the grace is killed."""
        for wid, (proc, since) in list(self.retiring.items()):
            code = proc.poll()
            if code is None and time.time() - since > RETIRE_GRACE_SECONDS:
                log.warning("rollout worker %s did not exit on SIGTERM; killing it", wid)
                proc.kill()
                code = proc.wait()
            if code is not None:
                log.info("rollout worker %s stopped (exit code %s); not restarted", wid, code)
                self.end(proc)
                del self.retiring[wid]

    def failed(self, role: str, code: int, what: str) -> RoleFailed:
        """The error for a role that failed for good; when NATS is down, that is what it says."""
        if not reachable(self.nats_url):
            return RoleFailed(f"NATS at {self.nats_url} is down or unreachable: the {what} exited with code {code} (see {self.run.log(role)})")
        line = one_line_error(self.run.log(role))
        if line is not None:
            return RoleFailed(f"{what} failed: {line} (see {self.run.log(role)})")
        return RoleFailed(f"{what} exited with code {code}:\n{tail(self.run.log(role))}")

    def check(self) -> bool:
        """True once the trainer is done; raises if a role failed for good."""
        self.reap_retiring()
        if self.trainer.poll() is None:
            self.follow_request()
            self.scale()
        for wid, proc in list(self.workers.items()):
            code = proc.poll()
            # a restart would load the same weights into the same engine, or ask the same failing reward server
            if code in (WEIGHTS_DID_NOT_ARRIVE_EXIT, REWARD_SERVER_FAILED_EXIT):
                raise self.failed(wid, code, f"rollout worker {wid}")
            if code == 0 and self.trainer.poll() is None and self.worker_started[wid] < self.trainer_restarted_at:
                # it exited on the state the interrupted trainer left, which the restart has since reopened
                log.info("rollout worker %s exited on the interrupted trainer's run state; starting it again", wid)
                self.end(proc)
                self.start_worker(wid)
            elif code in PREEMPTED_EXITS and self.trainer.poll() is None:
                # SIGTERM from outside the launcher (a preemption notice): the worker handed back its work
                # and left in order; the pool keeps its size, and a preemption is not a crash to count
                log.info("rollout worker %s was stopped by SIGTERM (preempted); starting a replacement", wid)
                self.end(proc)
                self.start_worker(wid)
            elif code not in (None, 0) and self.trainer.poll() is None:
                self.restarts[wid] = self.restarts.get(wid, 0) + 1
                if self.restarts[wid] > MAX_WORKER_RESTARTS:
                    raise self.failed(wid, code, f"rollout worker {wid} ({self.restarts[wid]} times)")
                log.warning("rollout worker %s exited with code %s; restarting (its work items are redelivered)", wid, code)
                self.end(proc)
                self.start_worker(wid)
        code = self.trainer.poll()
        if code is None:
            return False
        stopped_code, said = (self.run.recorded_stop("trainer") if code != 0 else None) or (code, None)
        if REWARD_SERVER_FAILED_EXIT in (code, stopped_code):
            # a reward failing every call, or too often: a restart would ask it again (several ranks: torchrun exits 1)
            from tidal.rewards.failures import RewardFailingError

            said = said or one_line_error(self.run.log("trainer")) or "a reward failed"
            raise RewardFailingError(f"{said.removeprefix('tidal: ')} (see {self.run.log('trainer')})")
        # torchrun exits 1 when one of its ranks was killed: for a multi-rank trainer any failure is retried;
        # NATS_LOST_EXIT: the trainer lost NATS for longer than its client reconnects
        restartable = code < 0 or code == NATS_LOST_EXIT or (self.cfg.trainer.ranks > 1 and code != 0)
        if restartable and self.restarts.get("trainer", 0) < MAX_TRAINER_RESTARTS and reachable(self.nats_url):
            # Killed by a signal (OOM killer, preemption): resume from the last checkpoint;
            # the unacked groups of the interrupted iteration are redelivered to it.
            self.restarts["trainer"] = self.restarts.get("trainer", 0) + 1
            log.warning("trainer exited with %s; restarting from the last checkpoint", f"signal {-code}" if code < 0 else f"code {code}")
            self.end(self.trainer)
            self.reopen_run()
            self.trainer_restarted_at = time.time()
            self.trainer = self.spawn_trainer()
            return False
        if code != 0:
            raise self.failed("trainer", code, "trainer")
        return True

    def stop(self, grace: float = 15.0) -> None:
        """Waits up to `grace` seconds for every role to exit by itself, then stops the rest."""
        deadline = time.time() + grace
        retiring = [p for p, _ in self.retiring.values()]
        procs = [p for p in [self.trainer, *self.workers.values(), *retiring] if p is not None]
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        stop_processes(procs)
        for p in procs:
            self.end(p)


class NatsSupervisor:
    """The embedded nats-server, restarted on its port and JetStream store when it dies (the streams,
    consumers and unacked messages survive in the store; clients reconnect by themselves)."""

    def __init__(self, server: EmbeddedNats, pid_file: Path):
        self.server, self.pid_file = server, pid_file
        self.restarts = 0

    def start(self) -> None:
        self.server.start()
        self.pid_file.write_text(str(self.server.proc.pid))

    def check(self) -> None:
        code = self.server.exit_code
        if code is None:
            return
        self.restarts += 1
        if self.restarts > MAX_NATS_RESTARTS:
            raise RoleFailed(f"nats-server exited with code {code} {self.restarts} times: see {self.server.log_file}")
        log.warning("nats-server exited with code %s; restarting it on %s with the same JetStream store", code, self.server.url)
        t0 = time.time()
        try:
            self.start()
        except (RuntimeError, TimeoutError, OSError) as err:
            raise RoleFailed(f"nats-server exited with code {code} and could not be restarted on {self.server.url}: {err}") from None
        log.info("nats-server restarted in %.2fs", time.time() - t0)

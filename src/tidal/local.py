"""The embedded launcher: every role as a local process, a progress bar, a result to read."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from tidal.config import ConfigError, TidalConfig, dump_config, load_config, training_changes
from tidal.data import load_dataset
from tidal.plan import apply_plan, cached_profile, wants_plan
from tidal.preflight import check_before_start
from tidal.rundir import RunDir, RunDirError, RunDirLock, RunInfo, latest_checkpoint, new_nats_token, new_run_id, run_signing_key
from tidal.runtime import NATS_LOST_EXIT, TAIL_THREADS_ENV, set_threads, setup_logging, split_cores
from tidal.tracking import Tracker, start_run, tracking_uri
from tidal.transport.server import TOKEN_ENV, EmbeddedNats, reachable
from tidal.weights import SIGNING_KEY_ENV, WeightStore, version_dir_name

log = logging.getLogger(__name__)
MAX_WORKER_RESTARTS = 3
MAX_TRAINER_RESTARTS = 2
MAX_NATS_RESTARTS = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

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


def one_line_error(path: Path) -> str | None:
    """The role's own one-line error (`tidal: ...`, what its CLI prints for a known failure) when its log ends with one."""
    lines = tail(path, 1).strip()
    return lines.removeprefix("tidal: ").removeprefix("error: ") if lines.startswith("tidal: ") else None


def tail(path: Path, lines: int = 25) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = tqdm(total=total, desc="RL iterations", unit="it", disable=not enabled, dynamic_ncols=True)

    def update(self, m: dict) -> None:
        self.bar.set_postfix(
            reward=f"{m['reward_mean']:.3f}",
            acc=f"{m['accuracy']:.1%}",
            tok_s=f"{m['generated_tokens_per_s']:.0f}",
            it_s=f"{m['iteration_seconds']:.1f}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def local_accelerator_env(cfg: TidalConfig, environ: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Role -> the visible-devices variable that places it (rollout.vllm.placement); {} to share."""
    environ = os.environ if environ is None else environ
    from tidal.devices import VISIBLE_DEVICES_ENV, accelerator_placement, visible_accelerators, visible_device_ids

    visible = visible_accelerators()
    kind = "cuda" if visible["cuda"] else "npu" if visible["npu"] else None
    if kind is None or cfg.rollout.engine != "vllm" or cfg.rollout.vllm.placement == "shared":
        return {}
    devices = visible_device_ids(kind, environ, visible[kind])
    placement = accelerator_placement(devices, cfg.rollout.workers, cfg.rollout.vllm.tensor_parallel_size, cfg.trainer.ranks)
    if placement is None:
        log.info("%d %s device(s) for the trainer and %d worker(s): every role shares them", len(devices), kind, cfg.rollout.workers)
        return {}
    log.info("device placement (%s): %s", kind, placement)
    return {role: {VISIBLE_DEVICES_ENV[kind]: ",".join(ids)} for role, ids in placement.items()}


class RoleProcesses:
    """Trainer and rollout workers as child processes; dead workers are restarted (their work is redelivered)."""

    def __init__(self, config_path: Path, run_dir: Path, nats_url: str, cfg: TidalConfig, env: dict | None = None, options: dict | None = None):
        self.config_path, self.run_dir, self.nats_url, self.cfg = config_path, run_dir, nats_url, cfg
        self.env = env or {}  # e.g. the embedded server's token
        self.options = options or {}  # child_options
        self.logs = run_dir / "logs"
        self.trainer_threads, self.worker_threads = split_cores(cfg)
        self.trainer_threads = max(1, self.trainer_threads // cfg.trainer.ranks)  # per rank
        self.workers: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.trainer: subprocess.Popen | None = None
        self.devices = local_accelerator_env(cfg)

    def tail_threads(self) -> int | None:
        """trainer.tail_threads for the trainer (per rank): `auto` is its threads and its workers' together."""
        tail = self.cfg.trainer.tail_threads
        if self.cfg.mode != "periodic" or tail is None:
            return None
        if tail == "auto":
            tail = self.trainer_threads * self.cfg.trainer.ranks + self.cfg.rollout.workers * self.worker_threads
        return max(1, tail // self.cfg.trainer.ranks)

    def _spawn(self, args: list[str], role: str, threads: int) -> subprocess.Popen:
        """`role` ("trainer" or a worker id) names its log and its device placement."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TIDAL_THREADS": str(threads), **self.devices.get(role, {}), **self.env}
        if role == "trainer" and self.tail_threads():
            env[TAIL_THREADS_ENV] = str(self.tail_threads())
        cmd = [*self._launcher(role), "tidal.cli", *args, str(self.config_path), "--run-dir", str(self.run_dir), "--nats-url", self.nats_url]
        with (self.logs / f"{role}.log").open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **self.options)
        (self.logs / f"{role}.pid").write_text(str(proc.pid))
        return proc

    def _launcher(self, role: str) -> list[str]:
        """`python -m`, or for several trainer ranks torchrun (standalone rendezvous on this machine).
        torchrun's own restarts are not used: a restarted worker group was seen hanging in gloo's
        connect (torch 2.13, agent store); a fresh torchrun starts clean."""
        ranks = self.cfg.trainer.ranks
        if role != "trainer" or ranks == 1:
            return [sys.executable, "-m"]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m"]

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.trainer = self._spawn(["train"], "trainer", self.trainer_threads)
        for i in range(self.cfg.rollout.workers):
            self.start_worker(f"worker-{i}")

    def start_worker(self, worker_id: str) -> None:
        self.workers[worker_id] = self._spawn(["rollout-worker", "--worker-id", worker_id], worker_id, self.worker_threads)

    def failed(self, role: str, code: int, what: str) -> RoleFailed:
        """The error for a role that failed for good; when NATS is down, that is what it says."""
        if not reachable(self.nats_url):
            return RoleFailed(f"NATS at {self.nats_url} is down or unreachable: the {what} exited with code {code} (see {self.logs / f'{role}.log'})")
        line = one_line_error(self.logs / f"{role}.log")
        if line is not None:
            return RoleFailed(f"{what} failed: {line} (see {self.logs / f'{role}.log'})")
        return RoleFailed(f"{what} exited with code {code}:\n{tail(self.logs / f'{role}.log')}")

    def check(self) -> bool:
        """True once the trainer is done; raises if a role failed for good."""
        for wid, proc in list(self.workers.items()):
            code = proc.poll()
            if code not in (None, 0) and self.trainer.poll() is None:
                self.restarts[wid] = self.restarts.get(wid, 0) + 1
                if self.restarts[wid] > MAX_WORKER_RESTARTS:
                    raise self.failed(wid, code, f"rollout worker {wid} ({self.restarts[wid]} times)")
                log.warning("rollout worker %s exited with code %s; restarting (its work items are redelivered)", wid, code)
                self.start_worker(wid)
        code = self.trainer.poll()
        if code is None:
            return False
        # torchrun exits 1 when one of its ranks was killed: for a multi-rank trainer any failure is retried;
        # NATS_LOST_EXIT: the trainer lost NATS for longer than its client reconnects
        restartable = code < 0 or code == NATS_LOST_EXIT or (self.cfg.trainer.ranks > 1 and code != 0)
        if restartable and self.restarts.get("trainer", 0) < MAX_TRAINER_RESTARTS and reachable(self.nats_url):
            # Killed by a signal (OOM killer, preemption): resume from the last checkpoint;
            # the unacked groups of the interrupted iteration are redelivered to it.
            self.restarts["trainer"] = self.restarts.get("trainer", 0) + 1
            log.warning("trainer exited with %s; restarting from the last checkpoint", f"signal {-code}" if code < 0 else f"code {code}")
            self.trainer = self._spawn(["train"], "trainer", self.trainer_threads)
            return False
        if code != 0:
            raise self.failed("trainer", code, "trainer")
        return True

    def stop(self, grace: float = 15.0) -> None:
        """Waits up to `grace` seconds for every role to exit by itself, then stops the rest."""
        deadline = time.time() + grace
        procs = [p for p in [self.trainer, *self.workers.values()] if p is not None]
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        stop_processes(procs)


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


def follow_metrics(path: Path, seen: int) -> tuple[list[dict], int]:
    if not path.is_file():
        return [], seen
    lines = path.read_text().splitlines()
    return [json.loads(l) for l in lines[seen:]], len(lines)


def run_periodic_local(cfg: TidalConfig, config_path: Path, run_dir: Path, bar: ProgressBar, lock: RunDirLock | None = None) -> dict:
    """Starts NATS (embedded unless transport.nats_url), the trainer and the workers, and supervises
    them until the trainer is done. Stopped (a signal): every process is stopped, the run state says "stopped"."""
    from tidal.transport import NatsUnavailableError

    options = child_options(lock)
    supervisor = None
    nats_url = cfg.transport.nats_url
    credentials = None  # an external server: the environment's (NATS_TOKEN, ...)
    if not nats_url:
        token = new_nats_token(run_dir)
        server = EmbeddedNats(
            run_dir / "nats", cfg.transport.max_payload_mb, log_file=run_dir / "logs" / "nats-server.log", token=token, popen_options=options
        )
        supervisor = NatsSupervisor(server, run_dir / "logs" / "nats-server.pid")
        supervisor.start()
        nats_url, credentials = server.url, server.credentials
    elif not reachable(nats_url):
        raise NatsUnavailableError(f"cannot reach NATS at {nats_url} (transport.nats_url): is it running?")
    roles = RoleProcesses(config_path, run_dir, nats_url, cfg, env={TOKEN_ENV: credentials["token"]} if credentials else {}, options=options)
    seen = 0
    try:
        open_run_state(nats_url, run_dir, cfg, credentials)
        roles.start()
        done = False
        while not done:
            if supervisor is not None:
                supervisor.check()
            done = roles.check()
            new, seen = follow_metrics(run_dir / "metrics.jsonl", seen)
            for m in new:
                bar.update(m)
            if not done:
                time.sleep(0.2)
        new, seen = follow_metrics(run_dir / "metrics.jsonl", seen)
        for m in new:
            bar.update(m)
        log.info("trainer finished; waiting for workers")
        roles.stop()
        log.info("roles stopped")
        return {"groups_generated": count_rollouts(nats_url, run_dir, cfg, credentials)}
    except Stopped as stop:
        t0 = time.time()
        log.warning("got %s: stopping the trainer and the workers", stop)
        roles.stop(grace=0)
        record_run_state(nats_url, run_dir, cfg, credentials, "stopped")
        log.info("roles stopped in %.2fs", time.time() - t0)
        raise
    finally:
        roles.stop(grace=0)
        if supervisor is not None:
            supervisor.server.stop()


def record_run_state(nats_url: str, run_dir: Path, cfg: TidalConfig, credentials: dict | None, state: str) -> None:
    """Best effort (NATS may be what failed): the run state in the KV bucket, for roles and a re-run to read."""
    import asyncio

    from tidal.protocol import RunState
    from tidal.transport import Transport

    async def put() -> None:
        t = await Transport.connect(nats_url, RunDir(run_dir).run_id, cfg.transport, create=False, credentials=credentials)
        try:
            await t.put_run_state(RunState(state))
        finally:
            await t.close()

    try:
        asyncio.run(asyncio.wait_for(put(), 10))
    except Exception as err:  # noqa: BLE001 - the state is a record; stopping goes on without it
        log.warning("could not record the run state %r in NATS: %s", state, err)


def open_run_state(nats_url: str, run_dir: Path, cfg: TidalConfig, credentials: dict | None = None) -> None:
    """Marks the run running before any worker starts: a run directory re-used after a finished or
    failed run still holds "done" / "failed", and workers reading it would exit at once."""
    import asyncio

    from tidal.protocol import RunState
    from tidal.transport import Transport

    async def reset() -> None:
        t = await Transport.connect(nats_url, RunDir(run_dir).run_id, cfg.transport, create=True, credentials=credentials)
        try:
            status = await t.run_status()
            if status is not None and status.state is not RunState.RUNNING:
                log.info("run state was %s (an earlier run in %s): now running", status.state.value, run_dir)
            await t.put_run_state(RunState.RUNNING)
        finally:
            await t.close()

    asyncio.run(reset())


def count_rollouts(nats_url: str, run_dir: Path, cfg: TidalConfig, credentials: dict | None = None) -> int:
    """Groups published to the ROLLOUTS stream (generated), as the server counts them: its last
    sequence number, since at `transport.stream_max_mb` the stream drops its oldest messages."""
    import asyncio

    from tidal.transport import Transport

    async def count() -> int:
        t = await Transport.connect(nats_url, RunDir(run_dir).run_id, cfg.transport, create=False, credentials=credentials)
        try:
            info = await t.js.stream_info(t.names["rollouts_stream"])
            return info.state.last_seq
        finally:
            await t.close()

    return asyncio.run(count())


def start_curve_eval(cfg: TidalConfig, config_path: Path, run_dir: Path, options: dict | None = None) -> subprocess.Popen | None:
    """eval.every: a process that evaluates versions as the trainer publishes them (the held-out curve)."""
    if not (cfg.eval.enabled and cfg.eval.every):
        return None
    cmd = [sys.executable, "-m", "tidal.cli", "eval", str(config_path), "--run-dir", str(run_dir), "--follow"]
    threads = str(max(1, (os.cpu_count() or 1) // (cfg.rollout.workers + 2)))
    with (run_dir / "logs" / "eval.log").open("ab") as out:
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TIDAL_THREADS": threads}
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **(options or {}))


def finish_curve_eval(curve: subprocess.Popen | None, run_dir: Path, timeout: float = 1800.0) -> None:
    """Waits for the curve's last point (the final version); its failure fails the run, loudly."""
    if curve is None:
        return
    log.info("waiting for the held-out curve's last evaluation")
    code = curve.wait(timeout)
    if code != 0:
        raise RoleFailed(f"held-out curve evaluation exited with code {code}:\n{tail(run_dir / 'logs' / 'eval.log')}")


def sparkline(values: list[float]) -> str:
    """A held-out curve in one line of text."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(bars[min(len(bars) - 1, int((v - low) / span * (len(bars) - 1) + 0.5))] for v in values)


def at_k_before_after(before: dict | None, after: dict | None) -> dict[str, float]:
    """pass_at_k / maj_at_k of the held-out eval before and after, as `pass_at_4_before` etc."""
    if not (before and after):
        return {}
    keys = [k for k in before if k.startswith(("pass_at_", "maj_at_")) and k in after]
    return {f"{k}_{when}": scores[k] for k in keys for when, scores in (("before", before), ("after", after))}


def summarize(
    cfg: TidalConfig, history: list[dict], before: dict | None, after: dict | None, final_weights: Path, info: RunInfo, extra: dict
) -> dict:
    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in history) / len(history) if history else 0.0

    trained = sum(int(m["samples"]) // cfg.rollout.group_size for m in history)
    filtered = int(sum(m.get("groups_filtered", 0) for m in history))
    return {
        "mode": cfg.mode,
        "iterations": len(history),
        "accuracy_before": before and before["accuracy"],
        "accuracy_after": after and after["accuracy"],
        "sampled_accuracy_before": before and before["sampled_accuracy"],
        "sampled_accuracy_after": after and after["sampled_accuracy"],
        "iteration_seconds_mean": mean("iteration_seconds"),
        "generate_seconds_mean": mean("generate_seconds"),
        "train_seconds_mean": mean("train_seconds"),
        "sync_seconds_mean": mean("sync_seconds"),
        "idle_seconds_mean": mean("trainer_idle_seconds"),
        "rollout_idle_seconds_mean": mean("rollout_idle_seconds"),
        "pipeline_efficiency_mean": mean("pipeline_efficiency"),
        "generation_tail_seconds_mean": mean("generation_tail_seconds"),
        "eval_samples_per_prompt": cfg.eval.samples_per_prompt,
        "staleness_max": max((m["staleness_max"] for m in history), default=0.0),
        "reward_errors": sum(m["reward_errors"] for m in history),
        "groups_generated": extra.get("groups_generated", trained + filtered),
        "groups_trained": trained,
        "groups_discarded": int(sum(m["groups_discarded"] for m in history)),
        "messages_rejected": int(sum(m.get("messages_rejected", 0) for m in history)),
        "staleness_mean": mean("staleness_mean"),
        # how far the rollouts' log-probs are from the trainer's own at the version they claim: near 0
        # for the HF engine; a rise with staleness 0 means the workers ran other weights (or another dtype)
        "logprob_mismatch_mean": mean("logprob_mismatch"),
        "logprob_mismatch_max": max((m.get("logprob_mismatch", 0.0) for m in history), default=0.0),
        "groups_filtered": int(sum(m.get("groups_filtered", 0) for m in history)),
        "final_weights": str(final_weights),
        "mlflow_run_id": info.mlflow_run_id,
        "tracking_uri": info.tracking_uri,
    }


def at_k_lines(summary: dict, pct) -> list[str]:
    ks = sorted({int(k.split("_")[2]) for k in summary if k.startswith(("pass_at_", "maj_at_")) and k.endswith("_before")})
    parts = [
        f"{name}@{k} {pct(summary[f'{name}_at_{k}_before'])} -> {pct(summary[f'{name}_at_{k}_after'])}"
        for name in ("pass", "maj")
        for k in ks
        if f"{name}_at_{k}_before" in summary
    ]
    return [f"                       {', '.join(parts)}"] if parts else []


def curve_lines(summary: dict, pct) -> list[str]:
    curve = summary.get("eval_curve") or []
    key = "sampled_accuracy" if curve and curve[0].get("sampled_accuracy") is not None else "accuracy"
    values = [point[key] for point in curve]
    if not values:
        return []
    versions = f"v{curve[0]['version']}..v{curve[-1]['version']}"
    return [f"  held-out curve       {sparkline(values)}  {pct(values[0])} -> {pct(values[-1])} ({key}, {versions}, {len(values)} points)"]


def result_table(summary: dict, run_dir: Path, wall: float) -> str:
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    return "\n".join(
        [
            f"Tidal run finished: {run_dir}  (mode {summary['mode']}, {summary['iterations']} iterations, {wall:.0f}s wall)",
            f"  held-out accuracy    before {pct(summary['accuracy_before'])}  ->  after {pct(summary['accuracy_after'])}  (greedy)",
            f"                       before {pct(summary['sampled_accuracy_before'])}  ->  after {pct(summary['sampled_accuracy_after'])}  "
            f"(sampled at the rollout temperature, {summary['eval_samples_per_prompt']} per prompt: what RL optimises)",
            *at_k_lines(summary, pct),
            *curve_lines(summary, pct),
            f"  seconds / iteration  {summary['iteration_seconds_mean']:.2f}  =  generate {summary['generate_seconds_mean']:.2f} | "
            f"train {summary['train_seconds_mean']:.2f} | weight-sync {summary['sync_seconds_mean']:.2f} | idle {summary['idle_seconds_mean']:.2f}; "
            f"pipeline efficiency {summary['pipeline_efficiency_mean']:.2f}, generation tail {summary['generation_tail_seconds_mean']:.2f}s",
            f"  groups               generated {summary['groups_generated']}, trained {summary['groups_trained']}, "
            f"filtered {summary['groups_filtered']}, discarded {summary['groups_discarded']}; staleness max {summary['staleness_max']:.0f}, "
            f"log-prob mismatch max {summary.get('logprob_mismatch_max', 0.0):.2g}",
            f"  final weights        {summary['final_weights']}",
            f"  MLflow               run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
            f"  summary              {run_dir / 'summary.json'}",
        ]
    )


def check_saved_config(cfg: TidalConfig, run_dir: Path, force: bool = False) -> None:
    """A run directory that has started keeps its config: a change that would change training
    (NON_TRAINING_KEYS aside) is refused, naming the keys, unless `force` (--force-new-config)."""
    saved = run_dir / "config.yaml"
    if not ((run_dir / "run.json").is_file() and saved.is_file()):
        return
    changes = training_changes(load_config(saved), cfg)
    if not changes:
        return
    listed = ", ".join(changes)
    if not force:
        raise ConfigError(
            f"run directory {run_dir} was started with another config, and these changes would change training: {listed}. "
            f"Resume with the config in {saved}, use another --run-dir, or pass --force-new-config to go on with the new values"
        )
    log.warning("--force-new-config: resuming %s with changed training keys: %s", run_dir, listed)
    print(f"tidal: warning: resuming with changed training keys (--force-new-config): {listed}", file=sys.stderr, flush=True)


def checkpoint_version(run_dir: Path) -> int:
    """The iteration a (re-)run of `run_dir` starts from: the last checkpointed boundary, else 0."""
    found = latest_checkpoint(run_dir / "checkpoint")
    return found.next_version if found else 0


def finished_summary(cfg: TidalConfig, run_dir: Path) -> dict | None:
    """The summary of a run that already trained trainer.iterations and wrote its summary for that
    version (a re-run of a finished run directory has nothing to do); None otherwise."""
    path = run_dir / "summary.json"
    version = checkpoint_version(run_dir)
    if version < cfg.trainer.iterations or not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if Path(summary.get("final_weights", "")).name == version_dir_name(version) else None


def prepare_run(cfg: TidalConfig, run_dir: Path, show_progress: bool = True) -> tuple[RunInfo, object, Path]:
    """Resolved config, dataset check, warm start (cached), MLflow run: everything before the loop."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))
    dataset = load_dataset(cfg.data, cfg.seed)
    bar = None

    def progress(step: int, total: int, loss: float) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="warm start (SFT, cached)", unit="step", disable=not show_progress, dynamic_ncols=True)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    from tidal.model.warm_start import prepare_base_model
    from tidal.roles import check_prompt_settings

    base = prepare_base_model(cfg, dataset, progress)
    if bar is not None:
        bar.close()
    check_prompt_settings(cfg, base)
    if (run_dir / "run.json").is_file():
        info = RunDir(run_dir).info()
    else:
        info = RunInfo(run_id=new_run_id(run_dir), base_model=str(base), tracking_uri=tracking_uri(cfg, run_dir), mlflow_run_id="")
        info.mlflow_run_id = start_run(cfg, run_dir, tags={"tidal.run_id": info.run_id})
        RunDir(run_dir).save_info(info)
    return info, dataset, config_path


def planned_config(cfg: TidalConfig, base_model: str, config_path: Path) -> TidalConfig:
    """`auto` workers / threads replaced by the capacity planner's best split (measured once per config
    and machine, then cached), written to the run's config.yaml, which every role reads."""
    profile = cached_profile(cfg, base_model, progress=lambda line: print(line, flush=True))
    cfg, chosen = apply_plan(cfg, profile)
    where = f"sync, {cfg.trainer.threads} thread(s)" if chosen.split is None else str(chosen.split)
    print(f"tidal: capacity planner: {where}, {chosen.iteration_seconds:.2f} s/iteration predicted (tidal plan shows every split)", flush=True)
    log.info("capacity planner: %s; profile %s", where, profile)
    config_path.write_text(dump_config(cfg))
    return cfg


def run_local(cfg: TidalConfig, run_dir: str | Path, show_progress: bool = True, force_new_config: bool = False) -> dict:
    """`tidal run`: one launcher per run directory (a lock); SIGINT, SIGTERM and SIGHUP stop every
    process of the run and raise Stopped; a re-run resumes from the last boundary."""
    run_dir = Path(run_dir).resolve()
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"--run-dir {run_dir}: a file is in the way of the run directory") from None
    lock = RunDirLock(run_dir).acquire()
    try:
        with stop_on_signals():
            try:
                return _run_locked(cfg, run_dir, show_progress, force_new_config, lock)
            except Stopped as stop:
                stop.resume_at = checkpoint_version(run_dir)
                log.warning("stopped by %s; a re-run resumes at iteration %d", stop, stop.resume_at)
                raise
    finally:
        lock.release()


def _run_locked(cfg: TidalConfig, run_dir: Path, show_progress: bool, force_new_config: bool, lock: RunDirLock) -> dict:
    t_start = time.time()
    setup_logging(run_dir / "logs" / "launcher.log")
    check_saved_config(cfg, run_dir, force_new_config)
    # every role of the run (children inherit it) signs or checks snapshot manifests with the run's key
    os.environ[SIGNING_KEY_ENV] = run_signing_key(run_dir)
    check_before_start(cfg)
    if cfg.mode != "sync" and cfg.transport.nats_url and not reachable(cfg.transport.nats_url):
        from tidal.transport import NatsUnavailableError

        raise NatsUnavailableError(f"cannot reach NATS at {cfg.transport.nats_url} (transport.nats_url): is it running?")
    done = finished_summary(cfg, run_dir)
    if done is not None:
        log.info("%s already trained %d iterations: nothing to do", run_dir, cfg.trainer.iterations)
        print(f"tidal: {run_dir} already finished its {cfg.trainer.iterations} iterations: nothing to do", flush=True)
        print(result_table(done, run_dir, done.get("wall_seconds", 0.0)), flush=True)
        return done
    from tidal.evaluate import eval_engine_kind, evaluate_snapshot, open_engine
    from tidal.roles import sync_trainer

    set_threads(os.cpu_count() or 1)
    info, dataset, config_path = prepare_run(cfg, run_dir, show_progress)
    if wants_plan(cfg):
        cfg = planned_config(cfg, info.base_model, config_path)
    eval_set = dataset.eval[: cfg.eval.num_prompts] if cfg.eval.num_prompts else dataset.eval
    log.info("prepared run %s", info.run_id)
    store = WeightStore(run_dir / "weights", info.base_model)
    tracker = Tracker(info.tracking_uri, info.mlflow_run_id)
    # Sync mode on vLLM: one engine in this process serves eval before, every rollout and eval after.
    if cfg.mode == "sync" and cfg.rollout.engine == "vllm":
        tracker.client  # noqa: B018 - its set-up thread is done before vLLM starts its processes
    engine = open_engine(cfg, info.base_model, "vllm") if cfg.mode == "sync" and cfg.rollout.engine == "vllm" else None
    eval_engine = engine if eval_engine_kind(cfg) == "vllm" else None
    try:
        before = evaluate_snapshot(cfg, info.base_model, eval_set, engine=eval_engine) if cfg.eval.enabled else None
        log.info("accuracy before: %s", before)
        bar = ProgressBar(cfg.trainer.iterations, show_progress)
        extra: dict = {}
        curve = start_curve_eval(cfg, config_path, run_dir, child_options(lock))
        try:
            if cfg.mode == "sync":
                if isinstance(cfg.trainer.threads, int):  # set, or chosen by the planner; else every core
                    set_threads(cfg.trainer.threads)
                sync_trainer(cfg, RunDir(run_dir, bar.update), dataset, tracker, engine)
            else:
                extra = run_periodic_local(cfg, config_path, run_dir, bar, lock)
            finish_curve_eval(curve, run_dir)
        finally:
            bar.close()
            if curve is not None and curve.poll() is None:
                curve.kill()
        log.info("loop finished")
        final = store.path(store.latest_version())
        set_threads(os.cpu_count() or 1)
        after = evaluate_snapshot(cfg, info.base_model, eval_set, final, engine=eval_engine) if cfg.eval.enabled else None
    except BaseException as err:
        try:
            tracker.finish("KILLED" if isinstance(err, Stopped) else "FAILED")
        except Exception as tracking_err:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not mark the MLflow run ended: %s", tracking_err)
        raise
    finally:
        if engine is not None:
            engine.shutdown()
    history, _ = follow_metrics(run_dir / "metrics.jsonl", 0)
    summary = summarize(cfg, history, before, after, final, info, extra)
    summary["eval_curve"] = follow_metrics(run_dir / "eval.jsonl", 0)[0]
    summary.update(at_k_before_after(before, after))
    summary["wall_seconds"] = time.time() - t_start
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    final_metrics = {
        k: summary[k] for k in ("accuracy_before", "accuracy_after", "sampled_accuracy_before", "sampled_accuracy_after") if summary[k] is not None
    }
    final_metrics.update({f"total_{k}": summary[k] for k in ("groups_generated", "groups_trained", "groups_discarded", "groups_filtered")})
    tracker.log(final_metrics, step=len(history))
    tracker.finish()
    print(result_table(summary, run_dir, summary["wall_seconds"]), flush=True)
    return summary

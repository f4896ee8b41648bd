"""The embedded launcher: every role as a local process, a progress bar, a result to read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from tidal.config import TidalConfig, dump_config
from tidal.data import load_dataset
from tidal.devices import VISIBLE_DEVICES_ENV, accelerator_placement, visible_accelerators, visible_device_ids
from tidal.evaluate import eval_engine_kind, evaluate_snapshot, open_engine
from tidal.model.warm_start import prepare_base_model
from tidal.roles import check_prompt_settings, sync_trainer
from tidal.rundir import RunInfo
from tidal.runtime import set_threads, setup_logging, split_cores
from tidal.tracking import Tracker, start_run, tracking_uri
from tidal.transport.server import EmbeddedNats
from tidal.weights import WeightStore

log = logging.getLogger(__name__)
MAX_WORKER_RESTARTS = 3
MAX_TRAINER_RESTARTS = 2


class RoleFailed(RuntimeError):
    """A role process exited with an error; the message carries the end of its log."""


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

    def __init__(self, config_path: Path, run_dir: Path, nats_url: str, cfg: TidalConfig):
        self.config_path, self.run_dir, self.nats_url, self.cfg = config_path, run_dir, nats_url, cfg
        self.logs = run_dir / "logs"
        self.trainer_threads, self.worker_threads = split_cores(cfg)
        self.trainer_threads = max(1, self.trainer_threads // cfg.trainer.ranks)  # per rank
        self.workers: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.trainer: subprocess.Popen | None = None
        self.devices = local_accelerator_env(cfg)

    def _spawn(self, args: list[str], role: str, threads: int) -> subprocess.Popen:
        """`role` ("trainer" or a worker id) names its log and its device placement."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TIDAL_THREADS": str(threads), **self.devices.get(role, {})}
        out = (self.logs / f"{role}.log").open("ab")
        cmd = [*self._launcher(role), "tidal.cli", *args, str(self.config_path), "--run-dir", str(self.run_dir), "--nats-url", self.nats_url]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
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

    def check(self) -> bool:
        """True once the trainer is done; raises if a role failed for good."""
        for wid, proc in list(self.workers.items()):
            code = proc.poll()
            if code not in (None, 0) and self.trainer.poll() is None:
                self.restarts[wid] = self.restarts.get(wid, 0) + 1
                if self.restarts[wid] > MAX_WORKER_RESTARTS:
                    raise RoleFailed(f"rollout worker {wid} exited with code {code} {self.restarts[wid]} times:\n{tail(self.logs / f'{wid}.log')}")
                log.warning("rollout worker %s exited with code %s; restarting (its work items are redelivered)", wid, code)
                self.start_worker(wid)
        code = self.trainer.poll()
        if code is None:
            return False
        # torchrun exits 1 when one of its ranks was killed: for a multi-rank trainer any failure is retried
        restartable = code < 0 or (self.cfg.trainer.ranks > 1 and code != 0)
        if restartable and self.restarts.get("trainer", 0) < MAX_TRAINER_RESTARTS:
            # Killed by a signal (OOM killer, preemption): resume from the last checkpoint;
            # the unacked groups of the interrupted iteration are redelivered to it.
            self.restarts["trainer"] = self.restarts.get("trainer", 0) + 1
            log.warning("trainer exited with %s; restarting from the last checkpoint", f"signal {-code}" if code < 0 else f"code {code}")
            self.trainer = self._spawn(["train"], "trainer", self.trainer_threads)
            return False
        if code != 0:
            raise RoleFailed(f"trainer exited with code {code}:\n{tail(self.logs / 'trainer.log')}")
        return True

    def stop(self, grace: float = 15.0) -> None:
        deadline = time.time() + grace
        procs = [p for p in [self.trainer, *self.workers.values()] if p is not None]
        for p in procs:
            while p.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()


def follow_metrics(path: Path, seen: int) -> tuple[list[dict], int]:
    if not path.is_file():
        return [], seen
    lines = path.read_text().splitlines()
    return [json.loads(l) for l in lines[seen:]], len(lines)


def run_periodic_local(cfg: TidalConfig, config_path: Path, run_dir: Path, bar: ProgressBar) -> dict:
    server = None
    nats_url = cfg.transport.nats_url
    if not nats_url:
        server = EmbeddedNats(run_dir / "nats", cfg.transport.max_payload_mb, log_file=run_dir / "logs" / "nats-server.log").start()
        nats_url = server.url
    roles = RoleProcesses(config_path, run_dir, nats_url, cfg)
    seen = 0
    try:
        open_run_state(nats_url, run_dir, cfg)
        roles.start()
        done = False
        while not done:
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
        return {"groups_generated": count_rollouts(nats_url, run_dir, cfg)}
    finally:
        roles.stop(grace=0)
        if server:
            server.stop()


def open_run_state(nats_url: str, run_dir: Path, cfg: TidalConfig) -> None:
    """Marks the run running before any worker starts: a run directory re-used after a finished or
    failed run still holds "done" / "failed", and workers reading it would exit at once."""
    import asyncio

    from tidal.protocol import RunState
    from tidal.transport import Transport

    async def reset() -> None:
        t = await Transport.connect(nats_url, RunInfo.load(run_dir).run_id, cfg.transport, create=True)
        try:
            status = await t.run_status()
            if status is not None and status.state is not RunState.RUNNING:
                log.info("run state was %s (an earlier run in %s): now running", status.state.value, run_dir)
            await t.put_run_state(RunState.RUNNING)
        finally:
            await t.close()

    asyncio.run(reset())


def count_rollouts(nats_url: str, run_dir: Path, cfg: TidalConfig) -> int:
    """Groups published to the ROLLOUTS stream (generated), as the server counts them."""
    import asyncio

    from tidal.transport import Transport

    async def count() -> int:
        t = await Transport.connect(nats_url, RunInfo.load(run_dir).run_id, cfg.transport, create=False)
        try:
            info = await t.js.stream_info(t.names["rollouts_stream"])
            return info.state.messages
        finally:
            await t.close()

    return asyncio.run(count())


def start_curve_eval(cfg: TidalConfig, config_path: Path, run_dir: Path) -> subprocess.Popen | None:
    """eval.every: a process that evaluates versions as the trainer publishes them (the held-out curve)."""
    if not (cfg.eval.enabled and cfg.eval.every):
        return None
    out = (run_dir / "logs" / "eval.log").open("ab")
    cmd = [sys.executable, "-m", "tidal.cli", "eval", str(config_path), "--run-dir", str(run_dir), "--follow"]
    threads = str(max(1, (os.cpu_count() or 1) // (cfg.rollout.workers + 2)))
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": threads, "TIDAL_THREADS": threads})


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
        return sum(m[key] for m in history) / len(history) if history else 0.0

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
            f"filtered {summary['groups_filtered']}, discarded {summary['groups_discarded']}; staleness max {summary['staleness_max']:.0f}",
            f"  final weights        {summary['final_weights']}",
            f"  MLflow               run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
            f"  summary              {run_dir / 'summary.json'}",
        ]
    )


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

    base = prepare_base_model(cfg, dataset, progress)
    if bar is not None:
        bar.close()
    check_prompt_settings(cfg, base)
    if (run_dir / "run.json").is_file():
        info = RunInfo.load(run_dir)
    else:
        info = RunInfo(
            run_id=f"{run_dir.name}-{uuid.uuid4().hex[:8]}", base_model=str(base), tracking_uri=tracking_uri(cfg, run_dir), mlflow_run_id=""
        )
        info.mlflow_run_id = start_run(cfg, run_dir, tags={"tidal.run_id": info.run_id})
        info.save(run_dir)
    return info, dataset, config_path


def run_local(cfg: TidalConfig, run_dir: str | Path, show_progress: bool = True) -> dict:
    run_dir = Path(run_dir).resolve()
    t_start = time.time()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir / "logs" / "launcher.log")
    set_threads(os.cpu_count() or 1)
    info, dataset, config_path = prepare_run(cfg, run_dir, show_progress)
    eval_set = dataset.eval[: cfg.eval.num_prompts] if cfg.eval.num_prompts else dataset.eval
    log.info("prepared run %s", info.run_id)
    store = WeightStore(run_dir / "weights", info.base_model)
    tracker = Tracker(info.tracking_uri, info.mlflow_run_id)
    # Sync mode on vLLM: one engine in this process serves eval before, every rollout and eval after.
    engine = open_engine(cfg, info.base_model, "vllm") if cfg.mode == "sync" and cfg.rollout.engine == "vllm" else None
    eval_engine = engine if eval_engine_kind(cfg) == "vllm" else None
    try:
        before = evaluate_snapshot(cfg, info.base_model, eval_set, engine=eval_engine) if cfg.eval.enabled else None
        log.info("accuracy before: %s", before)
        bar = ProgressBar(cfg.trainer.iterations, show_progress)
        extra: dict = {}
        curve = start_curve_eval(cfg, config_path, run_dir)
        try:
            if cfg.mode == "sync":
                sync_trainer(cfg, run_dir, info, dataset, tracker, bar.update, engine)
            else:
                extra = run_periodic_local(cfg, config_path, run_dir, bar)
            finish_curve_eval(curve, run_dir)
        except BaseException:
            tracker.finish("FAILED")
            raise
        finally:
            bar.close()
            if curve is not None and curve.poll() is None:
                curve.kill()
        log.info("loop finished")
        final = store.path(store.latest_version())
        set_threads(os.cpu_count() or 1)
        after = evaluate_snapshot(cfg, info.base_model, eval_set, final, engine=eval_engine) if cfg.eval.enabled else None
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

"""The embedded launcher (`tidal run`): every role as a local process, a progress bar, a result to read.

One run, in order: lock the run directory; refuse a config that would change a started run; warm
start and open the MLflow run (prepare_run); resolve `auto` workers and threads into the run's
config.yaml (the planner, then the thread plan); evaluate before; train (sync in this process, or
NATS + trainer + workers as processes, supervised); evaluate after; summary.json and the table."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from tidal.config import ConfigError, TidalConfig, dump_config, load_config, training_changes
from tidal.logs import setup_logging
from tidal.plan import apply_plan, cached_profile, format_pool, planned_tail, recommend_pool, wants_plan
from tidal.preflight import check_before_start, check_this_machine, tokenizer_of
from tidal.rewards import check_failure_rates
from tidal.rewards.served import check_reward_urls
from tidal.run_keys import new_nats_token, run_key_pair, upgrade_hmac_run
from tidal.rundir import RunDir, RunDirError, RunDirLock, RunInfo, new_run_id
from tidal.sandbox import confine_user_code
from tidal.summary import agent_before_after, at_k_before_after, result_table, summarize
from tidal.supervise import NatsSupervisor, RoleFailed, RoleProcesses, Stopped, child_options, stop_on_signals, tail
from tidal.threads import resolve_threads, set_threads
from tidal.tracking import check_server_reachable, start_run, tracking_uri
from tidal.transport.server import EmbeddedNats, reachable
from tidal.weights import WeightStore, sha256_of, version_dir_name

log = logging.getLogger(__name__)


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


def run_periodic_local(cfg: TidalConfig, run: RunDir, bar: ProgressBar, lock: RunDirLock | None = None, reward_servers=None) -> dict:
    """Starts NATS (embedded unless transport.nats_url), the trainer and the workers, and supervises
    them until the trainer is done. Stopped (a signal): every process is stopped, the run state says "stopped"."""
    from tidal.transport import NatsUnavailableError, RunNats

    options = child_options(lock)
    supervisor = None
    nats_url = cfg.transport.nats_url
    credentials = None  # an external server: the environment's (NATS_TOKEN, ...)
    if not nats_url:
        server = EmbeddedNats(
            run.nats_store, cfg.transport.max_payload_mb, log_file=run.log("nats-server"), token=new_nats_token(run.root), popen_options=options
        )
        supervisor = NatsSupervisor(server, run.pid_file("nats-server"))
        supervisor.start()
        nats_url, credentials = server.url, server.credentials
    elif not reachable(nats_url):
        raise NatsUnavailableError(f"cannot reach NATS at {nats_url} (transport.nats_url): is it running?")
    nats = RunNats(run, nats_url, cfg.transport, credentials)
    token_file = run.nats_token_file if credentials else None
    roles = RoleProcesses(run, nats_url, cfg, options=options, reopen_run=nats.open_run_state, nats_token_file=token_file)
    seen = 0
    try:
        nats.open_run_state()
        roles.start()
        done = False
        while not done:
            if supervisor is not None:
                supervisor.check()
            if reward_servers is not None:
                reward_servers.check()
            done = roles.check()
            new, seen = run.metrics.read_from(seen)
            for m in new:
                bar.update(m)
            if not done:
                time.sleep(0.2)
        new, seen = run.metrics.read_from(seen)
        for m in new:
            bar.update(m)
        log.info("trainer finished; waiting for workers")
        roles.stop()
        log.info("roles stopped")
        return {"groups_generated": nats.count_rollouts()}
    except Stopped as stop:
        t0 = time.time()
        log.warning("got %s: stopping the trainer and the workers", stop)
        roles.stop(grace=0)
        nats.record_run_state("stopped")
        log.info("roles stopped in %.2fs", time.time() - t0)
        raise
    finally:
        roles.stop(grace=0)
        if supervisor is not None:
            supervisor.server.stop()


def start_curve_eval(cfg: TidalConfig, run: RunDir, options: dict | None = None):
    """eval.every: a process that evaluates versions as the trainer publishes them (the held-out curve)."""
    import subprocess

    if not (cfg.eval.enabled and cfg.eval.every):
        return None
    cmd = [sys.executable, "-m", "tidal.cli", "eval", str(run.config), "--run-dir", str(run.root), "--follow"]
    threads = {"OMP_NUM_THREADS": str(cfg.eval.threads)} if cfg.eval.threads is not None else {}  # the follower sets them itself too
    with run.log("eval").open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **threads}, **(options or {}))


def finish_curve_eval(curve, run: RunDir, timeout: float = 1800.0) -> None:
    """Waits for the curve's last point (the final version); its failure fails the run, loudly."""
    if curve is None:
        return
    log.info("waiting for the held-out curve's last evaluation")
    code = curve.wait(timeout)
    if code != 0:
        raise RoleFailed(f"held-out curve evaluation exited with code {code}:\n{tail(run.log('eval'))}")


def check_saved_config(cfg: TidalConfig, run: RunDir, force: bool = False) -> None:
    """A run directory that has started keeps its config: a change that would change training
    (NON_TRAINING_KEYS aside) is refused, naming the keys, unless `force` (--force-new-config)."""
    if not (run.started and run.config.is_file()):
        return
    saved = load_config(run.config, on_old_keys=lambda note: None)  # the run's own file, in an older form: rewritten at start
    changes = training_changes(saved, cfg) + data_file_changes(run, cfg)
    if not changes:
        return
    listed = ", ".join(changes)
    if not force:
        raise ConfigError(
            f"run directory {run.root} was started with another config, and these changes would change training: {listed}. "
            f"Resume with the config in {run.config}, use another --run-dir, or pass --force-new-config to go on with the new values"
        )
    log.warning("--force-new-config: resuming %s with changed training keys: %s", run.root, listed)
    print(f"tidal: warning: resuming with changed training keys (--force-new-config): {listed}", file=sys.stderr, flush=True)


def data_file_digests(cfg: TidalConfig) -> dict[str, dict]:
    """{key: {path, sha256}} of the data files the config names (data.path, data.eval_path)."""
    out = {}
    for key, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if value and Path(value).is_file():
            out[key] = {"path": str(value), "sha256": sha256_of(Path(value))}
    return out


def data_file_changes(run: RunDir, cfg: TidalConfig) -> list[str]:
    """A data file edited in place since the run's last start (same path, other contents) changes training
    as a changed key does; a run directory from before digests were kept has nothing to compare."""
    if not run.data_digests.is_file():
        return []
    old, new = json.loads(run.data_digests.read_text()), data_file_digests(cfg)
    return [
        f"{key} {new[key]['path']}: its contents (sha256 {old[key]['sha256'][:12]} -> {new[key]['sha256'][:12]})"
        for key in old
        if key in new and old[key]["path"] == new[key]["path"] and old[key]["sha256"] != new[key]["sha256"]
    ]


def finished_summary(cfg: TidalConfig, run: RunDir) -> dict | None:
    """The summary of a run that already trained trainer.iterations and wrote its summary for that
    version (a re-run of a finished run directory has nothing to do); None otherwise."""
    version = run.checkpoint_version()
    if version < cfg.trainer.iterations or not run.summary.is_file():
        return None
    summary = json.loads(run.summary.read_text())
    return summary if Path(summary.get("final_weights", "")).name == version_dir_name(version) else None


def prepare_run(cfg: TidalConfig, run: RunDir, dataset, show_progress: bool = True) -> RunInfo:
    """The config written, the warm start (cached), the MLflow run: everything before the loop."""
    run.root.mkdir(parents=True, exist_ok=True)
    run.config.write_text(dump_config(cfg))
    run.data_digests.write_text(json.dumps(data_file_digests(cfg), indent=1))
    bar = None

    def progress(step: int, total: int, loss: float) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="warm start (SFT, cached)", unit="step", disable=not show_progress, dynamic_ncols=True)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    from tidal.model.base_model import prepare_base_model
    from tidal.roles import check_prompt_settings

    base = prepare_base_model(cfg, dataset, progress)
    if bar is not None:
        bar.close()
    check_prompt_settings(cfg, base)
    if run.started:
        return run.info()
    info = RunInfo(run_id=new_run_id(run.root), base_model=str(base), tracking_uri=tracking_uri(cfg, run.root), mlflow_run_id="")
    info.mlflow_run_id = start_run(cfg, run.root, tags={"tidal.run_id": info.run_id})
    run.save_info(info)
    return info


def resolved_config(cfg: TidalConfig, run: RunDir, base_model: str) -> TidalConfig:
    """The config every role of the run reads (config.yaml): `auto` workers and threads replaced by
    the capacity planner's best split (measured once per config and machine, then cached), and each
    process's threads as numbers."""
    if wants_plan(cfg):
        profile = cached_profile(cfg, base_model, progress=lambda line: print(line, flush=True))
        cfg, chosen = apply_plan(cfg, profile)
        where = f"sync, {cfg.trainer.threads} thread(s)" if chosen.split is None else str(chosen.split)
        print(f"tidal: capacity planner: {where}, {chosen.iteration_seconds:.2f} s/iteration predicted (tidal plan shows every split)", flush=True)
        log.info("capacity planner: %s; profile %s", where, profile)
        if chosen.split is not None and cfg.rollout.worker_bounds[1] is not None:
            pool = recommend_pool(
                profile, chosen.split.worker_threads, chosen.split.trainer_threads, cfg.trainer.prompts_per_iteration, planned_tail(cfg)
            )
            advice = format_pool(pool, chosen.split.worker_threads)
            print(f"tidal: {advice}", flush=True)
            log.info("capacity planner: %s", advice)
    cfg = resolve_threads(cfg)
    run.config.write_text(dump_config(cfg))
    return cfg


def run_local(
    cfg: TidalConfig, run_dir: str | Path, show_progress: bool = True, force_new_config: bool = False, config_notes: Sequence[str] = ()
) -> dict:
    """`tidal run`: one launcher per run directory (a lock); SIGINT, SIGTERM and SIGHUP stop every
    process of the run and raise Stopped; a re-run resumes from the last boundary. `config_notes`: the
    config file's warnings (old keys), logged and printed once the launcher's log is open."""
    run = RunDir(Path(run_dir).resolve())
    try:
        run.logs.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"--run-dir {run.root}: a file is in the way of the run directory") from None
    lock = RunDirLock(run.root).acquire()
    try:
        with stop_on_signals():
            try:
                return _run_locked(cfg, run, show_progress, force_new_config, lock, config_notes)
            except Stopped as stop:
                stop.resume_at = run.checkpoint_version()
                log.warning("stopped by %s; a re-run resumes at iteration %d", stop, stop.resume_at)
                raise
    finally:
        lock.release()


def run_signatures(run: RunDir) -> str:
    """The run's snapshot keys, made on its first launch in the run directory's key files, which each role reads for
    itself (the private key: the trainer alone). This process trusts the public key; the private key it returns is
    sync mode's trainer's, in this process. A run directory from before Ed25519 signing has its versions re-signed
    here, before any role runs."""
    from tidal.weights.signing import trust_public_key

    signing_key, public_key = run_key_pair(run.root)
    for snapshot in upgrade_hmac_run(run.root, run.weights, signing_key):
        log.warning("snapshot %s: its HMAC does not verify with the run's old weights-key: not re-signed, and no role will load it", snapshot)
    trust_public_key(public_key)
    return signing_key


def _run_locked(cfg: TidalConfig, run: RunDir, show_progress: bool, force_new_config: bool, lock: RunDirLock, config_notes: Sequence[str]) -> dict:
    t_start = time.time()
    setup_logging(run.log("launcher"))
    for note in config_notes:
        log.warning("config: %s", note)
        print(f"tidal: warning: {note}", file=sys.stderr, flush=True)
    moved_from = run.rehome_moved_store(locked=True)
    if moved_from is not None:
        log.info("%s was moved or copied from %s: its MLflow store and run.json now record this directory", run.root, moved_from)
        print(f"tidal: {run.root} was moved or copied from {moved_from}: its MLflow store now records this directory", flush=True)
    run.workers_request.unlink(missing_ok=True)  # an earlier launch's `tidal scale`: this one starts at rollout.workers
    check_saved_config(cfg, run, force_new_config)
    signing_key = run_signatures(run)
    confine_user_code(cfg, run.root)  # the checks import the user's tools and rewards in sandboxed processes
    dataset = check_before_start(cfg)
    check_this_machine(cfg)
    check_server_reachable(cfg)
    check_reward_urls(cfg.reward.functions)
    if cfg.mode != "sync" and cfg.transport.nats_url and not reachable(cfg.transport.nats_url):
        from tidal.transport import NatsUnavailableError

        raise NatsUnavailableError(f"cannot reach NATS at {cfg.transport.nats_url} (transport.nats_url): is it running?")
    done = finished_summary(cfg, run)
    if done is not None:
        trained = run.checkpoint_version()
        log.info("%s already trained %d iterations (trainer.iterations %d): nothing to do", run.root, trained, cfg.trainer.iterations)
        more = "" if trained == cfg.trainer.iterations else f", more than trainer.iterations ({cfg.trainer.iterations})"
        print(f"tidal: {run.root} already finished its {trained} iterations{more}: nothing to do", flush=True)
        print(result_table(done, run.root, done.get("wall_seconds", 0.0)), flush=True)
        return done
    from tidal.evaluate import eval_engine_kind, evaluate_snapshot, open_engine
    from tidal.rewards.server import RewardServers
    from tidal.roles import sync_trainer

    set_threads(os.cpu_count() or 1)
    info = prepare_run(cfg, run, dataset, show_progress)
    tokenizer = tokenizer_of(info.base_model)  # loaded once, by prepare_run's check: eval and sync mode's trainer share it
    cfg = resolved_config(cfg, run, info.base_model)
    eval_set = dataset.eval[: cfg.eval.num_prompts] if cfg.eval.num_prompts else dataset.eval
    log.info("prepared run %s", info.run_id)
    store = WeightStore(run.weights, info.base_model)
    tracker = run.tracker()
    # Sync mode on vLLM: one engine in this process serves eval before, every rollout and eval after.
    if cfg.mode == "sync" and cfg.rollout.engine == "vllm":
        tracker.client  # noqa: B018 - its set-up thread is done before vLLM starts its processes
    engine = open_engine(cfg, info.base_model, "vllm") if cfg.mode == "sync" and cfg.rollout.engine == "vllm" else None
    eval_engine = engine if eval_engine_kind(cfg) == "vllm" else None
    try:
        before = evaluate_snapshot(cfg, info.base_model, eval_set, engine=eval_engine, tokenizer=tokenizer) if cfg.eval.enabled else None
        log.info("accuracy before: %s", before)
        bar = ProgressBar(cfg.trainer.iterations, show_progress)
        extra: dict = {}
        curve = start_curve_eval(cfg, run, child_options(lock))
        reward_servers = RewardServers(cfg, run.logs, child_options(lock), info.base_model)
        try:
            run.save_reward_servers(reward_servers.start())  # each role reads their urls from the run directory
            if cfg.mode == "sync":
                if isinstance(cfg.trainer.threads, int):  # set, or chosen by the planner; else every core
                    set_threads(cfg.trainer.threads)
                with reward_servers.watched():
                    sync_trainer(cfg, run, dataset, tracker, engine, signing_key, on_iteration=bar.update, tokenizer=tokenizer)
            else:
                extra = run_periodic_local(cfg, run, bar, lock, reward_servers)
            finish_curve_eval(curve, run)
        finally:
            reward_servers.stop()
            bar.close()
            if curve is not None and curve.poll() is None:
                curve.kill()
        log.info("loop finished")
        final = store.path(store.latest_version())
        set_threads(os.cpu_count() or 1)
        after = evaluate_snapshot(cfg, info.base_model, eval_set, final, engine=eval_engine, tokenizer=tokenizer) if cfg.eval.enabled else None
    except BaseException as err:
        try:
            tracker.finish("KILLED" if isinstance(err, Stopped) else "FAILED")
        except Exception as tracking_err:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not mark the MLflow run ended: %s", tracking_err)
        raise
    finally:
        if engine is not None:
            engine.shutdown()
    history = run.metrics.read()
    summary = summarize(cfg.mode, cfg.rollout.group_size, cfg.eval.samples_per_prompt, history, before, after, final, info, extra)
    summary["eval_curve"] = run.evals.read()
    summary.update(at_k_before_after(before, after))
    summary.update(agent_before_after(before, after))
    summary["wall_seconds"] = time.time() - t_start
    run.summary.write_text(json.dumps(summary, indent=1))
    final_metrics = {
        k: summary[k] for k in ("accuracy_before", "accuracy_after", "sampled_accuracy_before", "sampled_accuracy_after") if summary[k] is not None
    }
    final_metrics.update({f"total_{k}": summary[k] for k in ("groups_generated", "groups_trained", "groups_discarded", "groups_filtered")})
    tracker.log(final_metrics, step=len(history))
    tracker.finish()
    print(result_table(summary, run.root, summary["wall_seconds"]), flush=True)
    check_failure_rates(cfg.reward, summary["failures"])  # after the table, which names every failing one
    return summary

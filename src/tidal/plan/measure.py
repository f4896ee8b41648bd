"""The capacity planner's measurements: one iteration's generation and training at each thread
count (each in its own process), the contention of two busy processes, the boundary; cached per
config and machine; and a finished run's calibration of the model."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tidal.config import TidalConfig, dump_config, load_config
from tidal.plan.model import Profile, Split, planned_tail, predict_periodic, predict_sync, run_split
from tidal.rundir import RunDir


def measure_child(argv: list[str]) -> None:
    """In its own process at `--threads`. Role `both`: one iteration's generation and training, `--reps`
    times after a warm-up. Role `generate` or `train`: that phase in a loop from wall-clock `--start-at`
    for `--seconds`, so that two such processes are busy at the same time (the contention figure)."""
    ap = argparse.ArgumentParser(prog="tidal plan (measurement)")
    ap.add_argument("config")
    ap.add_argument("base_model")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--role", choices=["both", "generate", "train"], default="both")
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    from tidal.logs import setup_logging
    from tidal.threads import set_threads

    setup_logging()
    set_threads(args.threads)
    import logging

    logging.getLogger("tidal").setLevel(logging.WARNING)
    from tidal.data import load_dataset
    from tidal.rewards import RewardScorer
    from tidal.roles import build_learner
    from tidal.rollout.engine import HFEngine
    from tidal.rollout.generator import generate_groups, generation_chunks
    from tidal.trainer.loop import IterationPlan
    from tidal.weights import WeightStore

    cfg = load_config(args.config)
    dataset = load_dataset(cfg.data, cfg.seed)
    learner, tokenizer = build_learner(cfg, args.base_model)
    engine = HFEngine.for_rollout(learner.model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    scorer = RewardScorer.from_config(cfg.reward)
    r = cfg.rollout

    def generate(version: int):
        return generate_groups(
            engine, tokenizer, scorer, IterationPlan.for_iteration(cfg, dataset, version)[1], cfg, version=version, worker_id="plan"
        )

    def train(groups) -> int:
        """Forward and backward of the iteration's groups in arrival-sized calls; returns the number of calls."""
        chunks = generation_chunks([len(g.prompt_ids) for g in groups], r.group_size, r.max_new_tokens, r.generation_token_budget)
        learner.begin_iteration(groups[0].iteration)
        for chunk in chunks:
            learner.train_on_groups([groups[i] for i in chunk])
        return len(chunks)

    if args.role != "both":
        groups = generate(0)
        train(groups)  # warm-up
        learner._reset()
        time.sleep(max(0.0, args.start_at - time.time()))
        seconds, end = [], time.time() + args.seconds
        while time.time() < end or not seconds:
            t0 = time.perf_counter()
            if args.role == "generate":
                generate(0)
            else:
                train(groups)
                learner._reset()  # forward and backward only, never a step: the same weights every round
            seconds.append(time.perf_counter() - t0)
        Path(args.out).write_text(json.dumps({args.role: statistics.median(seconds)}))
        return
    figures: dict[str, list[float]] = {"generate": [], "train": [], "boundary": []}
    from tidal.weights.signing import new_key_pair, trust_public_key

    private, public = new_key_pair()
    trust_public_key(public)  # a scratch store with a key pair of its own, in this measuring process alone
    with tempfile.TemporaryDirectory(prefix="tidal-plan-") as tmp:
        store = WeightStore(tmp, args.base_model, signing_key=private)
        for rep in range(args.reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            groups = generate(rep)
            t1 = time.perf_counter()
            calls = train(groups)
            t2 = time.perf_counter()
            learner.step()
            path = store.publish(rep + 1, learner.full_state_dict())
            engine.load_snapshot(path, rep + 1)
            t3 = time.perf_counter()
            if rep:
                figures["generate"].append(t1 - t0)
                figures["train"].append(t2 - t1)
                figures["boundary"].append(t3 - t2)
    result = {k: statistics.median(v) for k, v in figures.items()}
    result["calls"] = calls
    Path(args.out).write_text(json.dumps(result))


def _children(config_path: Path, base_model: str, jobs: list[tuple[int, list[str]]], workdir: Path) -> list[dict]:
    """One measurement process per (threads, options), all started at once; their results."""
    procs = []
    for i, (threads, options) in enumerate(jobs):
        out = workdir / f"measure-{i}.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "tidal.plan", "_measure", str(config_path), base_model, str(out), "--threads", str(threads), *options]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out))
    results = []
    for proc, out in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"tidal plan: a measurement process failed:\n{err[-2000:]}")
        results.append(json.loads(out.read_text()))
    return results


def measure_profile(cfg: TidalConfig, base_model: str, cores: int | None = None, reps: int = 2, progress=print) -> Profile:
    """Each thread count alone; then a 1-thread generator and a 1-thread trainer busy at the same time,
    against the same two alone (the contention factor: what sharing caches, memory bandwidth and
    perhaps a physical core costs each)."""
    cores = cores or os.cpu_count() or 1
    generate, train, boundary = {}, {}, []
    with tempfile.TemporaryDirectory(prefix="tidal-plan-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.yaml"
        config_path.write_text(dump_config(cfg))
        calls = 1
        for t in range(1, cores + 1):
            (alone,) = _children(config_path, base_model, [(t, ["--reps", str(reps)])], workdir)
            generate[t], train[t], calls = alone["generate"], alone["train"], alone["calls"]
            boundary.append(alone["boundary"])
            progress(f"  {t} thread(s), alone: generate {generate[t]:.3f}s, train {train[t]:.3f}s per iteration")
        contention = 1.0
        if cores > 1:
            loops = {}
            for label, start_delay in (("alone", None), ("together", 20.0)):
                at = ["--start-at", str(time.time() + start_delay)] if start_delay else []
                if start_delay:
                    pair = _children(config_path, base_model, [(1, ["--role", "generate", *at]), (1, ["--role", "train", *at])], workdir)
                else:
                    pair = [_children(config_path, base_model, [(1, ["--role", role])], workdir)[0] for role in ("generate", "train")]
                loops[label] = {**pair[0], **pair[1]}
            ratios = [loops["together"][k] / loops["alone"][k] for k in ("generate", "train")]
            contention = max(1.0, statistics.fmean(ratios))
            progress(f"  a generator and a trainer busy at once: {ratios[0]:.2f}x and {ratios[1]:.2f}x slower than alone")
    return Profile(cores, generate, train, statistics.median(boundary), contention, calls)


def profile_key(cfg: TidalConfig, base_model: str, cores: int) -> str:
    """What the measured figures depend on: the model, the sampling and batch shapes, the trainer's layout, the machine."""
    r, t = cfg.rollout, cfg.trainer
    parts = [
        base_model,
        r.engine,
        r.group_size,
        r.max_new_tokens,
        r.generation_token_budget,
        t.prompts_per_iteration,
        t.attention,
        t.token_budget,
        t.kl_coef > 0,
        t.device,
        cfg.data.model_dump_json(),
        cores,
    ]
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def cached_profile(cfg: TidalConfig, base_model: str, progress=print) -> Profile:
    cores = os.cpu_count() or 1
    root = cfg.model.warm_start.cache_dir or os.environ.get("TIDAL_CACHE") or Path.home() / ".cache" / "tidal"
    cache = Path(root) / "plans" / f"{profile_key(cfg, base_model, cores)}.json"
    if cache.is_file():
        return Profile.from_json(json.loads(cache.read_text()))
    progress(f"tidal: measuring this config on {cores} core(s) for the capacity planner (cached in {cache.parent})")
    profile = measure_profile(cfg, base_model, cores, progress=progress)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(profile)))
    return profile


def calibration(profile: Profile, run_dir: Path) -> tuple[float, Split | None, float]:
    """(measured / predicted, the run's split, its measured s/iteration) for a finished run of this
    config: the median of its iterations after the first two, against the model at the run's split.
    What the model leaves out (messaging, logging, this machine's load) scales every prediction alike."""
    run = RunDir(run_dir)
    cfg = load_config(run.config)
    lines = run.metrics.read()
    if len(lines) < 4:
        raise SystemExit(f"tidal plan: --from-run {run_dir}: needs at least 4 iterations in metrics.jsonl, found {len(lines)}")
    measured = statistics.median(b["wall_time"] - a["wall_time"] for a, b in zip(lines[2:], lines[3:]))
    split = run_split(cfg, profile.cores)
    predicted = predict_sync(profile, cfg.trainer.threads or profile.cores) if split is None else predict_periodic(profile, split, planned_tail(cfg))
    return measured / predicted.iteration_seconds, split, measured

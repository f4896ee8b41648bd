"""`tidal plan`, the capacity planner: how to split a machine between rollout workers and the trainer.

    tidal plan CONFIG [--set k=v ...] [--json PATH] [--profile PATH] [--split WxT+C ...]

Periodic mode is a producer (the workers) and a consumer (the trainer) running at once, so its
iteration time is set by the slower of the two plus what cannot overlap: the first engine call of
an iteration (the trainer has nothing to train yet) and the training of the last arrival (the
workers have nothing left to generate). `tidal plan` measures, on this machine and this config,
one iteration's generation and training seconds at every thread count (each in its own process,
alone), how much two busy processes slow each other (SMT siblings and memory bandwidth are
shared), and the boundary (optimizer step, weight snapshot); then predicts every split and prints
the one with the shortest periodic iteration, beside sync mode with all cores.

The model (`predict_periodic`), per split of `workers` engines of `worker_threads` each and a
trainer of `trainer_threads`: an event simulation of one iteration (`simulate_periodic`), the
engine calls shared round-robin by the workers, each call's groups trained in arrival order, the
busy processes sharing the cores (cores / threads each when oversubscribed) and slowing each other
by the measured contention while more than one is busy; plus the boundary.
`rollout.workers: auto` and `trainer.threads: auto` (and `rollout.threads: auto`) apply the best
split at start-up; the profile is cached per config and machine under ~/.cache/tidal/plans.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from tidal.config import ConfigError, load_config
from tidal.plan.measure import calibration, measure_child, measure_profile
from tidal.plan.model import (
    Prediction,
    Profile,
    Split,
    best_sync_threads,
    candidate_splits,
    format_pool,
    planned_tail,
    predict_periodic,
    predict_sync,
    recommend_pool,
    scaled,
)


def format_plan(profile: Profile, predictions: list[Prediction], sync: Prediction, sync_threads: int) -> str:
    lines = [
        "| split | generate s | train s | predicted s/iteration | pipeline efficiency |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in [*predictions, sync]:
        name = str(p.split) if p.split else f"sync, {sync_threads} thread(s) per phase"
        lines.append(f"| {name} | {p.generate_seconds:.3f} | {p.train_seconds:.3f} | {p.iteration_seconds:.3f} | {p.pipeline_efficiency:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_measure":
        return measure_child(argv[1:])
    ap = argparse.ArgumentParser(prog="tidal plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="examples/arithmetic.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--profile", help="reuse a profile written by --json instead of measuring")
    ap.add_argument("--split", action="append", default=[], help="also predict this split (WxT+C), e.g. an oversubscribed one")
    ap.add_argument("--max-workers", type=int, default=None)
    ap.add_argument("--from-run", help="a finished run of this config: scale the predictions by its measured / predicted iteration time")
    ap.add_argument("--json", dest="json_path")
    accel = ap.add_argument_group("an accelerator node")
    accel.add_argument("--devices", type=int, help="plan this many GPUs/NPUs between trainer ranks and vLLM workers (TP size)")
    accel.add_argument("--from-runs", nargs="+", default=[], metavar="RUN_DIR", help="finished periodic runs of the config on such a node")
    accel.add_argument("--device-profile", help="a device profile (the 'profile' of a --devices --json output)")
    args = ap.parse_args(argv)
    if args.devices is not None:
        from tidal.plan.devices import plan_devices

        if not args.from_runs and not args.device_profile:
            raise SystemExit("tidal plan --devices: give --from-runs RUN_DIR ... (finished runs on the node) or --device-profile FILE")
        return plan_devices(args.devices, args.from_runs, args.device_profile, args.max_workers, args.json_path)
    try:
        cfg = load_config(args.config, args.overrides)
        extra = [Split.parse(s) for s in args.split]
    except (ConfigError, ValueError) as err:
        raise SystemExit(f"tidal plan: {err}") from None
    if cfg.rollout.engine != "hf":
        raise SystemExit("tidal plan: measures the HF engine on CPU threads; with rollout.engine vllm set rollout.workers and the devices yourself")
    if args.profile:
        profile = Profile.from_json(json.loads(Path(args.profile).read_text())["profile"])
    else:
        from tidal.data import load_dataset
        from tidal.model.base_model import prepare_base_model

        base = str(prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed)))
        print(f"tidal plan: {args.config} on {os.cpu_count()} core(s): measuring one iteration per thread count", flush=True)
        profile = measure_profile(cfg, base)
    splits = candidate_splits(profile.cores, args.max_workers)
    factor = 1.0
    if args.from_run:
        factor, ran, measured = calibration(profile, Path(args.from_run))
        print(f"calibrated on {args.from_run} ({ran or 'sync'}): measured {measured:.3f} s/iteration, x{factor:.2f} the model's", flush=True)
    tail = planned_tail(cfg)
    candidates = [*splits, *(e for e in extra if e not in splits)]
    predictions = sorted((predict_periodic(profile, s, tail) for s in candidates), key=lambda p: p.iteration_seconds)
    predictions = [scaled(p, factor) for p in predictions]
    sync_threads = best_sync_threads(profile)
    sync = scaled(predict_sync(profile, sync_threads), factor)
    print(format_plan(profile, predictions, sync, sync_threads), flush=True)
    best = min((p for p in predictions if p.split in splits), key=lambda p: p.iteration_seconds)
    print(
        f"best periodic split: {best.split}, {best.iteration_seconds:.3f} s/iteration predicted (pipeline efficiency "
        f"{best.pipeline_efficiency:.2f}); sync: {sync.iteration_seconds:.3f} s at {sync_threads} thread(s). "
        f"Set it: --set rollout.workers={best.split.workers} --set rollout.threads={best.split.worker_threads} "
        f"--set trainer.threads={best.split.trainer_threads}, or `auto` for each",
        flush=True,
    )
    pool = recommend_pool(profile, best.split.worker_threads, best.split.trainer_threads, cfg.trainer.prompts_per_iteration, tail)
    print(format_pool(pool, best.split.worker_threads), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {"profile": asdict(profile), "predictions": [asdict(p) for p in predictions], "sync": asdict(sync), "elastic_pool": asdict(pool)},
                indent=1,
            )
        )

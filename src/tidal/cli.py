"""`tidal run | rollout-worker | train | eval | compile | submit`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tidal.config import ConfigError, load_config

log = logging.getLogger("tidal")


def _common(p: argparse.ArgumentParser, nats: bool = False) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("--run-dir", required=True, help="run directory (config, logs, weights, summary)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. trainer.iterations=5"
    )
    if nats:
        p.add_argument("--nats-url", required=True, help="NATS server URL, e.g. nats://127.0.0.1:4222")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="On-policy, periodically asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every role locally (embedded NATS and MLflow)")
    _common(run)
    run.add_argument("--via", choices=["local", "kfp-local"], default="local", help="local processes, or the KFP pipeline on kfp.local")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument(
        "--force-new-config",
        action="store_true",
        help="resume a run directory even though the config changes training (group size, lr, model, data, seed, ...)",
    )
    train = sub.add_parser("train", help="the trainer role (consumes groups, publishes weights)")
    _common(train, nats=True)
    train.add_argument("--iterations", type=int, default=None, help="run at most this many iterations, then stop (a pipeline round)")
    worker = sub.add_parser("rollout-worker", help="a rollout worker role (generates groups)")
    _common(worker, nats=True)
    worker.add_argument("--worker-id", default="worker-0")
    ev = sub.add_parser("eval", help="held-out accuracy of a weight snapshot")
    _common(ev)
    ev.add_argument("--weights", default=None, help="snapshot directory (default: the run's latest)")
    ev.add_argument("--follow", action="store_true", help="evaluate every eval.every-th version as training publishes it (MLflow eval/*)")
    from tidal.bench import BENCHMARKS, run_benchmark

    bench = sub.add_parser("bench", help="a benchmark against its baseline, measured in the same run (prints the ratio)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (tidal bench NAME --help)")
    bench.set_defaults(func=lambda args: run_benchmark(args.name, args.args) or 0)
    plan = sub.add_parser("plan", help="the capacity planner: measure, then the split of cores between workers and trainer")
    plan.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG [--set k=v] [--split WxT+C] [--json PATH] (tidal plan --help)")
    plan.set_defaults(func=lambda args: __import__("tidal.plan.command", fromlist=["main"]).main(args.args) or 0)
    chaos = sub.add_parser("chaos", help="the fault matrix: kill or stop each role at random points, check nothing is lost")
    chaos.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG [--faults ...] [--runs N] [--json PATH] (tidal chaos --help)")
    chaos.set_defaults(func=lambda args: __import__("tidal.chaos", fromlist=["main"]).main(args.args))
    from tidal import report, ui

    ui.register(sub)
    report.register(sub)
    try:
        from tidal.kube import commands as kube_commands

        kube_commands.register(sub)
    except ImportError:  # the kube extra is not installed
        pass
    return parser


def _run_command(args) -> int:
    from tidal.logs import setup_logging

    run_dir = Path(args.run_dir)
    if args.command == "run" and args.via == "kfp-local":
        from tidal.kube.commands import run_via_kfp_local

        return run_via_kfp_local(args.config, str(run_dir), args.overrides)
    cfg = load_config(args.config, args.overrides)
    if args.command == "run":
        from tidal.local import run_local

        run_local(cfg, run_dir, show_progress=not args.no_progress, force_new_config=args.force_new_config)
        return 0
    setup_logging()
    from tidal import roles
    from tidal.rundir import RunDir

    if args.command == "train":
        roles.run_async(roles.trainer_role(cfg, RunDir(run_dir), args.nats_url, args.iterations))
    elif args.command == "rollout-worker":
        roles.run_async(roles.worker_role(cfg, RunDir(run_dir), args.nats_url, args.worker_id))
    elif args.command == "eval":
        from tidal.data import load_dataset
        from tidal.evaluate import evaluate_snapshot
        from tidal.weights import WeightStore

        info = RunDir(run_dir).info()
        store = WeightStore(run_dir / "weights")
        problems = load_dataset(cfg.data, cfg.seed).eval
        problems = problems[: cfg.eval.num_prompts] if cfg.eval.num_prompts else problems
        if args.follow:
            from tidal.evaluate import follow_run
            from tidal.tracking import Tracker

            if not cfg.eval.every:
                raise ValueError("tidal eval --follow needs eval.every (evaluate every N-th version)")
            follow_run(cfg, run_dir, info.base_model, problems, Tracker(info.tracking_uri, info.mlflow_run_id).log)
            return 0
        path = args.weights or store.path(store.latest_version())
        scores = evaluate_snapshot(cfg, info.base_model, problems, path)
        print(json.dumps({"weights": str(path), **scores, "num_prompts": len(problems)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        if argv is None:  # the program is exiting: spare it the teardown's collection of every object (~2 s with torch and MLflow loaded)
            import gc

            gc.freeze()


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # its own parser: options may come before the config
        from tidal.plan.command import main as plan_main

        plan_main(argv[1:])
        return 0
    if argv[:1] == ["chaos"]:  # its own parser too
        from tidal.chaos import main as chaos_main

        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    if not hasattr(args, "config") and hasattr(args, "func"):
        return args.func(args)
    try:
        return _run_command(args) if args.command in ("run", "train", "rollout-worker", "eval") else args.func(args)
    except ConfigError as err:
        print(f"tidal: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"tidal: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from tidal.local import Stopped

        if isinstance(err, Stopped):
            resume = f" (iteration {err.resume_at})" if err.resume_at is not None else ""
            print(
                f"tidal: stopped by {err}: the run's processes are stopped; run the same command again to resume from the last boundary{resume}",
                file=sys.stderr,
            )
            return 128 + err.signum
        print("tidal: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        import nats.errors

        from tidal.local import RoleFailed
        from tidal.protocol import NATS_LOST_EXIT
        from tidal.trainer.guard import SkippedStepsError
        from tidal.transport import NatsUnavailableError

        if isinstance(err, (RoleFailed, SkippedStepsError)):
            print(f"tidal: {err}", file=sys.stderr)
            return 1
        if isinstance(err, NatsUnavailableError):
            print(f"tidal: error: {err}", file=sys.stderr)
            return NATS_LOST_EXIT
        if isinstance(err, (nats.errors.ConnectionClosedError, nats.errors.NoServersError, nats.errors.StaleConnectionError)):
            url = getattr(args, "nats_url", None) or "the run's NATS server"
            print(f"tidal: error: lost the connection to NATS at {url} and could not reconnect ({err}): is nats-server running?", file=sys.stderr)
            return NATS_LOST_EXIT
        raise


if __name__ == "__main__":
    sys.exit(main())

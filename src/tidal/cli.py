"""`tidal run | scale | rollout-worker | train | eval | bench | plan | chaos | ui | report | export | serve-reward | compile | submit`.

Every subcommand dispatches the same way: its parser sets ``func``, the handler that takes the
parsed arguments and returns the exit status; `_main` calls it and turns the errors every
subcommand can meet into one line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tidal.config import ConfigError, load_config
from tidal.rundir import RunDir, RunDirError

log = logging.getLogger("tidal")


def _common(p: argparse.ArgumentParser, nats: bool = False, run_dir_default: bool = False) -> None:
    p.add_argument("config", help="YAML config file")
    default = "; default: runs/ and the config file's name, e.g. runs/arithmetic for examples/arithmetic.yaml" if run_dir_default else ""
    p.add_argument("--run-dir", required=not run_dir_default, help=f"run directory (config, logs, weights, summary{default})")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. trainer.iterations=5"
    )
    if nats:
        p.add_argument("--nats-url", required=True, help="NATS server URL, e.g. nats://127.0.0.1:4222")
        p.add_argument(
            "--nats-token-file",
            default=None,
            help="a file holding the server's token (tidal run: the run directory's nats-token); default: the environment's NATS credentials",
        )


NO_OPTION_PREFIX = "\0"
"""The prefix characters of a subcommand that hands its words on: no command-line word can hold a NUL
byte, so none reads as an option and every word (``--help``, options before the config) reaches
the module's own parser in order."""


def _own_parser(sub, name: str, help: str, usage: str, handler) -> None:
    """A subcommand whose module parses its own arguments (``tidal plan``, ``tidal chaos``)."""
    parser = sub.add_parser(name, help=help, add_help=False, prefix_chars=NO_OPTION_PREFIX)
    parser.add_argument("args", nargs=argparse.REMAINDER, help=f"{usage} (tidal {name} --help)")
    parser.set_defaults(func=handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="On-policy, periodically asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every role locally (embedded NATS and MLflow)")
    _common(run, run_dir_default=True)
    run.add_argument("--via", choices=["local", "kfp-local"], default="local", help="local processes, or the KFP pipeline on kfp.local")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument(
        "--force-new-config",
        action="store_true",
        help="resume a run directory even though the config changes training (group size, lr, model, data, seed, ...)",
    )
    run.set_defaults(func=run_command)
    train = sub.add_parser("train", help="the trainer role (consumes groups, publishes weights)")
    _common(train, nats=True)
    train.add_argument("--iterations", type=int, default=None, help="run at most this many iterations, then stop (a pipeline round)")
    train.set_defaults(func=train_command)
    worker = sub.add_parser("rollout-worker", help="a rollout worker role (generates groups)")
    _common(worker, nats=True)
    worker.add_argument("--worker-id", default="worker-0")
    worker.set_defaults(func=worker_command)
    ev = sub.add_parser("eval", help="held-out accuracy of a weight snapshot")
    _common(ev)
    ev.add_argument("--weights", default=None, help="snapshot directory (default: the run's latest)")
    ev.add_argument("--follow", action="store_true", help="evaluate every eval.every-th version as training publishes it (MLflow eval/*)")
    ev.set_defaults(func=eval_command)
    from tidal.bench import BENCHMARKS

    bench = sub.add_parser("bench", help="a benchmark against its baseline, measured in the same run (prints the ratio)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (tidal bench NAME --help)")
    bench.set_defaults(func=bench_command)
    _own_parser(
        sub,
        "plan",
        "the capacity planner: measure, then the split of cores between workers and trainer",
        "CONFIG [--set k=v] [--split WxT+C] [--json PATH]",
        plan_command,
    )
    _own_parser(
        sub,
        "chaos",
        "the fault matrix: kill or stop each role at random points, check nothing is lost",
        "CONFIG [--faults ...] [--runs N] [--json PATH]",
        chaos_command,
    )
    from tidal import export, report, scale, ui
    from tidal.rewards import server as reward_server

    scale.register(sub)
    reward_server.register(sub)
    ui.register(sub)
    report.register(sub)
    export.register(sub)
    try:
        from tidal.kube.submit import cli as kube_commands

        kube_commands.register(sub)
    except ImportError:  # the kube extra is not installed
        pass
    return parser


def written_by_a_run(config: Path) -> bool:
    """Whether `config` is a run directory's own config.yaml: the run has started (run.json), or a run
    was launched there (its launcher log) and the file is exactly what a run writes (it stopped before
    run.json, e.g. in the warm start). A file a person wrote (comments, defaults left out), or a run's
    config copied elsewhere, is not."""
    run = RunDir(config.parent)
    if run.started:
        return True
    if not run.log("launcher").is_file():
        return False
    from tidal.config import dump_config

    try:
        return config.read_text() == dump_config(load_config(config, on_old_keys=lambda note: None))
    except (OSError, ValueError):  # ConfigError included: not a config a run wrote
        return False


def default_run_dir(config: str) -> Path:
    """`tidal run CONFIG` without --run-dir: runs/ and the config file's name (`make run`'s runs/arithmetic);
    a run directory's own config.yaml resumes that run."""
    path = Path(config)
    if path.name == "config.yaml" and written_by_a_run(path):
        return path.parent
    return Path("runs") / path.stem


def refuse_config_in_the_way(config: str, run_dir: str) -> None:
    """A run writes its resolved config to RUN_DIR/config.yaml: CONFIG itself there, written by a person,
    would be overwritten (its comments, its layout). A run directory's own config.yaml resumes it."""
    target = RunDir(run_dir).config
    if Path(config).resolve() == target.resolve() and not written_by_a_run(target):
        raise RunDirError(
            f"--run-dir {run_dir}: the run writes its resolved config to {target}, which is the config file given: use another --run-dir"
        )


def run_command(args: argparse.Namespace) -> int:
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = str(default_run_dir(args.config))
        print(f"tidal: run directory {run_dir} (--run-dir sets another)", flush=True)
    refuse_config_in_the_way(args.config, run_dir)
    if args.via == "kfp-local":
        from tidal.kube.submit.cli import run_via_kfp_local

        return run_via_kfp_local(args.config, run_dir, args.overrides)
    from tidal.local import run_local

    notes: list[str] = []  # old keys in the file: said once, in the launcher's log and on the terminal
    cfg = load_config(args.config, args.overrides, on_old_keys=notes.append)
    run_local(cfg, Path(run_dir), show_progress=not args.no_progress, force_new_config=args.force_new_config, config_notes=notes)
    return 0


def _role_setup() -> None:
    """Logging of a role started on its own (by the launcher or a pipeline step); each role sets its
    threads from the config it is given."""
    from tidal.logs import setup_logging

    setup_logging()


def train_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    _role_setup()
    from tidal import roles
    from tidal.transport import role_credentials

    roles.run_async(roles.trainer_role(cfg, RunDir(args.run_dir), args.nats_url, args.iterations, role_credentials(args.nats_token_file)))
    return 0


def worker_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    _role_setup()
    import asyncio
    import signal

    from tidal import roles
    from tidal.transport import role_credentials

    credentials = role_credentials(args.nats_token_file)
    try:
        roles.run_async(roles.worker_role(cfg, RunDir(args.run_dir), args.nats_url, args.worker_id, credentials))
    except asyncio.CancelledError:  # SIGTERM: the worker stopped in order
        print("tidal: rollout worker stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    return 0


def eval_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    _role_setup()
    from tidal.data import load_dataset
    from tidal.evaluate import evaluate_snapshot
    from tidal.model.hub import check_hub_model
    from tidal.run_keys import load_public_key, snapshot_keys
    from tidal.sandbox import confine_user_code
    from tidal.weights import WeightStore

    run = RunDir(args.run_dir)
    confine_user_code(cfg, run.root)
    run.rehome_moved_store()
    info = run.info()
    check_hub_model(info.base_model)
    load_public_key(cfg.weights.public_key_file, run)  # trusted by the engine's own load of a snapshot too
    keys = snapshot_keys(run.root)  # that key, else a run directory's from before Ed25519 signing
    store = WeightStore(run.weights)
    problems = load_dataset(cfg.data, cfg.seed).eval
    problems = problems[: cfg.eval.num_prompts] if cfg.eval.num_prompts else problems
    if args.follow:
        from tidal.evaluate import follow_run

        if not cfg.eval.every:
            raise ValueError("tidal eval --follow needs eval.every (evaluate every N-th version)")
        if cfg.eval.threads is not None:  # resolved by `tidal run` beside the trainer's and the workers'
            from tidal.threads import set_threads

            set_threads(cfg.eval.threads)
        follow_run(cfg, run.root, info.base_model, problems, run.tracker().log)
        return 0
    path = args.weights or latest_snapshot(store)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"--weights {path}: no such snapshot directory")
    from tidal.weights import CorruptSnapshotError, verify_snapshot

    try:
        verify_snapshot(path, **keys)  # before an engine is opened; the engine checks it again as it loads it
    except CorruptSnapshotError as err:
        raise ValueError(f"{err}; not evaluated") from None
    scores = evaluate_snapshot(cfg, info.base_model, problems, path)
    print(json.dumps({"weights": str(path), **scores, "num_prompts": len(problems)}))
    return 0


def latest_snapshot(store) -> Path:
    version = store.latest_version()
    if version is None:
        raise FileNotFoundError(f"{store.root} holds no weight snapshot: the run has not published any version (or give --weights)")
    return store.path(version)


def bench_command(args: argparse.Namespace) -> int:
    from tidal.bench import run_benchmark

    run_benchmark(args.name, args.args)
    return 0


def plan_command(args: argparse.Namespace) -> int:
    from tidal.plan.command import main as plan_main

    plan_main(args.args)
    return 0


def chaos_command(args: argparse.Namespace) -> int:
    from tidal.chaos import main as chaos_main

    return chaos_main(args.args)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        importable_from_working_directory()
    try:
        return _main(argv)
    finally:
        if argv is None:  # the program is exiting: spare it the teardown's collection of every object (seconds with torch and MLflow loaded)
            import gc

            gc.freeze()


def importable_from_working_directory() -> None:
    """`module:function` names (rewards, tools, estimators) resolve from the working directory, as under
    `python -m tidal.cli` and in every role (started with -m): a console script's sys.path starts with
    its bin directory instead."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"tidal: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"tidal: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from tidal.supervise import Stopped

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

        from tidal.protocol import NATS_LOST_EXIT, REWARD_SERVER_FAILED_EXIT, WEIGHTS_DID_NOT_ARRIVE_EXIT
        from tidal.rewards.failures import RewardFailingError
        from tidal.supervise import RoleFailed
        from tidal.trainer.guard import SkippedStepsError
        from tidal.transport import NatsUnavailableError
        from tidal.weights import WeightsDidNotArriveError

        if isinstance(err, WeightsDidNotArriveError):
            print(f"tidal: {err}", file=sys.stderr)
            return WEIGHTS_DID_NOT_ARRIVE_EXIT
        if isinstance(err, RewardFailingError):
            print(f"tidal: {err}", file=sys.stderr)
            if args.func is train_command and getattr(args, "run_dir", None):
                from tidal.rundir import RunDir

                RunDir(Path(args.run_dir)).record_stop("trainer", REWARD_SERVER_FAILED_EXIT, str(err))
            return REWARD_SERVER_FAILED_EXIT
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

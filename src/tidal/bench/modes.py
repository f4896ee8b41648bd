"""sync vs periodic vs bounded (k = 1, 2; k = 1 with partial rollouts on request) on the same config and machine: seconds per iteration
and held-out accuracy after the same number of iterations, so the price of strict on-policy is measured.

    tidal bench modes [--config examples/arithmetic.yaml] [--iterations 20] [--warmup 2] [--systems sync,periodic,bounded-k1,bounded-k2]
                      [--no-eval] [--set k=v ...] [--json out.json] [--tracking-uri URI] [--experiment NAME]
    (or: python benchmarks/modes.py ...)

Runs `tidal run` once per system (same seed, same warm start) and prints, from each run's
metrics.jsonl, seconds per iteration as `tidal bench trl` times it (tidal.bench.timing: the wall time
between the ends of consecutive iterations, the mean after the first `--warmup` ones), the mean split
(generate / train / weight-sync / idle), the mean pipeline efficiency ((max(generate, train) + weight
sync) / iteration), the generation tail (from an iteration's first finished group to its last), the
responses' length (p50 and p99 tokens per sample), for agent configs the tool calls per trajectory and the environment's seconds,
the mean staleness (per sample and per token) and the ratio of sync's seconds per
iteration to each system's (> 1: faster than sync), and from its summary.json the held-out accuracy
(greedy and sampled) before and after the run. The held-out evaluations run before and after the
loop, never beside it: the runs are made with `eval.every` off, since a curve process evaluating
version 0 while the first iterations run would take a core from them (a one-off cost that a long
run spreads thin, and a short benchmark run does not). The first `--warmup` iterations are left out
of the timings: in periodic mode the trainer's first iteration waits for the rollout workers to start
(a vLLM engine takes tens of seconds), which sync mode does before its loop.

Slow tools: an agent config with a heavy-tailed tool latency (rollout.agent.tool_latency, tidal.envs.latency),
e.g. `--config examples/calculator.yaml --set rollout.agent.tool_latency.p50_seconds=0.05 --set
rollout.agent.tool_latency.p99_over_p50=10`, measures what waiting on tools costs each mode. Long
responses: a warm start whose answers follow a scratch pad of heavy-tailed length
(model.warm_start.length_tail, tidal.demo.length_tail), e.g. `--set model.warm_start.length_tail.p50_tokens=16
--set rollout.max_new_tokens=240 --set model.tiny.max_position_embeddings=1024` (a context that holds the
calculator's longest trajectories), measures what waiting on the longest responses costs.

Every system's run is logged to one MLflow experiment (`--experiment`, default tidal-bench-modes) in
one store (`--tracking-uri`, default $MLFLOW_TRACKING_URI, else runs/bench-modes/mlflow.db), tagged
`system` (and `mode`, `bench`, `bench.invocation`), so MLflow's compare view shows them side by side:
`tidal ui --tracking-uri URI --experiment NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidal.bench.timing import run_timing, speedup
from tidal.rundir import RunDir

SYSTEMS = {  # name -> config overrides
    "sync": ["mode=sync"],
    "periodic": ["mode=periodic"],
    "bounded-k1": ["mode=bounded", "rollout.max_staleness=1"],
    "bounded-k2": ["mode=bounded", "rollout.max_staleness=2"],
    "bounded-k1-partial": ["mode=bounded", "rollout.max_staleness=1", "rollout.partial=true"],  # HF engine
}

SPLIT = {  # figure -> the per-iteration metric it is the mean of (the trainer's own timers: where the time goes)
    "generate_seconds_mean": "generate_seconds",
    "train_seconds_mean": "train_seconds",
    "sync_seconds_mean": "sync_seconds",
    "idle_seconds_mean": "trainer_idle_seconds",
}

OPTIONAL = {  # figure -> per-iteration metric, where the runs record it
    # (max(generate, train) + weight sync) / iteration: 1 when generation and training overlap perfectly
    "pipeline_efficiency_mean": "pipeline_efficiency",
    "tool_calls_per_trajectory": "agent_tool_calls_mean",
    "env_seconds_mean": "agent_env_seconds",  # summed over an iteration's trajectories (time spent in the environment's steps)
    "generation_tail_seconds_mean": "generation_tail_seconds",  # first group finished to the last: the stragglers' wait
    "response_length_p50_mean": "response_length_p50",  # tokens per sample: how long-tailed the responses were
    "response_length_p99_mean": "response_length_p99",
}


def steady_state(metrics: list[dict], warmup: int) -> dict:
    """Over the iterations after the warm-up ones: seconds per iteration and samples/s (run_timing,
    the figures `tidal bench trl` reports), the mean split, and generated tokens/s."""
    figures = run_timing(metrics, warmup)
    kept = metrics[warmup:]
    figures.update({name: sum(m[key] for m in kept) / len(kept) for name, key in SPLIT.items()})
    figures["generated_tokens_per_s"] = sum(m["generated_tokens"] for m in kept) / (figures["seconds_per_iteration"] * len(kept))
    for name, key in OPTIONAL.items():  # recorded by the runs that have them (the agent metrics: rollout.agent)
        figures[name] = sum(m[key] for m in kept) / len(kept) if all(key in m for m in kept) else None
    return figures


def run_system(
    name: str, config: str, iterations: int, warmup: int, evaluate: bool, overrides: list[str], workdir: Path, tracking: dict[str, str] | None = None
) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "tidal.cli", "run", config, "--run-dir", str(run_dir), "--no-progress"]
    logged = [f"tracking.uri={tracking['uri']}", f"tracking.experiment={tracking['experiment']}"] if tracking else []
    timed = [f"trainer.iterations={iterations}", f"eval.enabled={str(evaluate).lower()}", "eval.every=null"]  # no eval beside the loop
    for o in [*SYSTEMS[name], *timed, *logged, *overrides]:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-3000:]}")
    if tracking:  # the run's own store (an override may have changed it): tag it for the compare view
        from tidal.tracking import set_tags

        info = RunDir(run_dir).info()
        set_tags(info.tracking_uri, info.mlflow_run_id, {"system": name, "bench": "modes", "bench.invocation": tracking["invocation"]})
    return run_figures(RunDir(run_dir), warmup)


def run_figures(run: RunDir, warmup: int) -> dict:
    """A finished run's figures: `steady_state` of its metrics.jsonl, its mean staleness and held-out accuracy."""
    metrics = run.metrics.read()
    summary = json.loads(run.summary.read_text())
    figures = steady_state(metrics, warmup)
    figures["staleness_mean"] = sum(m.get("staleness_mean", 0.0) for m in metrics) / len(metrics)
    # per sampled token (partial rollouts: a sample's tokens may come from several versions)
    figures["token_staleness_mean"] = sum(m.get("token_staleness_mean", 0.0) for m in metrics) / len(metrics)
    for key in ("accuracy_before", "accuracy_after", "sampled_accuracy_before", "sampled_accuracy_after"):
        figures[key] = summary.get(key)
    return figures


def pipeline(r: dict) -> str:
    """The pipeline efficiency, the generation tail and response lengths, and for agent runs the tool calls
    per trajectory and environment seconds."""
    out = "" if r.get("pipeline_efficiency_mean") is None else f"pipeline efficiency {r['pipeline_efficiency_mean']:.2f}; "
    if r.get("generation_tail_seconds_mean") is not None:
        out += f"generation tail {r['generation_tail_seconds_mean']:.2f} s; "
    if r.get("response_length_p50_mean") is not None:
        out += f"response length p50 {r['response_length_p50_mean']:.0f} / p99 {r['response_length_p99_mean']:.0f} tokens; "
    if r.get("tool_calls_per_trajectory") is not None:
        out += f"tool calls/trajectory {r['tool_calls_per_trajectory']:.2f}, env {r['env_seconds_mean']:.2f} s; "
    return out


def percent(x: float | None) -> str:
    return "  n/a" if x is None else f"{x:5.1%}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench modes", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None, help="the config (default examples/arithmetic.yaml)")
    ap.add_argument("--config", dest="config_option", default=None, help="the same, as an option")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="leading iterations left out of the timings")
    ap.add_argument("--systems", default="sync,periodic,bounded-k1,bounded-k2", help=f"comma-separated, from {list(SYSTEMS)}")
    ap.add_argument("--no-eval", dest="evaluate", action="store_false", help="timings only: no held-out accuracy")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", dest="json_path")
    ap.add_argument(
        "--tracking-uri", default=None, help="MLflow store for every system's run (default: $MLFLOW_TRACKING_URI, else runs/bench-modes/mlflow.db)"
    )
    ap.add_argument("--experiment", default="tidal-bench-modes", help="MLflow experiment the runs land in, side by side")
    args = ap.parse_args(argv)
    if args.config and args.config_option and args.config != args.config_option:
        raise SystemExit("tidal bench modes: give the config once (positional or --config)")
    args.config = args.config or args.config_option or "examples/arithmetic.yaml"
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        store = Path("runs/bench-modes").resolve()
        store.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{store / 'mlflow.db'}"
    tracking = {"uri": uri, "experiment": args.experiment, "invocation": time.strftime("%Y%m%d-%H%M%S")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-modes-") as tmp:
        for name in systems:
            results[name] = r = run_system(name, args.config, args.iterations, args.warmup, args.evaluate, args.overrides, Path(tmp), tracking)
            print(
                f"{name:18s} {r['seconds_per_iteration']:.3f} s/iteration (median {r['seconds_per_iteration_median']:.3f}), "
                f"{r['samples_per_s']:.0f} samples/s; split: generate {r['generate_seconds_mean']:.3f} | "
                f"train {r['train_seconds_mean']:.3f} | weight-sync {r['sync_seconds_mean']:.3f} | idle {r['idle_seconds_mean']:.3f}; "
                f"{pipeline(r)}staleness {r['staleness_mean']:.2f} (per token {r['token_staleness_mean']:.2f}); held-out greedy {percent(r['accuracy_before'])} -> {percent(r['accuracy_after'])}, "
                f"sampled {percent(r['sampled_accuracy_before'])} -> {percent(r['sampled_accuracy_after'])}",
                flush=True,
            )
    baseline = results.get("sync") or results[systems[0]]
    base_name = "sync" if "sync" in results else systems[0]
    speedups = {name: speedup(baseline, r) for name, r in results.items()}
    for name, ratio in speedups.items():
        print(f"speedup vs {base_name} ({base_name} seconds per iteration / {name}'s): {name} {ratio:.2f}x")
    print(f"MLflow: the runs side by side: tidal ui --tracking-uri {uri} --experiment {args.experiment}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "results": results,
                    "speedup_vs": base_name,
                    "speedups": speedups,
                    "config": args.config,
                    "iterations": args.iterations,
                    "warmup": args.warmup,
                    "overrides": args.overrides,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

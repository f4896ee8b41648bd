"""sync vs periodic on the same config and machine: seconds per iteration and its split.

    tidal bench modes [--config examples/arithmetic.yaml] [--iterations 10] [--warmup 1] [--set k=v ...] [--json out.json]
    (or: python benchmarks/modes.py ...)

Runs `tidal run` once per mode (held-out eval off, same seed, same warm start) and prints, from
each run's metrics.jsonl, the mean split (generate / train / weight-sync / idle) and the ratio
sync / periodic of the mean iteration time (> 1: periodic is faster). The first `--warmup`
iterations are left out of both: in periodic mode the trainer's first iteration waits for the
rollout workers to start (a vLLM engine takes tens of seconds), which sync mode does before its loop.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SPLIT = {  # figure -> the per-iteration metric it is the mean of
    "iteration_seconds_mean": "iteration_seconds",
    "generate_seconds_mean": "generate_seconds",
    "train_seconds_mean": "train_seconds",
    "sync_seconds_mean": "sync_seconds",
    "idle_seconds_mean": "trainer_idle_seconds",
}


def steady_state(metrics: list[dict], warmup: int) -> dict:
    """Means of the split over the iterations after the warm-up ones, and generated tokens/s."""
    kept = metrics[warmup:]
    if not kept:
        raise SystemExit(f"--iterations must exceed --warmup ({warmup}): no iteration left to measure")
    figures = {name: sum(m[key] for m in kept) / len(kept) for name, key in SPLIT.items()}
    figures["generated_tokens_per_s"] = sum(m["generated_tokens"] for m in kept) / sum(m["iteration_seconds"] for m in kept)
    figures["iterations_measured"] = len(kept)
    return figures


def run_mode(mode: str, config: str, iterations: int, warmup: int, overrides: list[str], workdir: Path) -> dict:
    run_dir = workdir / mode
    cmd = [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        config,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--set",
        f"mode={mode}",
        "--set",
        f"trainer.iterations={iterations}",
        "--set",
        "eval.enabled=false",
    ]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return steady_state(metrics, warmup)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench modes", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/arithmetic.yaml")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1, help="leading iterations left out of the means")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-modes-") as tmp:
        for mode in ("sync", "periodic"):
            results[mode] = run_mode(mode, args.config, args.iterations, args.warmup, args.overrides, Path(tmp))
            r = results[mode]
            print(
                f"{mode:9s} {r['iteration_seconds_mean']:.3f} s/iteration = generate {r['generate_seconds_mean']:.3f} | "
                f"train {r['train_seconds_mean']:.3f} | weight-sync {r['sync_seconds_mean']:.3f} | idle {r['idle_seconds_mean']:.3f}; "
                f"{r['generated_tokens_per_s']:.0f} generated tokens/s"
            )
    ratio = results["sync"]["iteration_seconds_mean"] / results["periodic"]["iteration_seconds_mean"]
    print(f"speedup (sync / periodic iteration time): {ratio:.2f}x")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "results": results,
                    "speedup": ratio,
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

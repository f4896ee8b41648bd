"""sync vs periodic on the same config and machine: seconds per iteration and its split.

    tidal bench modes [--config examples/arithmetic.yaml] [--iterations 10] [--set k=v ...] [--json out.json]
    (or: python benchmarks/modes.py ...)

Runs `tidal run` once per mode (held-out eval off, same seed, same warm start), reads each
run's summary.json and prints the split (generate / train / weight-sync / idle) and the ratio
sync / periodic of the mean iteration time (> 1: periodic is faster).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ("iteration_seconds_mean", "generate_seconds_mean", "train_seconds_mean", "sync_seconds_mean", "idle_seconds_mean")


def run_mode(mode: str, config: str, iterations: int, overrides: list[str], workdir: Path) -> dict:
    run_dir = workdir / mode
    cmd = [sys.executable, "-m", "tidal.cli", "run", config, "--run-dir", str(run_dir), "--no-progress",
           "--set", f"mode={mode}", "--set", f"trainer.iterations={iterations}", "--set", "eval.enabled=false"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary["generated_tokens_per_s_mean"] = sum(m["generated_tokens"] for m in metrics) / sum(m["iteration_seconds"] for m in metrics)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tidal bench modes", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/arithmetic.yaml")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-modes-") as tmp:
        for mode in ("sync", "periodic"):
            s = run_mode(mode, args.config, args.iterations, args.overrides, Path(tmp))
            results[mode] = {k: s[k] for k in FIELDS} | {"generated_tokens_per_s": s["generated_tokens_per_s_mean"]}
            r = results[mode]
            print(f"{mode:9s} {r['iteration_seconds_mean']:.3f} s/iteration = generate {r['generate_seconds_mean']:.3f} | "
                  f"train {r['train_seconds_mean']:.3f} | weight-sync {r['sync_seconds_mean']:.3f} | idle {r['idle_seconds_mean']:.3f}; "
                  f"{r['generated_tokens_per_s']:.0f} generated tokens/s")
    ratio = results["sync"]["iteration_seconds_mean"] / results["periodic"]["iteration_seconds_mean"]
    print(f"speedup (sync / periodic iteration time): {ratio:.2f}x")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"results": results, "speedup": ratio, "config": args.config, "iterations": args.iterations, "overrides": args.overrides}, indent=1))


if __name__ == "__main__":
    main()

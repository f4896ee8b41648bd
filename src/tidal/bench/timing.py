"""How the benchmarks time a run: one definition, shared by `tidal bench modes` and `tidal bench trl`.

A user who runs `tidal run config.yaml` waits for the loop's wall time, so an iteration's seconds are
the wall time between the ends of consecutive iterations (each metrics line's `wall_time`): generation,
rewards, training, the step, the weight sync, the boundary (snapshot, checkpoint, records) and the
per-iteration MLflow logging, each counted once. The trainer's own `iteration_seconds` is not used
past the first iteration: iteration v+1's timer starts when v+1 is opened, inside v's boundary (so that
the workers generate meanwhile), and v's boundary tail is then counted in both timers.

The figure for a run is the mean over the iterations after the warm-up ones: the measured iterations'
wall time over their count, i.e. what the user waits per iteration. The median is kept beside it, to
show how much one slow iteration (a busy machine) moved the mean. Samples/s is the samples trained in
those iterations over their wall time.
"""

from __future__ import annotations

import statistics


def iteration_wall_seconds(metrics: list[dict]) -> list[float]:
    """Wall seconds per iteration of a Tidal run (its metrics.jsonl lines): between the ends of
    consecutive iterations, the first one from its own timer (it has no earlier end)."""
    if not metrics:
        return []
    out = [float(metrics[0]["iteration_seconds"])]
    out += [float(b["wall_time"] - a["wall_time"]) for a, b in zip(metrics, metrics[1:])]
    return out


def steady_timing(step_seconds: list[float], samples: list[float], warmup: int) -> dict:
    """The reported figures of one run from its per-iteration (per-step) wall seconds and samples
    trained, leaving out the first `warmup` iterations: seconds per iteration (mean: what the user
    waits), its median, samples/s, and the count measured."""
    kept = [float(s) for s in step_seconds[warmup:]]
    if not kept:
        raise SystemExit(f"the run must have more iterations than the warm-up ones ({warmup}): no iteration left to measure")
    wall = sum(kept)
    return {
        "seconds_per_iteration": wall / len(kept),
        "seconds_per_iteration_median": float(statistics.median(kept)),
        "samples_per_s": sum(float(n) for n in samples[warmup:]) / wall,
        "iterations_measured": len(kept),
    }


def run_timing(metrics: list[dict], warmup: int) -> dict:
    """`steady_timing` of a Tidal run's metrics.jsonl lines, with the per-iteration wall seconds."""
    steps = iteration_wall_seconds(metrics)
    return {**steady_timing(steps, [m["samples"] for m in metrics], warmup), "step_seconds": steps}


def speedup(baseline: dict, other: dict) -> float:
    """The baseline's seconds per iteration over the other's: > 1 when the other is faster."""
    return baseline["seconds_per_iteration"] / other["seconds_per_iteration"]

"""`tidal chaos`: the fault matrix as a command.

For each fault, N deterministic runs of the config; each is hit once at a random point of its
run (a seeded boundary but the last two, then up to half an iteration more), then left to finish (or resumed, when the fault took the launcher with it). Every run is
checked against uninterrupted reference runs of the same config (two: the first also fills the
caches, and their difference is the spread to expect):
- groups lost: expected (iteration, prompt) pairs never trained (groups.jsonl);
- groups trained twice: records beyond one per pair;
- hang: the run did not end within --hang-seconds;
- weights: the final snapshot's largest difference, relative to the reference's largest weight
  (under model.lora the snapshot is the adapter, and so is the comparison);
- extra seconds: the run's time from its first iteration boundary to its end (a resume included)
  minus the reference's: start-up, which varies by seconds from run to run, is left out.

Faults: worker-kill (SIGKILL a rollout worker), worker-stop (SIGSTOP, then SIGCONT after
--stop-seconds), trainer-kill, nats-kill (the embedded nats-server), launcher-kill (SIGKILL `tidal
run` itself, then run it again on the run directory), snapshot-corrupt (flip a byte of the snapshot
in use, then SIGKILL the worker, so its replacement has to load it), scale (several seeded events
through the run: a worker joins (`tidal scale` up), leaves (`tidal scale` down: the launcher's
SIGTERM to the highest-numbered worker) or is preempted (SIGTERM to a random worker, which the
launcher replaces); the pool stays within the config's rollout.workers range).

The exit status is 1 when any run lost a group, trained one twice, hung or ended at other weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from tidal.rundir import RunDir
from tidal.weights import ADAPTER_FILE, WEIGHTS_FILE, WeightStore

FAULTS = ("worker-kill", "worker-stop", "trainer-kill", "nats-kill", "launcher-kill", "snapshot-corrupt", "scale")
FAST = {"rollout.deterministic": "true", "eval.enabled": "false", "rollout.groups_per_batch": "1"}


@dataclass
class RunOutcome:
    fault: str
    run: int
    injected_at: float | None  # seconds after the run's first iteration ended; None: the run ended first
    returncode: int | None
    wall_seconds: float
    tail_seconds: float  # from the first boundary to the end (the fault's cost is in here; start-up noise is not)
    groups_lost: int
    groups_twice: int
    hang: bool
    weights_rel_diff: float | None
    error: str = ""
    events: list[str] = field(default_factory=list)  # scale: what happened when (`+4.2s join 1->2`)

    def ok(self, tolerance: float) -> bool:
        weights_match = self.weights_rel_diff is not None and self.weights_rel_diff <= tolerance
        return self.returncode == 0 and not self.hang and self.groups_lost == 0 and self.groups_twice == 0 and weights_match


@dataclass
class FaultSummary:
    fault: str
    runs: int
    groups_lost: int
    groups_twice: int
    hangs: int
    failed_runs: int
    weights_match: int
    worst_weights_rel_diff: float | None
    extra_seconds_median: float | None
    extra_seconds_max: float | None
    not_injected: int = 0
    outcomes: list[dict] = field(default_factory=list)


# --- pure parts ------------------------------------------------------------------------------


def group_accounting(records: list[dict], iterations: int, prompts_per_iteration: int) -> tuple[int, int]:
    """(lost, trained twice) from groups.jsonl records against every (iteration, prompt slot) expected."""
    keys = [(r["iteration"], r["prompt_id"]) for r in records]
    per_iteration: dict[int, set] = {}
    for it, pid in keys:
        per_iteration.setdefault(it, set()).add(pid)
    trained = sum(min(len(per_iteration.get(it, ())), prompts_per_iteration) for it in range(iterations))
    return iterations * prompts_per_iteration - trained, len(keys) - len(set(keys))


def relative_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over every tensor, relative to the largest |b|; inf when the tensors differ in name or shape."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    scale = max(float(b[k].float().abs().max()) for k in b) or 1.0
    return worst / scale


def summarize(fault: str, outcomes: list[RunOutcome], reference_tail: float, tolerance: float) -> FaultSummary:
    """`reference_tail`: the reference run's seconds from its first boundary to its end."""
    extras = [o.tail_seconds - reference_tail for o in outcomes if not o.hang and o.returncode == 0]
    diffs = [o.weights_rel_diff for o in outcomes if o.weights_rel_diff is not None]
    return FaultSummary(
        fault=fault,
        runs=len(outcomes),
        groups_lost=sum(o.groups_lost for o in outcomes),
        groups_twice=sum(o.groups_twice for o in outcomes),
        hangs=sum(o.hang for o in outcomes),
        failed_runs=sum(not o.ok(tolerance) for o in outcomes),
        weights_match=sum(d <= tolerance for d in diffs),
        worst_weights_rel_diff=max(diffs) if diffs else None,
        extra_seconds_median=median(extras) if extras else None,
        extra_seconds_max=max(extras) if extras else None,
        not_injected=sum(o.injected_at is None for o in outcomes),
        outcomes=[asdict(o) for o in outcomes],
    )


def format_table(summaries: list[FaultSummary], reference_tail: float, tolerance: float, spread: float) -> str:
    head = (
        f"reference run: {reference_tail:.1f}s from its first boundary to its end (extra s are against this), two "
        f"uninterrupted runs differ by {spread:.1e}; weights match = largest difference <= {tolerance:g} of the largest weight\n"
    )
    rows = [("fault", "runs", "lost", "twice", "hangs", "weights match", "extra s (median / max)", "failed")]
    for s in summaries:
        extra = "-" if s.extra_seconds_median is None else f"{s.extra_seconds_median:.1f} / {s.extra_seconds_max:.1f}"
        match = f"{s.weights_match}/{s.runs}" + ("" if s.worst_weights_rel_diff is None else f" (worst {s.worst_weights_rel_diff:.1e})")
        rows.append((s.fault, str(s.runs), str(s.groups_lost), str(s.groups_twice), str(s.hangs), match, extra, str(s.failed_runs)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return head + "\n".join(lines)


# --- running ---------------------------------------------------------------------------------


def tidal_run(config: Path, run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def pid_of(run_dir: Path, name: str) -> int | None:
    try:
        return int(RunDir(run_dir).pid_file(name).read_text())
    except (OSError, ValueError):
        return None


def signal_pid(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def corrupt_snapshot_in_use(run_dir: Path) -> bool:
    store = WeightStore(RunDir(run_dir).weights)
    try:
        path = tensor_file(store.path(store.latest_version()))
    except (OSError, ValueError, TypeError):  # no version yet (None), or its marker half written
        return False
    try:
        blob = bytearray(path.read_bytes())
    except OSError:
        return False
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    return True


def inject(fault: str, proc: subprocess.Popen, run_dir: Path, stop_seconds: float) -> bool:
    """Hits the run once; False when the process to hit was not there (the run had ended)."""
    if fault == "worker-kill":
        return signal_pid(pid_of(run_dir, "worker-0"), signal.SIGKILL)
    if fault == "worker-stop":
        pid = pid_of(run_dir, "worker-0")
        if not signal_pid(pid, signal.SIGSTOP):
            return False
        time.sleep(stop_seconds)
        signal_pid(pid, signal.SIGCONT)
        return True
    if fault == "trainer-kill":
        return signal_pid(pid_of(run_dir, "trainer"), signal.SIGKILL)
    if fault == "nats-kill":
        return signal_pid(pid_of(run_dir, "nats-server"), signal.SIGKILL)
    if fault == "launcher-kill":
        return signal_pid(proc.pid, signal.SIGKILL)
    if fault == "snapshot-corrupt":
        worker = pid_of(run_dir, "worker-0")
        if not signal_pid(worker, signal.SIGSTOP):
            return False
        time.sleep(1.0)  # a publish already under way lands: the snapshot corrupted is the one in use
        corrupted = corrupt_snapshot_in_use(run_dir)
        signal_pid(worker, signal.SIGKILL)
        return corrupted
    raise ValueError(f"unknown fault {fault!r}: one of {', '.join(FAULTS)}")


def pool_bounds(cfg) -> tuple[int, int]:
    """The worker counts the scale fault moves between: the config's range, else 1 to its start + 2."""
    fewest, most = cfg.rollout.worker_bounds
    return fewest, most or cfg.rollout.initial_workers + 2


def scale_event(rng: random.Random, workers: int, bounds: tuple[int, int], index: int) -> str:
    """The next pool event: the first a join and the second a leave where the bounds allow, then any of
    join, leave and preempt (a SIGTERM the launcher answers with a replacement) that they allow."""
    fewest, most = bounds
    allowed = [kind for kind, ok in (("join", workers < most), ("leave", workers > fewest)) if ok]
    if index < 2:
        preferred = "join" if index == 0 else "leave"
        return preferred if preferred in allowed else (allowed or ["preempt"])[0]
    return rng.choice([*allowed, "preempt"])


def apply_scale_event(kind: str, run_dir: Path, workers: int, rng: random.Random) -> tuple[int, str]:
    """(the pool's size after it, what was done, or why nothing was)."""
    from tidal.scale import request_scale

    if kind == "preempt":
        target = f"worker-{rng.randrange(workers)}"
        return workers, f"preempt {target}" if signal_pid(pid_of(run_dir, target), signal.SIGTERM) else f"preempt {target}: not running"
    wanted = workers + (1 if kind == "join" else -1)
    try:
        request_scale(run_dir, wanted)
    except ValueError as err:
        return workers, f"{kind} {workers}->{wanted} refused: {err}"
    return wanted, f"{kind} {workers}->{wanted}"


JOIN_SETTLE_SECONDS = 120.0  # the longest the scale fault waits for a joined worker to take work


def took_work(run_dir: Path, worker: str) -> int:
    """How many pulls `worker`'s log records (its current process's and earlier ones')."""
    try:
        return RunDir(run_dir).log(worker).read_text(errors="replace").count(f"worker {worker} took ")
    except OSError:
        return 0


def scale_events(
    proc: subprocess.Popen, run_dir: Path, rng: random.Random, span: float, count: int, start: int, bounds: tuple[int, int]
) -> list[tuple[float, str]]:
    """`count` pool events at seeded random points of the next `span` seconds (fewer when the run ends
    first): (seconds after the start of the span, what was done). After a join the events still to come
    wait, keeping their spacing, until the new worker has taken work, so a later leave or preemption
    hits a worker that generates, not one still loading."""
    t0, workers, done, delay = time.time(), start, [], 0.0
    for at in sorted(rng.uniform(0.0, span) for _ in range(count)):
        time.sleep(max(0.0, t0 + delay + at - time.time()))
        if proc.poll() is not None:
            break
        before, fired = workers, time.time()
        workers, what = apply_scale_event(scale_event(rng, workers, bounds, len(done)), run_dir, workers, rng)
        done.append((fired - t0, what))
        if workers > before:
            joined, settle_by = f"worker-{before}", fired + JOIN_SETTLE_SECONDS
            pulls = took_work(run_dir, joined)
            while proc.poll() is None and took_work(run_dir, joined) == pulls and time.time() < settle_by:
                time.sleep(0.1)
            delay += time.time() - fired
    return done


def wait_for(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        return None


def stop_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """After a hang: the launcher's process group, and whatever it left (pid files)."""
    for pid_file in sorted(RunDir(run_dir).logs.glob("*.pid")):
        signal_pid(pid_of(run_dir, pid_file.stem), signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tensor_file(version: Path) -> Path:
    """A weight version's tensors: the full weights, or under model.lora the adapter."""
    full = version / WEIGHTS_FILE
    return full if full.is_file() or not (version / ADAPTER_FILE).is_file() else version / ADAPTER_FILE


def final_weights(run_dir: Path, iterations: int) -> dict | None:
    """The last version's tensors (under model.lora the adapter, compared like full weights)."""
    from safetensors.torch import load_file

    path = tensor_file(WeightStore(RunDir(run_dir).weights).path(iterations))
    return load_file(str(path)) if path.is_file() else None


@dataclass
class Reference:
    weights: dict
    seconds: float  # wall time of the second uninterrupted run (the first also fills the caches)
    first_boundary: float  # seconds from its start to its first metrics.jsonl line
    spread: float  # relative difference between the two uninterrupted runs' final weights

    def seconds_per_iteration(self, iterations: int) -> float:
        return max(0.5, self.seconds - self.first_boundary) / max(1, iterations - 1)


def injection_boundary(rng: random.Random, iterations: int) -> int:
    """The boundary a fault follows: any but the last two, so at least one and a half iterations are
    left when it hits (a point drawn from the reference's wall time alone missed runs that ended sooner
    than their reference, on a loaded machine)."""
    return rng.randint(1, max(1, iterations - 2))


def wait_until_boundary(proc: subprocess.Popen, run_dir: Path, boundary: int, deadline: float) -> None:
    while len(RunDir(run_dir).metrics.read()) < boundary and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def timed_run(config: Path, run_dir: Path, overrides: list[str], hang_seconds: float) -> tuple[float, float]:
    """(wall seconds, seconds to the first boundary) of one uninterrupted run; exits on a failure."""
    t0, first = time.time(), None
    proc = tidal_run(config, run_dir, overrides)
    while proc.poll() is None and time.time() < t0 + hang_seconds:
        if first is None and RunDir(run_dir).metrics.read():
            first = time.time() - t0
        time.sleep(0.05)
    if wait_for(proc, t0 + hang_seconds) != 0:
        stop_everything(proc, run_dir)
        raise SystemExit(f"tidal chaos: an uninterrupted reference run failed or hung:\n{(proc.stderr.read() or '')[-3000:]}")
    wall = time.time() - t0
    return wall, wall if first is None else first


def run_reference(config: Path, work: Path, overrides: list[str], iterations: int, hang_seconds: float, runs: int = 2) -> Reference:
    """`runs` uninterrupted runs (1 or 2): the last one's time is the reference; with two, their spread."""
    for i in range(runs):
        seconds, first = timed_run(config, work / f"reference-{i}", overrides, hang_seconds)
    last = final_weights(work / f"reference-{runs - 1}", iterations)
    spread = relative_difference(final_weights(work / "reference-0", iterations), last) if runs == 2 else 0.0
    return Reference(last, seconds, first, spread)


def run_one(
    fault: str,
    index: int,
    config: Path,
    run_dir: Path,
    overrides: list[str],
    reference: Reference,
    expected: tuple[int, int],
    rng: random.Random,
    hang_seconds: float,
    stop_seconds: float,
    pool: tuple[int, tuple[int, int], int] = (1, (1, 3), 4),
) -> RunOutcome:
    """`pool`: the scale fault's starting workers, bounds and number of events."""
    iterations, per_iteration = expected
    t0 = time.time()
    proc = tidal_run(config, run_dir, overrides)
    deadline = t0 + hang_seconds
    # the run is under way: its first boundary has passed
    while not RunDir(run_dir).metrics.read() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    first = time.time()
    events: list[str] = []
    if fault == "scale":
        span = 0.8 * max(0.5, reference.seconds - reference.first_boundary)
        happened = scale_events(proc, run_dir, rng, span, pool[2], pool[0], pool[1])
        events = [f"+{at:.1f}s {what}" for at, what in happened]
        injected_at = happened[0][0] if happened else None
    else:
        wait_until_boundary(proc, run_dir, injection_boundary(rng, iterations), deadline)
        time.sleep(rng.uniform(0.0, 0.5 * reference.seconds_per_iteration(iterations)))
        at = time.time() - first
        injected_at = at if proc.poll() is None and inject(fault, proc, run_dir, stop_seconds) else None
    returncode = wait_for(proc, deadline)
    error = "" if returncode in (0, None) else (proc.stderr.read() or "").strip()[-500:]
    if fault == "launcher-kill" and injected_at is not None and returncode is not None:
        # the user's recovery: run it again on the same run directory
        time.sleep(1.0)  # the children saw the launcher die (PDEATHSIG) and stop
        proc = tidal_run(config, run_dir, overrides)
        returncode = wait_for(proc, deadline)
        error = "" if returncode in (0, None) else (proc.stderr.read() or "").strip()[-500:]
    hang = returncode is None
    if hang:
        stop_everything(proc, run_dir)
    end = time.time()
    lost, twice = group_accounting(RunDir(run_dir).groups.read(), iterations, per_iteration)
    weights = final_weights(run_dir, iterations)
    diff = None if weights is None else relative_difference(weights, reference.weights)
    return RunOutcome(fault, index, injected_at, returncode, end - t0, end - first, lost, twice, hang, diff, error, events)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tidal chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    p.add_argument("--runs", type=int, default=5, help="runs per fault (default 5)")
    p.add_argument("--iterations", type=int, default=4, help="trainer.iterations of each run (default 4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    p.add_argument("--seed", type=int, default=0, help="seeds the injection points")
    p.add_argument("--tolerance", type=float, default=1e-4, help="weights match: largest difference over the largest weight (default 1e-4)")
    p.add_argument("--hang-seconds", type=float, default=None, help="a run not done by then is a hang (default: 4x the reference + 120 s)")
    p.add_argument("--stop-seconds", type=float, default=10.0, help="how long worker-stop keeps the worker stopped (default 10)")
    p.add_argument("--scale-events", type=int, default=4, help="pool events (joins, leaves, preemptions) per run of the scale fault (default 4)")
    p.add_argument("--work-dir", type=Path, default=None, help="where the run directories go (default: a temporary folder, removed)")
    p.add_argument("--references", type=int, choices=(1, 2), default=2, help="uninterrupted reference runs (2: also their spread; default 2)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    unknown = [f for f in args.faults.split(",") if f not in FAULTS]
    if unknown:
        p.error(f"unknown fault(s) {', '.join(unknown)}: choose from {', '.join(FAULTS)}")
    if args.runs < 1 or args.iterations < 2:
        p.error("--runs must be at least 1 and --iterations at least 2 (a fault needs a run under way)")
    if args.scale_events < 1:
        p.error("--scale-events must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tidal.config import load_config

    overrides = [f"{k}={v}" for k, v in FAST.items()] + [f"trainer.iterations={args.iterations}"] + args.overrides
    cfg = load_config(args.config, overrides)
    expected = (cfg.trainer.iterations, cfg.trainer.prompts_per_iteration)
    if "scale" in args.faults.split(",") and cfg.mode == "sync":
        raise SystemExit("tidal chaos: the scale fault changes the rollout pool; the config is in sync mode, which has none")
    pool = (cfg.rollout.initial_workers, pool_bounds(cfg), args.scale_events)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tidal-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    try:
        print(f"tidal chaos: {args.references} uninterrupted reference run(s) ({args.iterations} iterations, deterministic) ...", flush=True)
        reference = run_reference(args.config, work, overrides, expected[0], args.hang_seconds or 1800.0, args.references)
        reference_tail = reference.seconds - reference.first_boundary
        print(f"  reference: {reference.seconds:.1f}s, first boundary at {reference.first_boundary:.1f}s, spread {reference.spread:.1e}", flush=True)
        hang_seconds = args.hang_seconds or 4 * reference.seconds + 120.0
        summaries = []
        for fault in args.faults.split(","):
            outcomes = []
            for i in range(args.runs):
                o = run_one(
                    fault,
                    i,
                    args.config,
                    work / f"{fault}-{i}",
                    overrides,
                    reference,
                    expected,
                    rng,
                    hang_seconds,
                    args.stop_seconds,
                    pool,
                )
                extra = o.tail_seconds - reference_tail
                state = "ok" if o.ok(args.tolerance) else "FAILED"
                at = "not injected (the run ended first)" if o.injected_at is None else f"at +{o.injected_at:.1f}s"
                print(
                    f"  {fault} #{i}: {state} {at}, rc {o.returncode}, lost {o.groups_lost}, twice {o.groups_twice}, "
                    f"weights {o.weights_rel_diff if o.weights_rel_diff is None else f'{o.weights_rel_diff:.1e}'}, extra {extra:+.1f}s"
                    + (f"\n    events: {', '.join(o.events)}" if o.events else "")
                    + (f"\n    {o.error.splitlines()[-1]}" if o.error else ""),
                    flush=True,
                )
                outcomes.append(o)
            summaries.append(summarize(fault, outcomes, reference_tail, args.tolerance))
        print(format_table(summaries, reference_tail, args.tolerance, reference.spread))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "reference_seconds": reference.seconds,
                "reference_tail_seconds": reference_tail,
                "reference_spread": reference.spread,
                "tolerance": args.tolerance,
                "faults": [asdict(s) for s in summaries],
            }
            args.json.write_text(json.dumps(payload, indent=1))
        return 1 if any(s.failed_runs for s in summaries) else 0
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

"""Failures are noticed at once (#15 item 5), on real `tidal run`s: a worker that refuses a corrupt
snapshot says so in its heartbeat and backs off, the trainer rewrites the snapshot from its own
weights and the run goes on; a corrupt checkpoint snapshot fails a resume in one line; a silent
worker is named."""

import os
import signal
import time

from tests.conftest import read_jsonl, run_cli, start_run, wait_until
from tidal.rundir import latest_checkpoint

SLOW = {"eval.enabled": False, "rollout.groups_per_batch": 1, "reward.functions": [{"name": "tests.rewards:slow_exact_match"}]}


def corrupt(snapshot) -> None:
    blob = bytearray((snapshot / "model.safetensors").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (snapshot / "model.safetensors").write_bytes(bytes(blob))


def latest_snapshot(run_dir):
    return run_dir / "weights" / f"v{int((run_dir / 'weights' / 'latest').read_text()):06d}"


def test_a_corrupt_snapshot_is_refused_reported_and_rewritten_and_the_run_loses_nothing(tmp_path, write_config):
    config = write_config({**SLOW, "trainer.iterations": 3})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl"), proc)
    # the worker stops, so no newer snapshot comes; the one in use is corrupted; the worker the
    # launcher starts instead of the killed one has to load it
    worker = int((run_dir / "logs" / "worker-0.pid").read_text())
    os.kill(worker, signal.SIGSTOP)
    time.sleep(1.0)  # a publish already under way lands
    snapshot = latest_snapshot(run_dir)
    corrupt(snapshot)
    os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

    version = int(snapshot.name[1:])
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"refused weights v{version}" in trainer_log and "it was corrupt and is rewritten" in trainer_log
    worker_log = (run_dir / "logs" / "worker-0.log").read_text()
    refusals = worker_log.count(f"refused weights v{version}")
    assert 1 <= refusals <= 3, worker_log[-3000:]  # backed off, not 320 refusals in a tight loop
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert all(m["samples"] == 6 * 4 and m["staleness_max"] == 0 for m in metrics)
    keys = [(r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl")]
    assert len(keys) == len(set(keys)) == 3 * 6
    print("iteration seconds:", [round(m["iteration_seconds"], 2) for m in metrics], f"(v{version} corrupted, its worker killed)")


def test_resuming_from_a_corrupt_checkpoint_snapshot_is_one_clear_line(tmp_path, write_config):
    config = write_config({"eval.enabled": False, "trainer.iterations": 1})
    run_dir = tmp_path / "run"
    first = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    corrupt(run_dir / "weights" / "v000001")
    again = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.iterations=2")
    assert again.returncode != 0
    last = again.stderr.strip().splitlines()[-1]
    assert "cannot resume: " in last and "resumes weights v1, which do not verify" in last and "sha256" in last, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert latest_checkpoint(run_dir / "checkpoint").next_version == 1  # nothing moved

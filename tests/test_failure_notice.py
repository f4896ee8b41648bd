"""Failures are noticed at once, on real `tidal run`s: a worker that refuses a corrupt
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


def pid_once_holding_work(run_dir, worker_id: str, proc) -> int:
    """The pid of `worker_id` once its heartbeat lists a work item it holds (read from the run's KV bucket, as the trainer does)."""
    import asyncio

    from tests.conftest import embedded_nats_url
    from tidal.config import load_config
    from tidal.rundir import RunDir
    from tidal.transport import Transport

    wait_until(lambda: (run_dir / "logs" / f"{worker_id}.pid").is_file() and (run_dir / "nats-token").is_file(), proc)

    async def watch() -> int:
        cfg = load_config(run_dir / "config.yaml")
        token = (run_dir / "nats-token").read_text()
        transport = await Transport.connect(embedded_nats_url(run_dir), RunDir(run_dir).run_id, cfg.transport, False, {"token": token})
        try:
            while proc.poll() is None:
                held = [r for r in await transport.worker_health() if r["worker_id"] == worker_id and r.get("holding")]
                if held:
                    return held[0]["pid"]
                await asyncio.sleep(0.05)
            raise AssertionError(f"the run ended before {worker_id} held work")
        finally:
            await transport.close()

    return asyncio.run(watch())


def test_a_killed_workers_items_go_out_again_when_its_heartbeat_stops_not_after_ack_wait(tmp_path, write_config):
    """ack_wait is ten minutes here, so only the heartbeat (which lists the items a worker
    holds) can get a killed worker's items generated again before trainer.group_timeout_seconds
    fails the run; its late groups, or the redelivered originals, would be duplicates the trainer drops."""
    overrides = {"rollout.workers": 2, "transport.ack_wait_seconds": 600.0, "trainer.group_timeout_seconds": 60.0}
    config = write_config({**SLOW, **overrides})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    os.kill(pid_once_holding_work(run_dir, "worker-0", proc), signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    keys = [(r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl")]
    assert len(keys) == len(set(keys)) == 3 * 6
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "whose group was rejected or whose worker went silent" in log, log[-3000:]

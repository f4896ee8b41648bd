"""`tidal run` as a launcher you can stop and resume: signals, the run-directory lock,
a supervised nats-server, resuming whatever state a run ended in, and a config that may not change."""

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import embedded_nats_url, read_jsonl, run_cli, run_processes, start_run, wait_until
from tests.processes import left_running, running, start_time
from tidal.rundir import latest_checkpoint
from tidal.supervise import last_error_line

SLOW = {"eval.enabled": False, "rollout.groups_per_batch": 1, "reward.functions": [{"name": "tests.rewards:slow_exact_match"}]}


def test_sigterm_stops_every_process_of_the_run_records_it_and_a_rerun_resumes(tmp_path, write_config):
    config = write_config({**SLOW, "trainer.iterations": 4})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    # iteration 0's boundary is durable (the checkpoint is written after metrics.jsonl): mid-run
    wait_until(lambda: latest_checkpoint(run_dir / "checkpoint"), proc)
    assert len(run_processes(run_dir)) >= 4  # launcher, trainer, worker, nats-server
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    print(f"SIGTERM to exit: {time.time() - t0:.2f}s")
    assert run_processes(run_dir) == []  # nothing orphaned: not the trainer, a worker or nats-server
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("tidal: stopped by SIGTERM") and "Traceback" not in err
    assert "stopped by SIGTERM" in (run_dir / "logs" / "launcher.log").read_text()
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"

    # what a kill mid-publish or mid-checkpoint leaves: removed when the trainer starts
    leftovers = [run_dir / "weights" / ".tmp-v000009-4242", run_dir / "checkpoint" / ".tmp-v000009"]
    for folder, name in zip(leftovers, ["model.safetensors", "optimizer-rank0-of-1.safetensors"]):
        folder.mkdir()
        (folder / name).write_bytes(b"partial")

    again = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run state was stopped" in (run_dir / "logs" / "launcher.log").read_text()
    assert "resumed from checkpoint: version" in (run_dir / "logs" / "trainer.log").read_text()
    iterations = [m["iteration"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert iterations[-1] == 3 and len(iterations) == len(set(iterations))
    assert (run_dir / "weights" / "v000004" / "manifest.json").is_file()
    assert not any(p.exists() for p in leftovers)
    keys = [(r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl")]
    assert len(keys) == len(set(keys)) == 4 * 6  # every trained group recorded once, the interrupted iteration's too


def test_a_second_launcher_on_a_run_directory_in_use_is_refused(tmp_path, write_config):
    config = write_config({**SLOW, "trainer.iterations": 2})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: (run_dir / "logs" / "trainer.pid").is_file(), proc)
    saved = (run_dir / "config.yaml").read_text()
    second = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.lr=0.5")
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    assert f"run directory {run_dir} is in use by another `tidal run` (launcher pid {proc.pid})" in second.stderr
    assert (run_dir / "config.yaml").read_text() == saved
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]  # the first run went on undisturbed
    assert [m["iteration"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]


def test_a_killed_nats_server_is_restarted_on_the_same_store_and_the_run_loses_nothing(tmp_path, write_config):
    config = write_config({**SLOW, "trainer.iterations": 4})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl") and (run_dir / "logs" / "nats-server.pid").is_file(), proc)
    os.kill(int((run_dir / "logs" / "nats-server.pid").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    launcher_log = (run_dir / "logs" / "launcher.log").read_text()
    assert "nats-server exited with code -9; restarting it" in launcher_log and "nats-server restarted in" in launcher_log
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["samples"] == 6 * 4 and m["staleness_max"] == 0 for m in metrics)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == 4 * 6
    print("iteration seconds:", [round(m["iteration_seconds"], 2) for m in metrics], "(nats-server killed after iteration 0)")


def test_a_dead_nats_is_reported_as_such(tmp_path, write_config, nats_server):
    config = write_config({**SLOW, "trainer.iterations": 4, "transport.nats_url": nats_server.url})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl"), proc)
    nats_server.stop()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith(f"tidal: NATS at {nats_server.url} is down or unreachable: the ")
    assert "ConnectionClosedError" not in err and "Traceback" not in err
    assert run_processes(run_dir) == []


def test_a_failed_run_resumes_from_its_last_boundary(tmp_path, write_config):
    """The trainer fails for good (SIGINT: it records "failed" and exits 130, which is not restarted):
    re-running the run directory resumes from the last boundary instead of stalling on the old state."""
    config = write_config({**SLOW, "trainer.iterations": 3})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl"), proc)
    os.kill(int((run_dir / "logs" / "trainer.pid").read_text()), signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "trainer failed: interrupted" in err  # the role's own one-line error
    again = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run state was failed" in (run_dir / "logs" / "launcher.log").read_text()
    assert "resumed from checkpoint: version" in (run_dir / "logs" / "trainer.log").read_text()
    assert [m["iteration"] for m in read_jsonl(run_dir / "metrics.jsonl")][-1] == 2
    assert json.loads((run_dir / "summary.json").read_text())["final_weights"].endswith("v000003")


def test_a_finished_run_finishes_at_once_and_a_training_change_is_refused_unless_forced(tmp_path, write_config):
    config = write_config({"trainer.iterations": 2, "eval.enabled": False})
    run_dir = tmp_path / "run"
    first = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()

    done = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tidal: {run_dir} already finished its 2 iterations: nothing to do" in done.stdout
    fewer = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.iterations=1")
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert f"tidal: {run_dir} already finished its 2 iterations, more than trainer.iterations (1): nothing to do" in fewer.stdout
    assert (run_dir / "logs" / "trainer.log").read_text() == trainer_log  # no role was started

    saved = (run_dir / "config.yaml").read_text()
    changed = run_cli("run", str(config), "--run-dir", str(run_dir), "--set", "rollout.group_size=8", "--set", "trainer.lr=0.01")
    assert changed.returncode == 2 and changed.stderr.count("\n") == 1 and "Traceback" not in changed.stderr
    assert "would change training: rollout.group_size (4 -> 8), trainer.lr (0.001 -> 0.01)." in changed.stderr
    assert "--force-new-config" in changed.stderr
    assert (run_dir / "config.yaml").read_text() == saved

    # keys that do not change training may change: more iterations, another number of workers
    more = ["--set", "trainer.iterations=3", "--set", "rollout.workers=2", "--no-progress"]
    forced = run_cli("run", str(config), "--run-dir", str(run_dir), "--set", "rollout.group_size=8", "--force-new-config", *more)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "resuming with changed training keys (--force-new-config): rollout.group_size (4 -> 8)" in forced.stderr
    assert [m["samples"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [6 * 4, 6 * 4, 6 * 8]


def test_the_embedded_nats_server_refuses_a_client_without_the_runs_token(tmp_path, write_config):
    """a local process without the run's credentials can neither consume work nor publish
    groups. The token is random per launch, in a 0600 file, which the roles read (--nats-token-file): it is in no
    role's environment (nats-server's alone, which its config reads) nor on any command line."""
    import nats
    import nats.errors

    config = write_config({**SLOW, "trainer.iterations": 3})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl"), proc)
    url = embedded_nats_url(run_dir)

    async def connect(**credentials) -> str:
        async def quiet(err):
            pass

        try:
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2, error_cb=quiet, **credentials)
        except nats.errors.Error as err:
            return str(err)
        await nc.close()
        return "connected"

    assert "Authorization Violation" in asyncio.run(connect())
    assert "Authorization Violation" in asyncio.run(connect(token="guessed"))
    token_file = run_dir / "nats-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert len(token) >= 32 and asyncio.run(connect(token=token)) == "connected"
    roles = 0
    for line in run_processes(run_dir):
        pid, cmdline = line.split(": ", 1)
        assert token not in cmdline  # not on any command line
        if " train " in cmdline or "rollout-worker" in cmdline:
            roles += 1
            assert f"--nats-token-file {token_file}" in cmdline
            assert token.encode() not in (Path("/proc") / pid / "environ").read_bytes(), cmdline
    assert roles == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    leaked = [str(p) for p in run_dir.rglob("*") if p.is_file() and p != token_file and token.encode() in p.read_bytes()]
    assert leaked == []  # not in a log, the config, nats-server.conf or the JetStream store


def test_no_role_is_given_the_snapshot_signing_key_and_the_trainer_signs_with_the_run_directorys(tmp_path, write_config, monkeypatch):
    """the run's Ed25519 private key stays in its 0600 file, which the trainer reads for itself: no role's environment
    (the trainer's included), command line or config holds it, nor the public key (each role reads the file), and a
    key in the user's shell under the old variable's name signs nothing."""
    from tidal.weights.signing import new_key_pair, public_key_of

    shell_key = new_key_pair()[0]
    monkeypatch.setenv("TIDAL_WEIGHTS_SIGNING_KEY", shell_key)  # the variable runs before this one read: ignored
    config = write_config({**SLOW, "trainer.iterations": 3})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    wait_until(lambda: read_jsonl(run_dir / "metrics.jsonl"), proc)
    private = (run_dir / "weights-signing-key").read_text().strip()
    public = public_key_of(private)
    assert stat.S_IMODE((run_dir / "weights-signing-key").stat().st_mode) == 0o600
    environs = {}
    for line in run_processes(run_dir):
        pid, cmdline = line.split(": ", 1)
        assert private not in cmdline and public not in cmdline
        role = "trainer" if " train " in cmdline else "worker" if "rollout-worker" in cmdline else "nats-server" if "nats-server" in cmdline else None
        if role:
            environs[role] = dict(v.split(b"=", 1) for v in (Path("/proc") / pid / "environ").read_bytes().split(b"\0") if b"=" in v)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert set(environs) == {"trainer", "worker", "nats-server"}, environs.keys()
    for role in ("trainer", "worker", "nats-server"):
        assert not any(private.encode() in value or public.encode() in value for value in environs[role].values()), role
    assert private not in (run_dir / "config.yaml").read_text() and public not in (run_dir / "config.yaml").read_text()
    # every version the worker loaded was signed by the trainer's key
    manifest = json.loads((run_dir / "weights" / "v000001" / "manifest.json").read_text())
    assert manifest["signature"]["public_key"] == public != public_key_of(shell_key)


def test_a_run_directory_that_is_a_file_is_one_clear_line(tmp_path, write_config):
    config = write_config({"eval.enabled": False})
    (tmp_path / "run").write_text("not a directory")
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"--run-dir {tmp_path / 'run'}: a file is in the way of the run directory" in proc.stderr


def test_an_unreachable_nats_url_is_one_clear_line_before_anything_starts(tmp_path, write_config):
    config = write_config({"eval.enabled": False, "transport.nats_url": "nats://127.0.0.1:1"})
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 75 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "cannot reach NATS at nats://127.0.0.1:1 (transport.nats_url): is it running?" in proc.stderr
    assert not (tmp_path / "run" / "run.json").exists()  # refused before the warm start and the MLflow run


def test_a_role_s_one_line_error_is_found_past_what_its_shutdown_prints_after_it():
    record = "2026-12-03 08:20:01,123 tidal.rollout.vllm_worker INFO worker worker-0 loaded weights v2 in 0.020s"
    error = "tidal: weights v3 did not arrive on worker worker-0: its log-probs differ"
    noise = ["nanobind: leaked 4 instances!", ' - leaked instance 0x7f19 of type "triton._C.libtriton.ir.attribute"', "  warnings.warn('x')"]
    assert last_error_line([record, error, *noise]) == "weights v3 did not arrive on worker worker-0: its log-probs differ"
    assert last_error_line([record, error]) == "weights v3 did not arrive on worker worker-0: its log-probs differ"
    assert last_error_line([error, record, *noise]) is None  # the role went on logging: the error is not its last word
    assert last_error_line([record, "Traceback (most recent call last):", '  File "x.py", line 1']) is None


def test_a_record_half_appended_is_not_read_until_its_line_is_whole(tmp_path):
    """The launcher follows metrics.jsonl while the trainer appends to it: a read can see the end of an
    append not yet written (or a line a killed writer cut short), which is no record yet."""
    import json

    from tidal.rundir import Records

    records = Records(tmp_path / "metrics.jsonl")
    records.append_many([{"iteration": 0}, {"iteration": 1}])
    whole = json.dumps({"iteration": 2, "reward_mean": 0.5}) + "\n"
    with records.path.open("a") as fh:
        fh.write(whole[:10])
    assert records.read_from(0) == ([{"iteration": 0}, {"iteration": 1}], 2)
    with records.path.open("a") as fh:
        fh.write(whole[10:])
    assert records.read_from(2) == ([{"iteration": 2, "reward_mean": 0.5}], 3)
    assert [r["iteration"] for r in records.read()] == [0, 1, 2]


def test_a_restarted_trainer_drops_a_record_its_killed_writer_cut_short_and_appends_on_a_fresh_line(tmp_path):
    from tidal.rundir import Records

    records = Records(tmp_path / "groups.jsonl")
    records.append_many([{"iteration": 0}, {"iteration": 1}])
    with records.path.open("a") as fh:
        fh.write('{"iteration": 1, "wor')
    assert records.drop(lambda r: r["iteration"] >= 1) == 1
    records.append({"iteration": 1})
    assert records.read() == [{"iteration": 0}, {"iteration": 1}]


def test_a_data_file_edited_in_place_since_the_last_start_is_a_training_change(tmp_path):
    from tidal.config import ConfigError, config_from_dict, dump_config
    from tidal.local import check_saved_config, data_file_digests
    from tidal.rundir import RunDir, RunInfo

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    cfg = config_from_dict({"data": {"task": "jsonl", "path": str(data)}})
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text(dump_config(cfg))
    run.data_digests.write_text(json.dumps(data_file_digests(cfg)))
    run.save_info(RunInfo(run_id="r", base_model="m", tracking_uri="", mlflow_run_id=""))
    check_saved_config(cfg, run)  # the same file: a resume
    before = data_file_digests(cfg)["data.path"]["sha256"]
    data.write_text(data.read_text().replace('"2"', '"3"'))
    after = data_file_digests(cfg)["data.path"]["sha256"]
    with pytest.raises(ConfigError) as err:
        check_saved_config(cfg, run)
    assert f"would change training: data.path {data}: its contents (sha256 {before[:12]} -> {after[:12]})" in str(err.value)
    check_saved_config(cfg, run, force=True)  # --force-new-config goes on with the new file
    run.data_digests.unlink()  # a run directory from before digests were kept: nothing to compare
    check_saved_config(cfg, run)


def test_a_run_directory_moved_after_it_stopped_resumes_there_and_logs_to_the_store_it_carries(tmp_path, write_config):
    """run.json and the run's own MLflow store record absolute paths: moved, a resume would open a store
    that is gone (it failed, and left a new empty store at the old place). Re-homed, it resumes, logs the
    new iteration to the same MLflow run in the store it carries, and registers an export there."""
    import shutil

    from tidal.rundir import RunDir

    config = write_config({"trainer.iterations": 1, "eval.enabled": False})
    first, moved = tmp_path / "first", tmp_path / "elsewhere" / "run"
    proc = run_cli("run", str(config), "--run-dir", str(first), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = RunDir(first).info().mlflow_run_id
    moved.parent.mkdir()
    shutil.move(str(first), str(moved))
    proc = run_cli("run", str(config), "--run-dir", str(moved), "--no-progress")  # finished: its summary again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"tidal: {moved} was moved or copied from {first}: its MLflow store now records this directory" in proc.stdout
    assert f"final weights        {moved / 'weights' / 'v000001'}" in proc.stdout
    proc = run_cli("run", str(config), "--run-dir", str(moved), "--no-progress", "--set", "trainer.iterations=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was moved or copied" not in proc.stdout  # re-homed once
    info = RunDir(moved).info()
    assert info.tracking_uri == f"sqlite:///{moved / 'mlflow.db'}" and info.mlflow_run_id == run_id
    client = MlflowClient(tracking_uri=info.tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "rollout/accuracy")] == [0, 1]  # both iterations, one MLflow run
    assert client.get_run(run_id).info.artifact_uri.startswith(moved.as_uri() + "/")
    proc = run_cli("export", str(moved), "--out", str(tmp_path / "model"), "--register", "moved-policy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (version,) = client.search_model_versions("name='moved-policy'")
    assert version.source.startswith(moved.as_uri() + "/") and (moved / "mlartifacts").is_dir()
    assert not first.exists()  # nothing written where the run used to be


def test_what_the_tests_start_with_run_cli_or_start_run_ends_when_the_test_process_is_killed(tmp_path):
    """A test session killed mid-run (SIGKILL, a CI timeout) leaves no `tidal run` behind: the helpers' children
    get SIGTERM from the kernel when the process that started them dies (tidal.supervise stops a run on it)."""
    script = (
        "import subprocess, sys, time\n"
        "from tests.conftest import ends_with_the_tests\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=ends_with_the_tests)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    child = int(starter.stdout.readline())
    started = start_time(child)
    assert running(child, started)
    starter.kill()
    starter.wait()
    assert left_running({child: started}, seconds=10) == []

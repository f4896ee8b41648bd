"""The capacity planner on an accelerator node: its model on hand-computed timings, the splits it
considers, and figures read from real finished runs (CPU runs here: there is no GPU on this machine,
so TP sizes above 1 and several ranks only appear in the hand-made profiles)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from tests.conftest import run_cli
from tidal.plan.devices import (
    DeviceProfile,
    DeviceSplit,
    device_splits,
    predict_colocated_sync,
    predict_device_split,
    profile_from_runs,
    run_figures,
)


def node(**kw) -> DeviceProfile:
    base = dict(devices=8, generate_seconds={1: 8.0, 2: 4.4}, train_seconds={1: 6.0, 2: 3.3}, boundary_seconds=0.2, calls=8)
    return DeviceProfile(**{**base, **kw})


def test_splits_fit_the_node_and_use_only_measured_sizes():
    splits = device_splits(node())
    assert splits and all(s.devices <= 8 for s in splits)
    assert {s.tensor_parallel for s in splits} == {1, 2} and {s.trainer_ranks for s in splits} == {1, 2}
    assert DeviceSplit(7, 1, 1) in splits and DeviceSplit(3, 2, 2) in splits
    assert DeviceSplit(4, 2, 1) not in splits  # 9 devices
    assert all(s.workers <= 2 for s in device_splits(node(), max_workers=2))


def test_a_generation_bound_split_trains_only_the_last_arrival_after_generation():
    # one TP-1 engine: 8 calls of 1.0 s; the trainer's 0.75 s per call keeps up, the last one trails
    p = predict_device_split(node(), DeviceSplit(1, 1, 1))
    assert p.iteration_seconds == pytest.approx(8.0 + 6.0 / 8 + 0.2)
    assert p.generate_seconds == pytest.approx(8.0) and p.train_seconds == pytest.approx(6.0)


def test_a_training_bound_split_waits_only_for_the_first_arrival():
    # 7 engines share 8 calls (7 arrive at 1.0 s, the 8th at 2.0 s); one rank trains 0.75 s per call from 1.0 s
    p = predict_device_split(node(), DeviceSplit(7, 1, 1))
    assert p.iteration_seconds == pytest.approx(1.0 + 8 * 0.75 + 0.2)
    # two ranks train twice as fast (3.3 s): 3 TP-2 engines (1 device spare) feed them
    q = predict_device_split(node(), DeviceSplit(3, 2, 2))
    assert q.iteration_seconds < p.iteration_seconds


def test_devices_do_not_slow_each_other_unlike_cpu_threads():
    # with a trainer as fast as generation is slow, the iteration is the generation plus one call's training
    profile = node(generate_seconds={1: 4.0}, train_seconds={1: 0.8}, calls=4)
    assert predict_device_split(profile, DeviceSplit(1, 1, 1)).iteration_seconds == pytest.approx(4.0 + 0.2 + 0.2)
    assert predict_device_split(profile, DeviceSplit(4, 1, 1)).iteration_seconds == pytest.approx(1.0 + 0.8 + 0.2)


def test_colocated_sync_needs_a_measured_whole_node_rank_count():
    assert predict_colocated_sync(node()) is None
    p, tp, ranks = predict_colocated_sync(node(train_seconds={1: 6.0, 8: 0.9}))
    # TP 1: 8 engines share 8 calls (1.0 s); TP 2: 4 engines (4.4 / 4 = 1.1 s)
    assert (tp, ranks) == (1, 8) and p.iteration_seconds == pytest.approx(1.0 + 0.9 + 0.2)


def test_the_command_refuses_without_figures_and_names_what_is_missing(tmp_path):
    out = run_cli("plan", "--devices", "4")
    assert out.returncode != 0 and "--from-runs" in out.stderr
    out = run_cli("plan", "--devices", "4", "--from-runs", str(tmp_path))
    assert out.returncode != 0 and "no config.yaml" in out.stderr


def test_a_profile_from_real_runs_and_the_plan_it_prints(tmp_path, write_config):
    """Two finished periodic runs (1 and 2 workers) are read as a user's runs on a node would be; the
    command then plans a 4-device node from them and a sync run is refused by name."""
    runs = []
    for workers in (1, 2):
        config = write_config({"trainer.iterations": 5, "rollout.workers": workers, "eval.enabled": False}, name=f"w{workers}.yaml")
        run_dir = tmp_path / f"run-w{workers}"
        done = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(run_dir)
    figures = [run_figures(r) for r in runs]
    assert [f.workers for f in figures] == [1, 2] and all(f.tensor_parallel == 1 and f.trainer_ranks == 1 for f in figures)
    assert all(f.generate_seconds > 0 and f.train_seconds > 0 and f.calls >= 1 for f in figures)
    profile = profile_from_runs(4, figures)
    with pytest.raises(ValueError, match="not of one job"):
        profile_from_runs(4, [figures[0], dataclasses.replace(figures[1], job="another")])
    assert profile.generate_seconds == {1: pytest.approx(statistics.median(f.generate_seconds for f in figures))}
    out = tmp_path / "plan.json"
    done = run_cli("plan", "--devices", "4", "--from-runs", *map(str, runs), "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "best periodic split" in done.stdout and "rollout.vllm.tensor_parallel_size=1" in done.stdout
    plan = json.loads(out.read_text())
    assert [p["split"]["workers"] for p in plan["predictions"]] and all(p["devices"] <= 4 for p in plan["predictions"])
    seconds = [p["iteration_seconds"] for p in plan["predictions"]]
    assert seconds == sorted(seconds)
    again = run_cli("plan", "--devices", "4", "--device-profile", str(out))
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == done.stdout.splitlines()[-1]
    sync = write_config({"trainer.iterations": 4, "mode": "sync", "eval.enabled": False}, name="sync.yaml")
    assert run_cli("run", str(sync), "--run-dir", str(tmp_path / "sync"), "--no-progress").returncode == 0
    with pytest.raises(ValueError, match="mode 'sync'"):
        run_figures(tmp_path / "sync")

"""`tidal chaos`: its accounting, and one real fault run end to end."""

import json
import random

import torch

from tests.conftest import run_cli
from tidal.chaos import FaultSummary, RunOutcome, format_table, group_accounting, relative_difference, scale_event, summarize


def test_group_accounting_counts_missing_and_repeated_groups():
    records = [{"iteration": 0, "prompt_id": p} for p in (1, 2, 3)] + [{"iteration": 1, "prompt_id": p} for p in (4, 4, 5)]
    assert group_accounting(records, iterations=2, prompts_per_iteration=3) == (1, 1)  # iteration 1 lacks one, has 4 twice
    assert group_accounting(records[:3], iterations=2, prompts_per_iteration=3) == (3, 0)


def test_relative_difference_is_against_the_largest_weight_and_refuses_other_shapes():
    b = {"w": torch.tensor([2.0, -4.0]), "v": torch.tensor([1.0])}
    a = {"w": torch.tensor([2.0, -4.0]), "v": torch.tensor([1.4])}
    assert abs(relative_difference(a, b) - 0.1) < 1e-6
    assert relative_difference({"w": torch.zeros(3), "v": torch.zeros(1)}, b) == float("inf")


def outcome(fault, **kw):
    base = dict(
        fault=fault,
        run=0,
        injected_at=1.0,
        returncode=0,
        wall_seconds=40.0,
        tail_seconds=30.0,
        groups_lost=0,
        groups_twice=0,
        hang=False,
        weights_rel_diff=0.0,
    )
    return RunOutcome(**{**base, **kw})


def test_a_run_that_lost_a_group_hung_or_drifted_fails_the_summary():
    outcomes = [
        outcome("worker-kill"),
        outcome("worker-kill", groups_lost=2),
        outcome("worker-kill", hang=True, returncode=None),
        outcome("worker-kill", weights_rel_diff=0.5),
    ]
    s = summarize("worker-kill", outcomes, reference_tail=25.0, tolerance=1e-4)
    assert (s.groups_lost, s.hangs, s.failed_runs, s.weights_match) == (2, 1, 3, 3)
    assert s.extra_seconds_median == 5.0  # the hung run is not a time
    table = format_table([s], 25.0, 1e-4, 0.0)
    assert "worker-kill" in table and "3/4 (worst 5.0e-01)" in table


def test_tidal_chaos_kills_a_worker_and_reports_nothing_lost(tmp_path, write_config):
    config = write_config({"reward.functions": [{"name": "tests.rewards:slow_exact_match"}]})
    out = tmp_path / "chaos.json"
    proc = run_cli(
        "chaos", str(config), "--faults", "worker-kill", "--runs", "1", "--iterations", "3", "--references", "1", "--json", str(out), timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (fault,) = [FaultSummary(**f) for f in result["faults"]]
    assert (fault.fault, fault.runs, fault.groups_lost, fault.groups_twice, fault.hangs, fault.failed_runs) == ("worker-kill", 1, 0, 0, 0, 0)
    assert fault.worst_weights_rel_diff is not None and fault.worst_weights_rel_diff <= 1e-4
    assert "worker-kill" in proc.stdout and "extra s" in proc.stdout
    print(proc.stdout)


def test_tidal_chaos_runs_a_lora_config_on_its_adapter_versions(tmp_path, write_config):
    """Under model.lora a version is the adapter alone: the corrupted snapshot and the final weights
    compared are adapter_model.safetensors."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
    config = write_config({"model.lora": lora, "trainer.lr": 2e-2, "reward.functions": [{"name": "tests.rewards:slow_exact_match"}]})
    out = tmp_path / "chaos.json"
    proc = run_cli(
        "chaos",
        str(config),
        "--faults",
        "snapshot-corrupt",
        "--runs",
        "1",
        "--iterations",
        "3",
        "--references",
        "1",
        "--json",
        str(out),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "snapshot-corrupt #0: ok at +" in proc.stdout, proc.stdout  # the adapter in use was corrupted (not: the run ended first)
    (fault,) = [FaultSummary(**f) for f in json.loads(out.read_text())["faults"]]
    assert (fault.fault, fault.runs, fault.groups_lost, fault.groups_twice, fault.hangs, fault.failed_runs) == ("snapshot-corrupt", 1, 0, 0, 0, 0)
    assert fault.worst_weights_rel_diff is not None and fault.worst_weights_rel_diff <= 1e-4


def test_a_versions_tensors_are_its_full_weights_or_its_adapter(tmp_path):
    from tidal.chaos import tensor_file

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_model.safetensors").write_bytes(b"")
    assert tensor_file(tmp_path / "full").name == "model.safetensors"
    assert tensor_file(tmp_path / "lora").name == "adapter_model.safetensors"
    assert tensor_file(tmp_path / "missing").name == "model.safetensors"  # nothing there: final_weights reports no weights


def test_scale_events_join_then_leave_then_stay_within_the_bounds():
    rng = random.Random(0)
    assert scale_event(rng, 1, (1, 3), 0) == "join" and scale_event(rng, 2, (1, 3), 1) == "leave"
    assert scale_event(rng, 3, (1, 3), 0) == "leave"  # at the top: the first event cannot be a join
    assert scale_event(rng, 2, (2, 2), 0) == "preempt"  # a fixed pool: only preemptions
    later = [scale_event(rng, w, (1, 3), 2 + i) for i, w in enumerate([1, 3] * 50)]
    assert set(later[0::2]) == {"join", "preempt"} and set(later[1::2]) == {"leave", "preempt"}


def test_tidal_chaos_scales_the_pool_during_a_run_and_nothing_is_lost(tmp_path, write_config):
    """Workers join, leave and are preempted at seeded points of a real run: every group is trained
    once by the version of its iteration and the run ends at the weights of an unscaled one."""
    config = write_config({"reward.functions": [{"name": "tests.rewards:paced_exact_match"}], "rollout.workers": {"min": 1, "max": 2}})
    out = tmp_path / "chaos.json"
    work = tmp_path / "work"
    proc = run_cli(
        *("chaos", str(config), "--faults", "scale", "--runs", "1", "--iterations", "10", "--references", "1"),
        # seed 4 draws both events early (at 10 % and 24 % of the span): the join comes early, and the leave,
        # which waits until the joined worker takes work (many seconds on a loaded machine), before the run ends
        *("--scale-events", "2", "--seed", "4", "--json", str(out), "--work-dir", str(work)),
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fault,) = [FaultSummary(**f) for f in json.loads(out.read_text())["faults"]]
    assert (fault.fault, fault.runs, fault.groups_lost, fault.groups_twice, fault.hangs, fault.failed_runs) == ("scale", 1, 0, 0, 0, 0)
    assert fault.worst_weights_rel_diff is not None and fault.worst_weights_rel_diff <= 1e-4
    events = fault.outcomes[0]["events"]
    assert len(events) == 2 and "join 1->2" in events[0] and "leave 2->1" in events[1], events
    records = [json.loads(line) for line in (work / "scale-0" / "groups.jsonl").read_text().splitlines()]
    assert records and all(r["policy_version"] == r["iteration"] for r in records)  # periodic: staleness 0
    launcher = (work / "scale-0" / "logs" / "launcher.log").read_text()
    assert "scaling rollout workers: 1 -> 2" in launcher and "scaling rollout workers: 2 -> 1" in launcher
    assert "worker worker-1 took " in (work / "scale-0" / "logs" / "worker-1.log").read_text()  # it joined and worked before it left
    assert "scale" in proc.stdout and "events:" in proc.stdout


def test_an_unknown_fault_is_named():
    proc = run_cli("chaos", "examples/arithmetic.yaml", "--faults", "worker-kill,disk-melt")
    assert proc.returncode == 2 and "unknown fault(s) disk-melt" in proc.stderr


def test_a_fault_follows_a_boundary_that_leaves_at_least_one_iteration_to_run():
    from tidal.chaos import injection_boundary

    rng = random.Random(0)
    for iterations in (2, 3, 4, 6):
        drawn = {injection_boundary(rng, iterations) for _ in range(200)}
        assert drawn == set(range(1, max(1, iterations - 2) + 1)), (iterations, drawn)

"""The capacity planner: its model of the periodic iteration on hand-computed and on recorded timings,
the splits it considers, `auto` in the config, and a real run that applies it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tidal.config import ConfigError, config_from_dict, load_config
from tidal.plan.model import (
    FLOOR_SLOWDOWN,
    Profile,
    Split,
    apply_plan,
    best_split,
    candidate_splits,
    format_pool,
    predict_periodic,
    predict_sync,
    recommend_pool,
    wants_plan,
)
from tidal.threads import split_cores

RECORDED = Path(__file__).parent / "data" / "plan_recorded.json"


def profile(**kw) -> Profile:
    base = dict(
        cores=4, generate_seconds={1: 2.0, 2: 1.2, 3: 1.0}, train_seconds={1: 1.6, 2: 1.0, 3: 0.8}, boundary_seconds=0.1, contention=1.0, calls=4
    )
    return Profile(**{**base, **kw})


def test_a_generation_bound_split_waits_for_the_last_arrival_then_trains_it():
    # 1 worker x 1 thread: generate 2.0 s; trainer 3 threads: 0.8 s, of which the last of 4 arrivals is 0.2 s
    p = predict_periodic(profile(), Split(1, 1, 3))
    assert p.generate_seconds == pytest.approx(2.0) and p.train_seconds == pytest.approx(0.8)
    assert p.iteration_seconds == pytest.approx(2.0 + 0.8 / 4 + 0.1)
    assert p.pipeline_efficiency == pytest.approx((2.0 + 0.1) / (2.3))


def test_a_training_bound_split_waits_for_the_first_arrival_then_trains_everything():
    # 4 engine calls of 0.5 s shared by 3 workers (the first three arrive at 0.5 s); trainer 1 thread: 0.4 s per call
    p = predict_periodic(profile(), Split(3, 1, 1))
    assert p.iteration_seconds == pytest.approx(0.5 + 4 * 0.4 + 0.1)


def test_the_busy_processes_share_the_cores_only_while_they_overlap():
    # 2 cores: while 2 workers and the trainer are all busy each runs at 2/3 speed; head and tail at full speed
    from tidal.plan.model import simulate_periodic

    assert simulate_periodic(1.0, 0.5, 2, 2, 1, 1, 2, 1.0) == pytest.approx(1.0 + 0.5 + 0.5)  # two workers fill the cores, then the trainer alone
    crowded = simulate_periodic(1.0, 0.5, 4, 2, 1, 1, 2, 1.0)
    assert 1.0 + 4 * 0.5 < crowded < 2 * 1.0 * 1.5 + 4 * 0.5


def test_tail_threads_speed_up_only_the_training_after_the_last_arrival():
    from tidal.plan.model import simulate_periodic

    # 2 calls of 1.0 s, 0.5 s of training each: the first call's training overlaps the second call,
    # the second call's runs alone, at twice the speed with the workers' cores
    assert simulate_periodic(1.0, 0.5, 2, 1, 1, 1, 2, 1.0) == pytest.approx(2.5)
    assert simulate_periodic(1.0, 0.5, 2, 1, 1, 1, 2, 1.0, tail_speedup=2.0) == pytest.approx(2.25)
    # training slower than generation: call 1's training (0.5 to 2.0) is still running when the last
    # group arrives (at 1.0), so it keeps one thread; only call 2's, started at 2.0, is faster
    assert simulate_periodic(0.5, 1.5, 2, 1, 1, 1, 2, 1.0, tail_speedup=2.0) == pytest.approx(0.5 + 1.5 + 0.75)
    from tidal.threads import tail_thread_total

    assert tail_thread_total("auto", 1, 1, cores=4) == 2  # its thread and its worker's
    assert tail_thread_total(8, 1, 2, cores=4) == 4  # never more than the cores
    assert tail_thread_total(3, 3, 1, cores=4) is None  # no more than it has
    assert tail_thread_total(None, 1, 1, cores=4) is None
    from tidal.config import TidalConfig
    from tidal.plan.model import planned_tail

    assert planned_tail(TidalConfig()) == "auto"  # periodic applies it; bounded and sync never do
    assert planned_tail(TidalConfig.model_validate({"mode": "bounded", "rollout": {"max_staleness": 1}})) is None
    assert planned_tail(TidalConfig.model_validate({"mode": "sync"})) is None
    plain, tail = predict_periodic(profile(), Split(1, 1, 1)), predict_periodic(profile(), Split(1, 1, 1), "auto")
    # 1 worker x 1 thread: 4 calls of 0.5 s; trainer 1 thread: 0.4 s per call, each done before the next
    # arrives; the last one's runs 1.6/1.0 times faster on 2 threads (the worker's idle core)
    assert plain.iteration_seconds == pytest.approx(2.0 + 0.4 + 0.1)
    assert tail.iteration_seconds == pytest.approx(2.0 + 0.4 / 1.6 + 0.1)


def test_oversubscription_and_contention_slow_both_roles():
    calm = predict_periodic(profile(), Split(1, 2, 2))
    crowded = predict_periodic(profile(), Split(1, 2, 3))  # 5 threads on 4 cores
    busy = predict_periodic(profile(contention=1.3), Split(1, 2, 2))
    assert crowded.generate_seconds == pytest.approx(calm.generate_seconds * 5 / 4)
    assert busy.train_seconds == pytest.approx(calm.train_seconds * 1.3)
    assert crowded.iteration_seconds > calm.iteration_seconds and busy.iteration_seconds > calm.iteration_seconds


def test_sync_gives_each_phase_every_thread_in_turn():
    s = predict_sync(profile(), 3)
    assert s.iteration_seconds == pytest.approx(1.0 + 0.8 + 0.1)


def test_the_splits_fill_the_cores_without_oversubscribing():
    assert candidate_splits(2) == [Split(1, 1, 1)]
    four = candidate_splits(4)
    assert all(s.threads <= 4 and s.workers >= 1 for s in four)
    assert {Split(1, 1, 1), Split(2, 1, 2), Split(1, 2, 2), Split(3, 1, 1), Split(1, 1, 3)} <= set(four)
    best = best_split(profile())
    assert best.iteration_seconds == min(predict_periodic(profile(), s).iteration_seconds for s in four)


def test_the_model_predicts_recorded_iterations_on_this_kind_of_machine_within_15_percent():
    """Recorded on a 2-core machine (tests/data/plan_recorded.json): `tidal plan`'s profile, then real
    `tidal run`s at each split. Calibrated on one split's run (`--from-run`: what the model leaves out,
    messaging and logging, scales every split alike), the model must predict each other split and sync
    mode at both thread counts within 15 %; uncalibrated it must at least rank the periodic splits as measured."""
    data = json.loads(RECORDED.read_text())
    prof = Profile.from_json(data["profile"])
    measured = data["measured_seconds"]
    base = data["calibrated_on"]
    factor = measured[base] / predict_periodic(prof, Split.parse(base)).iteration_seconds
    for split, seconds in measured.items():
        predicted = predict_periodic(prof, Split.parse(split)).iteration_seconds * factor
        assert abs(predicted - seconds) / seconds < 0.15, (split, predicted, seconds)
    for threads, seconds in data["measured_sync_seconds"].items():
        predicted = predict_sync(prof, int(threads)).iteration_seconds * factor
        assert abs(predicted - seconds) / seconds < 0.15, ("sync", threads, predicted, seconds)
    by_model = sorted(measured, key=lambda s: predict_periodic(prof, Split.parse(s)).iteration_seconds)
    assert by_model[-1] == max(measured, key=measured.get)  # the slowest split is the one the model calls slowest


def test_auto_is_accepted_only_where_the_planner_can_measure(tiny_config_dict):
    cfg = config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": "auto"}, "trainer": {"threads": "auto"}})
    assert wants_plan(cfg)
    assert split_cores(cfg, cores=4) == (2, 2)  # a role started outside `tidal run` reads auto as an even split
    sync = config_from_dict({**tiny_config_dict, "mode": "sync"})
    assert split_cores(sync, cores=4)[0] == 4  # sync mode has no worker process: the trainer generates on every core
    with pytest.raises(ConfigError, match="rollout.workers 'auto'"):
        config_from_dict({**tiny_config_dict, "rollout": {"workers": "auto", "engine": "vllm"}})
    with pytest.raises(ConfigError, match="rollout.workers"):
        config_from_dict({**tiny_config_dict, "rollout": {"workers": "many"}})


def test_apply_plan_replaces_auto_and_keeps_what_the_user_fixed(tiny_config_dict):
    cfg = config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": "auto"}, "trainer": {"threads": 1}})
    resolved, chosen = apply_plan(cfg, profile())
    assert resolved.trainer.threads == 1 and chosen.split.trainer_threads == 1
    assert isinstance(resolved.rollout.workers, int) and isinstance(resolved.rollout.threads, int)
    allowed = [s for s in candidate_splits(4) if s.trainer_threads == 1]
    assert chosen.iteration_seconds == min(predict_periodic(profile(), s, "auto").iteration_seconds for s in allowed)  # tail_threads: auto
    sync, chosen_sync = apply_plan(cfg.model_copy(update={"mode": "sync", "trainer": cfg.trainer.model_copy(update={"threads": "auto"})}), profile())
    assert chosen_sync.split is None and sync.trainer.threads == 3  # the fastest thread count for generate + train


def test_apply_plan_keeps_auto_workers_within_max_workers(tiny_config_dict):
    unbounded = config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": "auto"}})
    assert apply_plan(unbounded, profile())[0].rollout.workers > 1  # the bound below changes the choice
    bounded = config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": "auto", "max_workers": 1}})
    assert apply_plan(bounded, profile())[0].rollout.initial_workers == 1


def test_a_range_starting_auto_starts_the_planners_count_within_it_and_keeps_the_range(tiny_config_dict):
    def resolved(workers):
        cfg = config_from_dict({**tiny_config_dict, "rollout": {**tiny_config_dict["rollout"], "workers": workers}})
        return apply_plan(cfg, profile())[0].rollout

    best = resolved("auto").workers
    assert best == 2  # this profile's best split, unbounded; the ranges below hold it or clip it
    within = resolved({"min": 1, "max": 3, "start": "auto"})
    assert (within.initial_workers, within.worker_bounds) == (best, (1, 3))
    above = resolved({"min": 3, "max": 3, "start": "auto"})
    assert (above.initial_workers, above.worker_bounds) == (3, (3, 3))
    below = resolved({"min": 1, "max": 1, "start": "auto"})
    assert (below.initial_workers, below.worker_bounds) == (1, (1, 1))


def test_the_elastic_pool_is_the_balance_point_its_floor_and_the_queue_depth_that_calls_for_a_worker():
    # one engine generates an iteration in 2.0 s at 1 thread, the trainer trains it in 1.6 s at 1 thread:
    # ceil(2.0 / 1.6) = 2 workers keep up with it, and 3 would fit the 4 cores beside the trainer's 1
    pool = recommend_pool(profile(), worker_threads=1, trainer_threads=1, prompts_per_iteration=8)
    predicted = {w: predict_periodic(profile(), Split(w, 1, 1)).iteration_seconds for w in (1, 2)}
    assert pool.max == 2 and "no slower than the trainer" in pool.reasons[1]
    assert pool.min == min(w for w, t in predicted.items() if t <= FLOOR_SLOWDOWN * predicted[2])
    assert pool.lag_threshold == 4  # ceil(8 items / 2 workers)
    assert [r.split(" ")[0] for r in pool.reasons] == ["min", "max", "lag"]
    assert f"rollout.workers: {{min: {pool.min}, max: 2}}" in format_pool(pool, 1)
    # a trainer of 3 threads trains it in 0.8 s (3 workers would keep up), but 1 worker fits beside it
    small = recommend_pool(profile(), worker_threads=1, trainer_threads=3, prompts_per_iteration=8)
    assert (small.min, small.max, small.lag_threshold) == (1, 1, 8) and "fit the 4 cores" in small.reasons[1]
    # fewer work items than the balance point: no more workers than items
    few = recommend_pool(profile(cores=16), worker_threads=1, trainer_threads=1, prompts_per_iteration=1)
    assert few.max == 1 and "nothing to do" in few.reasons[1]
    slow_floor = recommend_pool(profile(cores=16, generate_seconds={1: 8.0}, train_seconds={1: 1.0}), 1, 1, 16)
    assert slow_floor.max == 8 and slow_floor.min > 1  # one worker alone would be far more than 1.5x slower


def test_tidal_plan_prints_the_elastic_pool_for_its_best_split_and_writes_it(tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "plan.json"
    proc = run_cli("plan", "examples/arithmetic.yaml", "--profile", str(RECORDED), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())
    pool = written["elastic_pool"]
    prof = Profile.from_json(written["profile"])
    best = min((p for p in written["predictions"]), key=lambda p: p["iteration_seconds"])["split"]
    expected = recommend_pool(prof, best["worker_threads"], best["trainer_threads"], 64, "auto")  # the example: 64 prompts, tail auto
    assert (pool["min"], pool["max"], pool["lag_threshold"]) == (expected.min, expected.max, expected.lag_threshold)
    lines = proc.stdout.splitlines()
    (head,) = [i for i, line in enumerate(lines) if line.startswith("elastic pool")]
    assert f"rollout.workers: {{min: {expected.min}, max: {expected.max}}}" in lines[head]
    assert [line.strip() for line in lines[head + 1 : head + 4]] == list(expected.reasons)


def test_a_run_with_auto_measures_once_applies_the_split_and_saves_it(tmp_path, write_config):
    """A real `tidal run`: the planner measures (real model, real processes), the roles get its split
    through the saved config.yaml, and the profile is cached for the next run of this config."""
    from tests.conftest import start_run

    config = write_config(
        {"rollout.workers": "auto", "rollout.threads": "auto", "trainer.threads": "auto", "trainer.iterations": 2, "eval.enabled": False}
    )
    proc = start_run(config, tmp_path / "run")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "capacity planner:" in out
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert isinstance(saved["rollout"]["workers"], int) and isinstance(saved["trainer"]["threads"], int)
    cache = yaml.safe_load(config.read_text())["model"]["warm_start"]["cache_dir"]
    plans = list((Path(cache) / "plans").glob("*.json"))
    assert plans and Profile.from_json(json.loads(plans[0].read_text())).generate_seconds
    load_config(tmp_path / "run" / "config.yaml")  # the saved config is a valid one
    # an elastic pool starting `auto`: the cached profile's count within the range, the range kept, the pool's advice printed
    elastic = write_config({"rollout.workers": {"min": 1, "max": 2, "start": "auto"}, "trainer.iterations": 2, "eval.enabled": False}, "elastic.yaml")
    proc = start_run(elastic, tmp_path / "elastic")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    workers = yaml.safe_load((tmp_path / "elastic" / "config.yaml").read_text())["rollout"]["workers"]
    assert workers["min"] == 1 and workers["max"] == 2 and workers["start"] in (1, 2)
    advice = [line for line in out.splitlines() if "elastic pool" in line]
    assert len(advice) == 1 and "rollout.workers: {min: " in advice[0] and "pending work item(s) per worker" in advice[0]
    assert all(f"  {figure} " in out for figure in ("min", "max", "lag threshold"))


def test_tidal_run_resolves_the_eval_followers_threads_into_the_config_in_every_mode():
    """the eval.every follower's threads are a setting of the run's config.yaml (it sets torch's threads from it),
    not a count the launcher computes into its environment; without a follower there is none."""
    from tidal.config import config_from_dict
    from tidal.threads import resolve_threads

    for mode in ("periodic", "sync", "bounded"):
        cfg = config_from_dict({"mode": mode, "rollout": {"workers": 2}, "eval": {"every": 5}})
        assert resolve_threads(cfg, cores=16).eval.threads == 4, mode  # 16 cores over 2 workers + 2
        assert resolve_threads(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"threads": 3})}), cores=16).eval.threads == 3
    assert resolve_threads(config_from_dict({"eval": {"every": None}}), cores=16).eval.threads is None
    assert resolve_threads(config_from_dict({"eval": {"every": 5, "enabled": False}}), cores=16).eval.threads is None


def test_sync_mode_generates_multi_turn_calls_on_one_thread_on_cpu_unless_rollout_threads_says(tiny_config_dict):
    import torch

    from tidal.threads import sync_generation_threads, torch_threads

    sync = config_from_dict({**tiny_config_dict, "mode": "sync"})
    agent = config_from_dict(
        {**tiny_config_dict, "mode": "sync", "rollout": {**tiny_config_dict["rollout"], "agent": {"env": "tools", "tools": ["calc"]}}}
    )
    assert sync_generation_threads(sync, on_cpu=True) is None  # single-turn: inline, on the trainer's threads
    assert sync_generation_threads(agent, on_cpu=True) == 1
    assert sync_generation_threads(agent, on_cpu=False) is None
    chosen = agent.model_copy(update={"rollout": agent.rollout.model_copy(update={"threads": 2})}, deep=True)
    assert sync_generation_threads(chosen, on_cpu=True) == 2
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before

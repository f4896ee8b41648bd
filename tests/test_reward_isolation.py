"""User reward functions run in a process of the worker's own: a hang, a crash or sys.exit scores 0,
is counted and logged with the prompt and the function, and the process is replaced. Real processes,
a real `tidal run`."""

import json
import logging

import pytest

from tests.conftest import read_jsonl, run_misbehaving_once, run_stopped_by_a_failing_reward
from tidal.config import ConfigError, RewardConfig, config_from_dict
from tidal.rewards import RewardError, RewardFailingError, RewardScorer, check_reward_names


def scorer(*names: str, timeout: float = 1.0) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(functions=[{"name": n} for n in names], timeout_seconds=timeout))


@pytest.mark.parametrize(
    "bad, kind",
    [("tests.rewards:hangs", "Timeout"), ("tests.rewards:crashes", "code -9"), ("tests.rewards:exits", "code 3")],
)
def test_a_hanging_crashing_or_exiting_reward_scores_zero_is_counted_and_its_process_replaced(bad, kind, caplog):
    s = scorer("exact_match", "tests.rewards:chatty", bad)
    try:
        with caplog.at_level(logging.WARNING, logger="tidal.rewards"):
            total, parts = s.score("A: 3", "3", prompt_id=17)
        assert parts == {"exact_match": 1.0, "tests.rewards:chatty": 0.25, bad: 0.0} and total == 1.25
        assert s.errors == 1
        warning = caplog.records[-1].getMessage()
        assert bad in warning and "prompt 17" in warning and kind in warning
        total, parts = s.score("A: 4", "3", prompt_id=18)  # the next call runs in a fresh process
        assert parts["tests.rewards:chatty"] == 0.25 and s.errors == 2 and s.process.started == 2
    finally:
        s.close()


def test_a_user_reward_that_raises_or_returns_a_string_is_an_error_in_its_process_not_a_replacement():
    s = scorer("tests.test_data_rewards:broken_reward", "tests.test_data_rewards:string_reward")
    try:
        assert s.score("A: 3", "3") == (0.0, {"tests.test_data_rewards:broken_reward": 0.0, "tests.test_data_rewards:string_reward": 0.0})
        assert s.errors == 2 and s.process.started == 1
        assert "TypeError" in s.last_error and "not a number" in s.last_error
    finally:
        s.close()


def test_a_prestarted_reward_process_is_running_before_the_first_score_and_serves_it():
    """A worker starts its user rewards' process beside its model load: the process exists before
    any call, and the first score uses it instead of starting another."""
    s = RewardScorer.from_config(RewardConfig(functions=[{"name": "tests.rewards:chatty"}]), prestart=True)
    try:
        process = s.process
        assert process.proc is not None and process.proc.poll() is None and not process.ready and process.started == 1
        pid = process.proc.pid
        assert s.score("A: 3", "3") == (0.25, {"tests.rewards:chatty": 0.25})
        assert process.ready and process.proc.pid == pid and process.started == 1 and s.errors == 0
    finally:
        s.close()


@pytest.mark.parametrize(
    "name, message",
    [
        ("tests.no_such_module:f", "cannot import module 'tests.no_such_module'"),
        ("tests.rewards:no_such_function", "tests.rewards has no callable 'no_such_function'"),
        (
            "tests.rewards:trl_style",
            r"'tests.rewards:trl_style'\(completions, \*\*kwargs\) -> list\[float\] cannot be called as fn\(completion: str, answer: str\)",
        ),
    ],
)
def test_reward_names_are_resolved_up_front_naming_the_function(name, message):
    with pytest.raises(RewardError, match=message):
        check_reward_names(RewardConfig(functions=[{"name": name}]))


def test_an_unknown_built_in_reward_name_is_refused_when_the_config_loads():
    """A bare name is a built-in's or nothing: the config refuses it, naming the built-ins; a module:function
    is resolved by check_reward_names in a reward process (above)."""
    with pytest.raises(ConfigError, match=r"unknown reward function 'no_such_builtin': built in are exact_match, format, math_verify"):
        config_from_dict({"reward": {"functions": [{"name": "no_such_builtin"}]}})


def test_a_run_survives_a_hanging_a_crashing_and_an_exiting_reward(tmp_path, write_config):
    """Before the reward process: the hang held its work item forever (the run failed at the group
    timeout, having logged nothing), the crash and sys.exit killed the worker."""
    rewards = ["exact_match", "tests.rewards:hangs_once", "tests.rewards:crashes_once", "tests.rewards:exits_once"]
    config = write_config(
        {"reward.functions": [{"name": n} for n in rewards], "reward.timeout_seconds": 1.0, "trainer.iterations": 2, "eval.enabled": False}
    )
    proc, run_dir, misbehaved = run_misbehaving_once(config, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert misbehaved == ["crashes", "exits", "hangs"]  # each misbehaved, once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_errors"] == 3 and summary["groups_trained"] == 2 * 6
    assert sum(m["reward_errors"] for m in read_jsonl(run_dir / "metrics.jsonl")) == 3
    log = (run_dir / "logs" / "worker-0.log").read_text()
    for name, kind in [("hangs_once", "Timeout"), ("crashes_once", "ProcessDied"), ("exits_once", "ProcessDied")]:
        assert f"reward function tests.rewards:{name} raised {kind}" in log
    assert log.count("(prompt ") >= 3
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()  # the worker itself never died


def test_a_function_failing_more_than_its_max_error_rate_stops_scoring_naming_it():
    broken, good = "tests.test_data_rewards:broken_reward", "tests.test_data_rewards:user_reward"
    cfg = RewardConfig(functions=[{"name": "exact_match"}, {"name": broken}, {"name": good}], max_error_rate=0.5, error_window=4)
    s = RewardScorer.from_config(cfg)
    try:
        for _ in range(3):  # a rate over a whole window only: 3 calls are not yet 4
            assert s.score("A: 3", "3")[1][broken] == 0.0
        with pytest.raises(RewardFailingError) as err:
            s.score("A: 3", "3")
        message = str(err.value)
        assert message.startswith(f"reward function {broken}: 4 of its last 4 calls failed, over reward.max_error_rate 0.5 of reward.error_window 4")
        assert message.endswith("last: tests.test_data_rewards:broken_reward: RuntimeError: user bug")
    finally:
        s.close()
    # at the default rate, a function that fails by design on half the samples trains on
    strict = "tests.rewards:raises_without_an_answer"
    sometimes = RewardScorer.from_config(RewardConfig(functions=[{"name": strict}], error_window=4))
    try:
        assert [sometimes.score(text, "3")[0] for text in ["A: 3", "no idea"] * 5] == [1.0, 0.0] * 5 and sometimes.errors == 5
    finally:
        sometimes.close()
    tolerant = RewardScorer.from_config(cfg.model_copy(update={"max_error_rate": 1.0}))
    try:
        for _ in range(10):
            assert tolerant.score("A: 3", "3") == (1.5, {"exact_match": 1.0, broken: 0.0, good: 0.5})
        assert tolerant.errors == 10
    finally:
        tolerant.close()


@pytest.mark.parametrize("mode", ["periodic", "sync"])
def test_a_run_whose_reward_function_fails_on_every_sample_stops_with_one_line_naming_it(tmp_path, write_config, mode):
    broken = "tests.test_data_rewards:broken_reward"
    functions = [{"name": "exact_match"}, {"name": broken}]
    config = write_config({"reward.functions": functions, "reward.error_window": 8, "mode": mode, "eval.enabled": False})
    run_dir = tmp_path / "run"
    last = run_stopped_by_a_failing_reward(config, run_dir, mode)
    assert last.startswith(f"reward function {broken}: 8 of its last 8 calls failed"), last
    assert not (run_dir / "groups.jsonl").is_file() or read_jsonl(run_dir / "groups.jsonl") == []  # nothing trained on its zeros


def test_a_multi_turn_trajectory_scored_by_a_failing_function_stops_too_not_scored_zero_by_the_environment_guard():
    from types import SimpleNamespace

    from tidal.envs.base import Trajectory
    from tidal.rollout.agent import AgentLoop

    broken = "tests.test_data_rewards:broken_reward"
    s = RewardScorer.from_config(RewardConfig(functions=[{"name": broken}], max_error_rate=0.0, error_window=1))
    env = SimpleNamespace(reward=lambda trajectory: None)  # no reward of its own: reward.functions score the final answer
    trajectory = Trajectory(problem=None, messages=[{"role": "assistant", "content": "A: 3"}])
    item = SimpleNamespace(answer="3", prompt_id=7, prompt="1+2=")
    try:
        with pytest.raises(RewardFailingError, match=f"reward function {broken}: 1 of its last 1 calls failed"):
            AgentLoop.reward(None, env, trajectory, item, s)
    finally:
        s.close()

"""Reward failures are loud: a reward that fails every call of a run's first iteration stops it with one
line naming the reward and its error; every reward and environment method that failed is named in the
end-of-run table, and a run whose failures exceed their max_error_rate exits non-zero even when it made
fewer calls than the error window. The tallies (tidal.rewards.failures) are pure and tested here too."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_jsonl, run_cli
from tests.test_served_rewards import StubServer
from tidal.config import RewardConfig
from tidal.protocol import REWARD_SERVER_FAILED_EXIT, Group, ProtocolError, decode_group, pack
from tidal.rewards import RewardScorer, check_failure_rates
from tidal.rewards.failures import FailureLedger, RewardFailingError, failing_every_call, merge_tallies, over_their_rate
from tidal.summary import reward_error_lines, run_failures

BROKEN = "tests.test_data_rewards:broken_reward"
STRING = "tests.test_data_rewards:string_reward"


# --- the tallies, pure -------------------------------------------------------------------------------


def test_a_ledger_counts_calls_and_failures_per_name_keeps_the_first_error_and_starts_afresh_when_taken():
    ledger = FailureLedger()
    ledger.record("f", failed=False)
    ledger.record("f", failed=True, error="ValueError: first")
    ledger.record("f", failed=True, error="ValueError: second")
    ledger.record("env.step()", failed=False, calls=3)
    assert ledger.take() == {"f": [3, 2, "ValueError: first"], "env.step()": [3, 0, ""]}
    assert ledger.take() is None


def test_tallies_merge_summing_counts_and_keeping_the_earliest_error():
    totals = merge_tallies({}, {"f": [4, 0, ""]})
    merge_tallies(totals, {"f": [4, 2, "late"], "g": [1, 1, "g broke"]})
    merge_tallies(totals, {"f": [4, 1, "later"]})
    merge_tallies(totals, None)
    assert totals == {"f": [12, 3, "late"], "g": [1, 1, "g broke"]}


def test_only_a_reward_failing_every_call_that_does_not_tolerate_it_is_found():
    tallies = {"ok": [24, 23, "x"], "bad": [24, 24, "RuntimeError: user bug"], "tolerated": [24, 24, "y"], "env.step()": [5, 5, "z"]}
    assert failing_every_call(tallies, {"ok": 0.99, "tolerated": 1.0}) is None  # env methods are not rewards
    assert failing_every_call(tallies, {"ok": 0.99, "bad": 0.99}) == ("bad", [24, 24, "RuntimeError: user bug"])
    assert failing_every_call({"bad": [0, 0, ""]}, {"bad": 0.5}) is None  # never called: nothing to say


def test_the_rate_is_judged_over_the_calls_made_however_few():
    tallies = {"a": [10, 10, "e"], "b": [10, 2, "e"], "c": [3, 0, ""]}
    assert over_their_rate(tallies, lambda name: 0.99) == ["a"]
    assert over_their_rate(tallies, lambda name: 0.1) == ["a", "b"]
    cfg = RewardConfig(functions=[{"name": "my.rewards:a"}, {"type": "reward_model", "name": "b", "url": "http://x", "max_error_rate": 0.1}])
    with pytest.raises(RewardFailingError, match=r"^my.rewards:a: 10 of its 10 calls failed, over its max_error_rate 0.99 .*first error: e$"):
        check_failure_rates(cfg, {"my.rewards:a": [10, 10, "e"]})
    with pytest.raises(RewardFailingError, match=r"^b: 2 of its 10 calls failed, over its max_error_rate 0.1"):
        check_failure_rates(cfg, {"b": [10, 2, "e"]})
    check_failure_rates(cfg, {"my.rewards:a": [10, 9, "e"], "environment E.step()": [100, 99, "e"]})  # within 0.99


def test_the_scorer_tallies_each_functions_calls_with_its_error():
    scorer = RewardScorer.from_config(RewardConfig(functions=[{"name": "exact_match"}, {"name": BROKEN}]))
    try:
        scorer.score("A: 3", "3")
        scorer.score("A: 4", "3")
    finally:
        scorer.close()
    assert scorer.ledger.take() == {"exact_match": [2, 0, ""], BROKEN: [2, 2, "RuntimeError: user bug"]}


def test_a_groups_failures_cross_the_wire_and_a_wrong_tally_is_a_protocol_error():
    import numpy as np

    from tidal.protocol import Sample

    sample = Sample(token_ids=np.array([1, 2], dtype=np.int32), logprobs=np.zeros(2, dtype=np.float32), reward=0.0)
    group = Group(0, 1, 0, "w", np.array([3], dtype=np.int32), [sample], failures={"f": [4, 4, "RuntimeError: user bug"]})
    assert decode_group(pack(group)).failures == {"f": [4, 4, "RuntimeError: user bug"]}
    group.failures = None
    assert "failures" not in pack(group).decode(errors="replace") and decode_group(pack(group)).failures is None
    for bad in ({"f": [2, 3, "more failed than called"]}, {"f": [1, 1]}, {"f": [1.5, 1, "x"]}, {"f": [1, 1, "x" * 5000]}, [1]):
        group.failures = bad
        with pytest.raises(ProtocolError, match=r"group 0/1\.failures"):
            decode_group(pack(group))


def test_the_end_of_run_table_names_each_failing_one_with_its_count_and_first_error():
    history = [{"failures": {"f": [24, 24, "RuntimeError: user bug"], "exact_match": [24, 0, ""]}}, {"failures": {"f": [24, 23, "later"]}}, {}]
    failures = run_failures(history)
    assert failures == {"f": [48, 47, "RuntimeError: user bug"], "exact_match": [24, 0, ""]}
    lines = reward_error_lines({"failures": failures, "reward_errors": 47})
    assert lines[0] == "  errors               f: 47 of 48 calls failed; first: RuntimeError: user bug"
    assert len(lines) == 2 and "47 reward(s) scored 0" in lines[1]  # exact_match never failed: not shown
    assert reward_error_lines({"failures": {"exact_match": [24, 0, ""]}, "reward_errors": 0}) == []


# --- real runs through the CLI ------------------------------------------------------------------------


def judge_answering_500(tmp_path) -> tuple[dict, list[str], StubServer]:
    server = StubServer(tmp_path, "--always", "500")
    # a window larger than the run: the first-iteration rule stops it, not the window
    judge = {"type": "judge", "name": "grader", "url": server.base + "/v1", "model": "m", "retries": 0, "error_window": 1000}
    return judge, ["reward grader failed every one of its", "HTTP 500", server.base], server


CASES = {
    "raises": lambda t: ({"name": BROKEN}, [f"reward {BROKEN} failed every one of its", "RuntimeError: user bug"], None),
    "returns a string": lambda t: ({"name": STRING}, [f"reward {STRING} failed every one of its", "'0.5'"], None),
    "refused url": lambda t: (
        {"type": "reward_model", "name": "rm", "url": "http://127.0.0.1:1/rm"},
        ["cannot reach reward 'rm' at http://127.0.0.1:1/rm (reward.functions[rm].url)"],
        None,
    ),
    "judge answering 500": judge_answering_500,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_always_failing_reward_ends_a_short_run_non_zero_with_one_line_naming_it(case, tmp_path, write_config):
    entry, expected, server = CASES[case](tmp_path)
    try:
        functions = [{"name": "exact_match"}, entry]
        config = write_config({"reward.functions": functions, "trainer.iterations": 2, "eval.enabled": False})
        run_dir = tmp_path / "run"
        proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", timeout=300)
    finally:
        if server is not None:
            server.stop()
    assert proc.returncode != 0 and "Tidal run finished" not in proc.stdout, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tidal: ") and all(text in last for text in expected), last
    if case != "refused url":  # the rest stop at the first iteration's end, before its step: nothing trained on the zeros
        assert proc.returncode == REWARD_SERVER_FAILED_EXIT and "iteration 0, the run's first" in last
        assert read_jsonl(run_dir / "metrics.jsonl") == []


def test_a_trainer_of_two_ranks_stops_on_a_failing_reward_with_one_line_and_no_restart(tmp_path, write_config):
    """torchrun exits 1 whatever its ranks exited with: the launcher reads why from the run directory."""
    config = write_config(
        {"reward.functions": [{"name": "exact_match"}, {"name": BROKEN}], "trainer.iterations": 2, "trainer.ranks": 2, "eval.enabled": False}
    )
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", timeout=300)
    assert proc.returncode == REWARD_SERVER_FAILED_EXIT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tidal: reward {BROKEN} failed every one of its") and "iteration 0, the run's first" in last, last
    assert "restarting from the last checkpoint" not in (run_dir / "logs" / "launcher.log").read_text()
    assert read_jsonl(run_dir / "metrics.jsonl") == []


def test_an_environment_whose_step_always_raises_is_named_in_the_table_and_the_run_exits_non_zero(tmp_path, write_config):
    config = write_config(
        {
            "rollout.agent.env": "tests.environments:StepRaises",
            "rollout.agent.tools": ["calc"],
            "rollout.agent.max_turns": 2,
            "rollout.max_new_tokens": 24,  # long enough for the barely warm-started model to end turns with EOS
            "trainer.iterations": 2,
            "eval.enabled": False,
        }
    )
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", timeout=300)
    assert proc.returncode == REWARD_SERVER_FAILED_EXIT, proc.stderr[-3000:]
    name = "environment StepRaises.step()"
    (row,) = [line for line in proc.stdout.splitlines() if name in line]
    calls, failed, error = json.loads((run_dir / "summary.json").read_text())["failures"][name]
    assert failed == calls > 0 and error == "RuntimeError: the sandbox is gone"
    assert row.endswith(f"{name}: {calls} of {calls} calls failed; first: RuntimeError: the sandbox is gone"), row
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tidal: {name}: {calls} of its {calls} calls failed, over its max_error_rate 0.99"), last

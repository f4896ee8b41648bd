"""Partial rollouts of multi-turn trajectories end to end in one process: a real trainer loop, real NATS and
real HF rollout workers in bounded mode with rollout.partial and rollout.agent (an environment that answers
every turn and scores 1 only when each of its turns was answered once). The trigger and the crash are those
of the single-turn tests (tests/test_partial_worker.py): iteration 1's first decode step waits until version 1
is published, and the trajectories in flight go on with it."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.conftest import read_jsonl
from tests.test_partial_worker import ITERATIONS, PROMPTS, die_after_new_weights_and_replay, held_until_published, scenario  # noqa: F401 (a fixture)
from tidal.config import config_from_dict

pytestmark = pytest.mark.usefixtures("held_until_published")  # iteration 1's first decode step waits for version 1


def bounded_partial_agent(tiny_config_dict):
    data = copy.deepcopy(tiny_config_dict)
    data |= {"mode": "bounded", "eval": {"enabled": False}}
    data["rollout"] |= {
        "partial": True,
        "max_staleness": 1,
        "groups_per_batch": 1,
        "max_new_tokens": 24,  # long enough for the barely warm-started model to end turns with EOS
        "agent": {"env": "tests.environments:Counted", "tools": ["calc"], "max_turns": 3},
    }
    data["trainer"] |= {"iterations": ITERATIONS, "prompts_per_iteration": PROMPTS, "group_timeout_seconds": 120.0}
    data["transport"] = {"ack_wait_seconds": 5.0}
    return config_from_dict(data)


def test_trajectories_started_with_version_0_go_on_with_version_1_every_turn_answered_once(tmp_path, tiny_config_dict, nats_server, request):
    cfg = bounded_partial_agent(tiny_config_dict)
    metrics, _ = asyncio.run(scenario(cfg, tmp_path, nats_server, ["w1"]))
    assert request.getfixturevalue("held_until_published") == [1]
    first, second = metrics
    assert first["mixed_version_sample_fraction"] == 0.0
    assert second["mixed_version_sample_fraction"] > 0.0 and 0.0 < second["token_staleness_fraction_1"] < 1.0
    assert second["staleness_max"] == 1.0
    assert any(m["agent_turns_mean"] > 1.0 for m in metrics)  # trajectories of several turns
    records = read_jsonl(tmp_path / "run" / "groups.jsonl")
    assert len(records) == len({(r["iteration"], r["prompt_id"]) for r in records}) == ITERATIONS * PROMPTS
    assert {r["reward_mean"] for r in records} == {1.0}  # no environment answered a turn twice, or missed one


@pytest.mark.parametrize("hands_back", [True, False], ids=["hands-back", "killed"])
def test_a_worker_that_dies_mid_trajectory_after_new_weights_loses_nothing_and_trains_nothing_twice(
    tmp_path,
    tiny_config_dict,
    nats_server,
    monkeypatch,
    hands_back,
):
    cfg = bounded_partial_agent(tiny_config_dict)
    metrics, records = die_after_new_weights_and_replay(cfg, tmp_path, nats_server, monkeypatch, hands_back)
    assert metrics[1]["mixed_version_sample_fraction"] == 0.0
    assert [m["samples"] for m in metrics] == [PROMPTS * cfg.rollout.group_size] * ITERATIONS
    assert {r["reward_mean"] for r in records} == {1.0}


def test_the_calculator_example_in_bounded_mode_with_partial_rollouts_finishes(tmp_path):
    """examples/calculator.yaml as shipped, shortened, with bounded k=1 and rollout.partial, run as a user runs it."""
    import json

    from tests.conftest import run_cli

    shorter = [
        "model.warm_start.steps=40",
        "model.warm_start.batch_size=16",
        f"model.warm_start.cache_dir={tmp_path / 'cache'}",
        "data.num_train=200",
        "rollout.group_size=4",
        "trainer.iterations=3",
        "trainer.prompts_per_iteration=4",
        "eval.enabled=false",
        "mode=bounded",
        "rollout.max_staleness=1",
        "rollout.partial=true",
    ]
    sets = [a for s in shorter for a in ("--set", s)]
    proc = run_cli("run", "examples/calculator.yaml", "--run-dir", str(tmp_path / "run"), *sets, "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "run" / "groups.jsonl")
    assert len(records) == len({(r["iteration"], r["prompt_id"]) for r in records}) == 3 * 4
    for m in (json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()):
        assert m["token_staleness_fraction_0"] + m["token_staleness_fraction_1"] == pytest.approx(1.0)
        assert m["agent_turns_mean"] >= 1.0

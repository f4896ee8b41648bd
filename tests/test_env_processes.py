"""A user's environment class lives in sandboxed environment processes (tidal.envs.sandboxed), never in
the worker or the launcher: its state lasts its trajectory, what a call starts ends with the call, and a
call that hangs, exits or runs out of memory fails its own trajectory (and those whose instances its
process held), never the worker; the process is replaced. tests/test_sandbox.py has what a hostile
environment tries and gets there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.hostile import running
from tidal import sandbox
from tidal.config import config_from_dict
from tidal.envs import EnvError, EnvironmentFactory
from tidal.envs.env_host import Problem
from tidal.envs.isolation import ToolLimits
from tidal.envs.sandboxed import EnvLimits, EnvProcessFailed
from tidal.preflight import check_environment

PROBLEM = Problem(0, "1+1=", "2")


def hosted(env: str, tools: list[str] | None = None, **limits) -> EnvironmentFactory:
    return EnvironmentFactory.from_names(env, tools or [], hosting=EnvLimits(**{"processes": 1, **limits}))


def started(factory: EnvironmentFactory):
    env = factory()
    env.reset(PROBLEM)
    return env


def text(env, turn: str) -> str:
    observations, done = env.step(turn)
    assert not done
    return observations[0]["content"]


def test_an_instance_keeps_its_state_across_its_calls_and_what_a_call_starts_ends_with_it():
    factory = hosted("tests.environments:Misbehaves")
    try:
        first, second = started(factory), started(factory)
        assert (text(first, "count"), text(first, "count"), text(second, "count")) == ("1", "2", "1")
        daemon = int(text(first, "daemon"))  # a sleeper in a session of its own
        assert running([daemon]) == []
        assert text(first, "count") == "4"  # the process itself goes on
        with pytest.raises(Exception, match="'no such cell'") as raised:
            first.step("raise")
        assert type(raised.value).__name__ == "KeyError"  # the log and the end-of-run table name the user's exception
        assert first.stats.turns == 0 and first.stats.env_seconds > 0  # Misbehaves counts no turns of its own; the worker times the calls
    finally:
        factory.close()


def test_a_call_past_its_timeout_fails_and_the_process_is_replaced_with_the_instances_it_held():
    factory = hosted("tests.environments:Misbehaves", timeout_seconds=1)
    try:
        hangs, neighbour = started(factory), started(factory)
        with pytest.raises(EnvProcessFailed, match=r"^Timeout: no answer within 1s \(rollout.agent.env_timeout_seconds\); its process was replaced"):
            hangs.step("hang")
        with pytest.raises(EnvProcessFailed, match="this trajectory's environment is gone"):
            neighbour.step("count")  # its state went with the process: it is never silently rebuilt
        assert text(started(factory), "count") == "1"  # a new trajectory gets the replacement
        assert factory.env_host.processes[0].started == 2
    finally:
        factory.close()


def test_a_step_that_calls_tools_for_ever_ends_at_the_trajectory_timeout():
    """Each tool call is a question to the worker, and the environment's own timeout counts only the
    time between them: the whole call is bounded by rollout.agent.trajectory_timeout_seconds."""
    factory = EnvironmentFactory.from_names(
        "tests.environments:CallsForEver", ["calc"], isolation=ToolLimits(), hosting=EnvLimits(processes=1, timeout_seconds=1, trajectory_seconds=2)
    )
    try:
        with pytest.raises(
            EnvProcessFailed, match=r"^Timeout: no answer within 2s \(rollout.agent.trajectory_timeout_seconds, its questions included\)"
        ):
            started(factory).step("go")
    finally:
        factory.close()


def test_an_exit_and_a_memory_limit_fail_one_call():
    factory = hosted("tests.environments:Misbehaves", memory_mb=600)
    try:
        with pytest.raises(EnvProcessFailed, match=r"^ProcessDied: its process exited with code 3"):
            started(factory).step("exit")
        with pytest.raises(Exception) as over:
            started(factory).step("allocate 1024")
        failure = f"{type(over.value).__name__}: {over.value}"  # its address space (RLIMIT_AS), or its control group's limit
        assert failure.startswith(("MemoryError: over its memory limit (600 MB, rollout.agent.env_memory_mb)", "EnvProcessFailed: ProcessDied")), (
            failure
        )
        assert text(started(factory), "count") == "1"
    finally:
        factory.close()


def test_its_tool_calls_run_in_the_workers_tool_processes_and_a_users_parser_in_its_own():
    """A turn's tool calls, read by the run's parser (a user's: in a sandboxed process of the worker's,
    like the tools), run in the worker's tool processes (rollout.agent.tools); the instance counts them."""
    factory = EnvironmentFactory.from_names(
        "tests.environments:Plain", ["calc"], "tests.environments:colon_calls", isolation=ToolLimits(), hosting=EnvLimits(processes=1)
    )
    try:
        env = started(factory)
        observations, done = env.step("calc: 6*7")
        assert observations == [{"role": "tool", "name": "calc", "content": "42"}] and not done
        assert env.step("42") == ([], True)
        assert (env.stats.turns, env.stats.tool_calls, env.stats.tool_errors) == (2, 1, 0)
    finally:
        factory.close()


@pytest.mark.parametrize(
    "env, tools, error",
    [
        ("tests.test_envs:NotAnEnvironment", [], "NotAnEnvironment must subclass tidal.envs.Environment"),
        ("no_such_module_xyz:Env", [], "cannot import module 'no_such_module_xyz'"),
        ("tests.test_envs:Broken", [], r"environment Broken\(\): RuntimeError: no database"),
        ("tests.test_envs:Counter", ["tests.test_envs:lookup"], "two tools are named 'lookup'"),
    ],
)
def test_a_hosted_environment_that_cannot_be_used_fails_at_once_as_it_would_in_the_worker(env, tools, error):
    with pytest.raises(EnvError, match=error):
        hosted(env, tools)


def test_the_launchers_check_imports_the_environment_only_in_its_sandboxed_process(tmp_path, monkeypatch):
    """tests.import_noted notes each process that imports it: the check imported it, in a process of
    its own, and the launcher never did."""
    monkeypatch.setenv("TIDAL_TEST_MARKERS", str(tmp_path))
    sys.modules.pop("tests.import_noted", None)
    sandbox.configure(sandbox.SandboxPolicy(write_paths=(str(tmp_path),)))
    try:
        check_environment(
            config_from_dict({"rollout": {"agent": {"env": "tests.import_noted:Noted", "tools": ["calc"]}}, "eval": {"enabled": False}})
        )
    finally:
        sandbox.configure(sandbox.SandboxPolicy())
    importers = [int(p.name.removeprefix("imported-")) for p in Path(tmp_path).glob("imported-*")]
    assert importers and os.getpid() not in importers and "tests.import_noted" not in sys.modules


def test_an_environment_process_that_dies_ends_the_trajectories_it_held_counted_under_its_name():
    """Through the agent loop on the HF engine: each trajectory that steps ends with env_error, its
    group keeps all its samples, and the group's tallies name the environment and what happened."""
    from tests.test_agent_loop import G, agent_config, items, tiny_engine
    from tidal.rewards import RewardScorer
    from tidal.rewards.failures import merge_tallies
    from tidal.rollout.generator import generate_groups

    engine, tok = tiny_engine()
    cfg = agent_config("tests.environments:Exits")
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w")
    assert all(len(g.samples) == G for g in groups)
    reasons = [s.finish_reason for g in groups for s in g.samples]
    tallies: dict = {}
    for g in groups:
        merge_tallies(tallies, g.failures)
    calls, failed, error = tallies["environment Exits.step()"]
    assert failed == calls == reasons.count("env_error") > 0  # one failed call per trajectory that stepped: the process died under it, or had
    assert error.startswith("EnvProcessFailed: "), error


def _noted_parser_factory(tmp_path, monkeypatch, parser, env="tools", tokenizer=None):
    monkeypatch.setenv("TIDAL_TEST_MARKERS", str(tmp_path))
    for secret in ("TIDAL_WEIGHTS_SIGNING_KEY", "TIDAL_NATS_TOKEN", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(secret, "the-runs-own")
    sys.modules.pop("tests.import_noted", None)
    sandbox.configure(sandbox.SandboxPolicy(write_paths=(str(tmp_path),)))
    hosting = EnvLimits(processes=1) if env != "tools" else None
    return EnvironmentFactory.from_names(env, ["calc"], parser, tokenizer, isolation=ToolLimits(), hosting=hosting)


@pytest.mark.parametrize("env", ["tools", "tests.environments:Plain"])
def test_a_users_tool_call_parser_runs_in_a_sandboxed_process_with_the_workers_tokenizer_and_no_secrets(env, tmp_path, monkeypatch):
    """The worker never imports the parser's module; the parser sees a copy of the worker's tokenizer
    (it encodes as the worker's does) and none of the run's secrets; for the built-in environment and
    for a user's environment class (whose process asks the worker to parse)."""
    from tidal.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    factory = _noted_parser_factory(tmp_path, monkeypatch, "tests.import_noted:noted_parser", env, tokenizer)
    try:
        instance = started(factory)
        if env == "tools":
            seen = json.loads(instance.parse("12+3").content)
            assert seen["encoded"] == tokenizer.encode("12+3")
            assert seen["pid"] != os.getpid() and seen["secrets"] == []
        else:  # the environment's process asks the worker to parse, which asks the parser's process
            assert instance.step("12+3") == ([], True)
            assert instance.stats.turns == 1
    finally:
        factory.close()
        sandbox.configure(sandbox.SandboxPolicy())
    importers = [int(p.name.removeprefix("imported-")) for p in Path(tmp_path).glob("imported-*")]
    assert importers and os.getpid() not in importers and "tests.import_noted" not in sys.modules


@pytest.mark.parametrize(
    "parser, error",
    [
        ("tests.import_noted:raises", "raised RuntimeError: cannot read 6\\*7"),
        ("tests.import_noted:returns_a_string", "raised TypeError: returned str, not a tidal.envs.ParsedTurn"),
    ],
)
def test_a_users_parser_that_fails_is_an_error_naming_it(parser, error, tmp_path, monkeypatch):
    factory = _noted_parser_factory(tmp_path, monkeypatch, parser)
    try:
        with pytest.raises(EnvError, match=f"rollout.agent.tool_parser '{parser}' {error}"):
            started(factory).parse("6*7")
    finally:
        factory.close()
        sandbox.configure(sandbox.SandboxPolicy())


def test_a_users_parser_that_cannot_be_imported_fails_when_the_factory_is_built():
    with pytest.raises(EnvError, match="rollout.agent.tool_parser 'no_such_module_xyz:parse'.*cannot import module 'no_such_module_xyz'"):
        EnvironmentFactory.from_names("tools", ["calc"], "no_such_module_xyz:parse", isolation=ToolLimits())


def test_a_users_parser_that_raises_ends_each_trajectory_that_steps_counted_and_the_worker_goes_on():
    """Through the agent loop on the HF engine: the parser's error ends the trajectory (env_error),
    every group keeps its samples, and the tallies say what was raised."""
    from tests.test_agent_loop import G, agent_config, items, tiny_engine
    from tidal.rewards import RewardScorer
    from tidal.rollout.generator import generate_groups

    engine, tok = tiny_engine()
    cfg = agent_config("tools", tool_parser="tests.import_noted:raises")
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items(), cfg, version=0, worker_id="w")
    assert all(len(g.samples) == G for g in groups)
    reasons = [s.finish_reason for g in groups for s in g.samples]
    assert reasons.count("env_error") > 0 and set(reasons) <= {"env_error", "length"}  # a turn cut at its length is not parsed
    errors = [error for g in groups for name, (_, failed, error) in g.failures.items() if name.endswith("step()") and failed]
    assert errors and all("rollout.agent.tool_parser 'tests.import_noted:raises' raised RuntimeError: cannot read" in e for e in errors), errors

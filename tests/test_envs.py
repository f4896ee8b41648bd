"""Environments and tools: schemas from signatures, tool-call parsing (good, malformed, several
calls, the tokenizer's response template and its silent failure), the step loop, and the config keys."""

from __future__ import annotations

import copy
import re

import pytest
from transformers.utils import get_json_schema

from tidal.config import ConfigError, config_from_dict
from tidal.data import Problem
from tidal.demo.tiny import build_char_tokenizer
from tidal.envs import (
    TOOL_CALL_PARSERS,
    EnvError,
    Environment,
    EnvironmentFactory,
    Tool,
    ToolCall,
    Trajectory,
    calc,
    hermes,
    hermes_regex,
    register_tool_call_parser,
    resolve_environment,
    resolve_tool,
    resolve_tool_call_parser,
    tool,
)
from tidal.preflight import check_environment

# --- tools used by the tests (importable as tests.test_envs:NAME) ------------------------------


def lookup(key: str, limit: int = 3) -> str:
    """Looks a key up.

    Args:
        key: What to look up.
        limit: How many results.
    """
    return f"{key}:{limit}"


def explode(reason: str) -> str:
    """Always raises.

    Args:
        reason: The message.
    """
    raise RuntimeError(reason)


def untyped(x):
    """No type hint."""


def undocumented(x: int) -> int:
    return x


class Counter(Environment):
    """A tool as a method (state per trajectory), a standalone tool, and its own first messages."""

    tools = (lookup,)

    def __init__(self):
        self.count = 0

    @tool
    def bump(self, by: int) -> int:
        """Adds to this trajectory's counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def reset(self, problem) -> list[dict]:
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": problem.prompt}]

    def reward(self, trajectory: Trajectory) -> dict[str, float]:
        return {"count": float(self.count), "turns": float(trajectory.stats.turns)}


class NotAnEnvironment:
    pass


class Broken(Environment):
    def __init__(self):
        raise RuntimeError("no database")


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --- schemas and tool calls --------------------------------------------------------------------


def test_a_tool_schema_is_transformers_get_json_schema_of_the_function():
    t = Tool.from_function(lookup)
    assert t.name == "lookup" and t.schema == get_json_schema(lookup)
    assert t.parameters["required"] == ["key"] and t.parameters["properties"]["limit"]["type"] == "integer"
    method = Counter().bump  # bound: no `self` in the schema
    assert Tool.from_function(method).parameters["properties"].keys() == {"by"}
    with pytest.raises(EnvError, match=r"tool tests\.test_envs\.untyped: no JSON schema .*missing a type hint"):
        Tool.from_function(untyped)
    with pytest.raises(EnvError, match=r"undocumented: no JSON schema .*no docstring"):
        Tool.from_function(undocumented)


def test_a_tool_checks_its_arguments_and_turns_failures_into_error_text():
    t = Tool.from_function(lookup)
    assert t({"key": "a"}).text == "a:3" and not t({"key": "a"}).error
    assert t({"key": "a", "limit": 5}).text == "a:5"
    for arguments, reason in [
        ({}, "missing required argument(s) ['key']"),
        ({"key": "a", "top": 1}, "unknown argument(s) ['top']; lookup takes ['key', 'limit']"),
        ({"key": 3}, "argument 'key' must be string, got int"),
        ({"key": "a", "limit": True}, "argument 'limit' must be integer, got bool"),
        (["a"], "arguments must be a JSON object, got list"),
    ]:
        result = t(arguments)
        assert result.error and result.text == f"error: lookup: {reason}"
    raised = Tool.from_function(explode)({"reason": "boom"})
    assert raised.error and raised.text == "error: explode raised RuntimeError: boom"
    assert Tool.from_function(Counter().bump)({"by": 2}).text == "2"  # non-string results are JSON


def test_the_built_in_calculator():
    assert calc("123 * 456") == "56088" and calc("(1 + 2) ** 3 - 4 / 2") == "25" and calc("7 / 2") == "3.5"
    for bad, reason in [("__import__('os')", "not arithmetic"), ("2 ** 999", "exponent 999 is too large"), ("1 +", "not an expression")]:
        with pytest.raises(ValueError, match=reason):
            calc(bad)
    assert resolve_tool("calc")({"expression": "1/0"}).text == "error: calc raised ZeroDivisionError: division by zero"


def test_one_call_several_calls_and_none():
    turn = hermes_regex("I will look.\n" + call("lookup", key="x") + "\n")
    assert turn.content == "I will look." and turn.calls == [ToolCall("lookup", {"key": "x"})] and turn.errors == []
    turn = hermes_regex(call("lookup", key="x") + call("calc", expression="1+1") + "done")
    assert [c.name for c in turn.calls] == ["lookup", "calc"] and turn.content == "done"
    turn = hermes_regex("A: 42")
    assert turn.content == "A: 42" and not turn.calls and not turn.errors and not turn.unparsable
    # the OpenAI form, and arguments written as a JSON string
    turn = hermes_regex('<tool_call>{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}</tool_call>')
    assert turn.calls == [ToolCall("f", {"a": 1})]


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": calc}</tool_call>', "tool call 1: not JSON (Expecting value at char 9)"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: no "name" string'),
        ('<tool_call>["calc"]</tool_call>', "tool call 1: expected a JSON object, got list"),
        ('<tool_call>{"name": "calc", "arguments": 3}</tool_call>', "tool call 1: \"arguments\" of 'calc' must be an object, got int"),
        ('<tool_call>{"name": "calc", "arguments": "{x"}</tool_call>', "tool call 1: arguments of 'calc' are not JSON"),
        ('<tool_call>{"name": "calc", "arguments": {}}', "tool call 1: no closing </tool_call>"),
    ],
)
def test_a_malformed_call_is_an_error_line(text, error):
    turn = hermes_regex(text)
    assert not turn.calls and len(turn.errors) == 1 and turn.errors[0].startswith(error)


def test_a_malformed_call_beside_good_ones():
    turn = hermes_regex(call("lookup", key="x") + "<tool_call>{oops}</tool_call>" + call("lookup", key="y"))
    assert [c.arguments["key"] for c in turn.calls] == ["x", "y"] and turn.errors[0].startswith("tool call 2: not JSON")


HERMES_TEMPLATE = {
    "version": 1,
    "start_anchor": "<assistant>",
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}


def test_the_tokenizers_response_template_reads_the_turn_when_it_has_one():
    """parse_response casts arguments by the tool's schema ("3" -> 3 for an integer), which the regex
    parser does not: the cast shows which parser read the turn."""
    tok = build_char_tokenizer()
    tok.response_template = copy.deepcopy(HERMES_TEMPLATE)
    schemas = [get_json_schema(lookup)]
    text = "Looking.\n" + call("lookup", key="x", limit="3")
    assert hermes_regex(text).calls == [ToolCall("lookup", {"key": "x", "limit": "3"})]
    turn = hermes(text, tokenizer=tok, tools=schemas)
    assert turn.calls == [ToolCall("lookup", {"key": "x", "limit": 3})] and turn.content == "Looking." and not turn.unparsable
    # parse_response raises on bad JSON: the regex parser names the bad call
    bad = hermes("<tool_call>{oops}</tool_call>", tokenizer=tok, tools=schemas)
    assert bad.errors[0].startswith("tool call 1: not JSON") and not bad.unparsable


def test_a_turn_the_response_template_silently_drops_is_counted_and_read_by_the_regex_parser():
    """A response template that does not know the model's tool-call markup returns it as plain text,
    without an error: the call would be lost and the turn taken as a final answer."""
    tok = build_char_tokenizer()
    tok.response_template = {"version": 1, "start_anchor": "<assistant>", "fields": {"content": {}}}
    turn = hermes(call("lookup", key="x"), tokenizer=tok)
    assert turn.unparsable and turn.calls == [ToolCall("lookup", {"key": "x"})]
    env = EnvironmentFactory(Environment, [Tool.from_function(lookup)], tokenizer=tok)()
    observations, done = env.step(call("lookup", key="x"))
    assert not done and observations == [{"role": "tool", "name": "lookup", "content": "x:3"}] and env.stats.unparsable_turns == 1


# --- the step loop -----------------------------------------------------------------------------


def test_the_step_loop_runs_calls_shows_errors_and_ends_on_an_answer():
    env = EnvironmentFactory.from_names("tools", ["calc", "tests.test_envs:explode"])()
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calc", "explode"]
    assert env.reset(Problem(0, "123*456=", "56088")) == [{"role": "user", "content": "123*456="}]
    script = [
        (call("calc", expression="123*456"), [{"role": "tool", "name": "calc", "content": "56088"}], False),
        (
            "<tool_call>{bad}</tool_call>" + call("nope") + call("explode", reason="r"),
            [
                {"role": "tool", "content": "error: tool call 1: not JSON (Expecting property name enclosed in double quotes at char 1)"},
                {"role": "tool", "name": "nope", "content": "error: unknown tool 'nope'; the tools are ['calc', 'explode']"},
                {"role": "tool", "name": "explode", "content": "error: explode raised RuntimeError: r"},
            ],
            False,
        ),
        ("A: 56088", [], True),
    ]
    for text, observations, done in script:
        assert env.step(text) == (observations, done)
    s = env.stats
    assert (s.turns, s.tool_calls, s.tool_errors, s.malformed_calls, s.refused_calls, s.unparsable_turns) == (3, 3, 2, 1, 0, 0)
    assert s.env_seconds > 0


def test_calls_past_the_limit_are_refused_with_an_error_observation():
    env = EnvironmentFactory.from_names("tools", ["calc"], max_tool_calls=2)()
    observations, done = env.step(call("calc", expression="1") + call("calc", expression="2") + call("calc", expression="3"))
    assert not done and [o["content"] for o in observations] == ["1", "2", "error: the limit of 2 tool calls is reached; answer now"]
    assert env.stats.tool_calls == 2 and env.stats.refused_calls == 1


def test_a_user_environment_has_its_own_tools_messages_reward_and_state_per_trajectory():
    factory = EnvironmentFactory.from_names("tests.test_envs:Counter", ["calc"])
    first, second = factory(), factory()
    assert sorted(s["function"]["name"] for s in first.tool_schemas) == ["bump", "calc", "lookup"]
    problem = Problem(3, "count to 5", "5")
    messages = first.reset(problem)
    assert messages[0]["role"] == "system"
    observations, done = first.step(call("bump", by=2) + call("bump", by=3))
    assert [o["content"] for o in observations] == ["2", "5"] and not done
    assert first.step("A: 5") == ([], True)
    trajectory = Trajectory(problem, [*messages, {"role": "assistant", "content": "A: 5"}], first.stats)
    assert first.reward(trajectory) == {"count": 5.0, "turns": 2.0} and trajectory.final_text == "A: 5"
    assert second.count == 0 and second.stats.tool_calls == 0  # a fresh instance per trajectory
    assert Environment().reward(trajectory) is None  # the base class leaves the reward to reward.functions


@pytest.mark.parametrize(
    "env, tools, error",
    [
        ("tests.test_envs:NotAnEnvironment", [], "NotAnEnvironment must subclass tidal.envs.Environment"),
        ("tests.test_envs:Missing", [], "module 'tests.test_envs' has no environment 'Missing'"),
        ("no_such_module_xyz:Env", [], "cannot import module 'no_such_module_xyz'"),
        ("tests.test_envs:Broken", [], r"environment Broken\(\): RuntimeError: no database"),
        ("tools", ["tests.test_envs:untyped"], "no JSON schema"),
        ("tools", ["tests.test_envs:lookup", "tests.test_envs:lookup"], "two tools are named 'lookup'"),
        ("tests.test_envs:Counter", ["tests.test_envs:lookup"], "two tools are named 'lookup'"),
        ("tools", ["calc"], None),
    ],
)
def test_environment_names_resolve_or_fail_naming_what_is_wrong(env, tools, error):
    if error is None:
        assert EnvironmentFactory.from_names(env, tools)().tool_schemas
        return
    with pytest.raises(EnvError, match=error):
        EnvironmentFactory.from_names(env, tools)


def test_the_launcher_checks_the_environment_before_anything_starts():
    cfg = config_from_dict(
        {"rollout": {"agent": {"env": "tests.test_envs:Counter", "tools": ["tests.test_envs:nothing"]}}, "eval": {"enabled": False}}
    )
    with pytest.raises(EnvError, match="module 'tests.test_envs' has no tool 'nothing'"):
        check_environment(cfg)
    check_environment(config_from_dict({"rollout": {"agent": {"env": "tools", "tools": ["calc"]}}, "eval": {"enabled": False}}))
    check_environment(config_from_dict({}))  # single-turn: nothing to check


# --- config ------------------------------------------------------------------------------------


def test_the_agent_block_loads_and_is_checked():
    cfg = config_from_dict(
        {
            "rollout": {"agent": {"env": "my.module:Env", "tools": ["calc", "my.tools:search"], "max_turns": 3, "max_tool_calls": 0}},
            "eval": {"enabled": False},
        }
    )
    a = cfg.rollout.agent
    assert (a.env, a.tools, a.tool_parser, a.max_turns, a.max_tool_calls) == ("my.module:Env", ["calc", "my.tools:search"], "hermes", 3, 0)
    assert config_from_dict({}).rollout.agent is None
    assert config_from_dict({"rollout": {"agent": {"env": "tools"}, "engine": "vllm"}, "eval": {"enabled": False}}).rollout.engine == "vllm"


def test_every_built_in_name_the_config_accepts_resolves():
    """The config reads the built-in names from these registries: each it accepts is one the worker can build."""
    cfg = config_from_dict({"rollout": {"agent": {"env": "tools", "tools": ["calc", "python"], "tool_parser": "hermes"}}, "eval": {"enabled": False}})
    assert resolve_environment(cfg.rollout.agent.env) is Environment
    assert [resolve_tool(t).name for t in cfg.rollout.agent.tools] == ["calc", "python"]
    assert resolve_tool_call_parser(cfg.rollout.agent.tool_parser) is hermes


def test_a_parser_registered_in_this_process_is_a_name_the_config_accepts():
    name = "tests_json_lines"
    register_tool_call_parser(name)(hermes)
    try:
        assert (
            config_from_dict({"rollout": {"agent": {"env": "tools", "tool_parser": name}}, "eval": {"enabled": False}}).rollout.agent.tool_parser
            == name
        )
    finally:
        TOOL_CALL_PARSERS.pop(name)
    with pytest.raises(ConfigError, match=f"unknown tool-call parser '{name}': built in are hermes, or give module:name"):
        config_from_dict({"rollout": {"agent": {"env": "tools", "tool_parser": name}}, "eval": {"enabled": False}})


@pytest.mark.parametrize(
    "agent, extra, error",
    [
        ({"env": "my env"}, {}, "rollout.agent.env: unknown environment 'my env': built in are tools, or give module:name"),
        ({"env": "tools", "tools": ["search"]}, {}, "rollout.agent.tools: unknown tool 'search': built in are calc, python, or give module:name"),
        ({"env": "tools", "tools": ["calc", "calc"]}, {}, "rollout.agent.tools: ['calc'] listed more than once"),
        (
            {"env": "tools", "tool_parser": "json"},
            {},
            "rollout.agent.tool_parser: unknown tool-call parser 'json': built in are hermes, or give module:name",
        ),
        ({"tools": ["calc"]}, {}, "rollout.agent.env: Field required"),
        ({"env": "tools", "max_turns": 0}, {}, "rollout.agent.max_turns: Input should be greater than 0"),
        ({"env": "tools", "max_env_tokens_per_turn": 0}, {}, "rollout.agent.max_env_tokens_per_turn: Input should be greater than 0"),
        ({"env": "tools", "trajectory_timeout_seconds": -1}, {}, "rollout.agent.trajectory_timeout_seconds: Input should be greater than 0"),
        ({"env": "tools", "max_tokens": 3}, {}, "rollout.agent.max_tokens: unknown key"),
        ({"env": "tools"}, {"reward": {"overlong_buffer": 4}}, "reward.overlong_buffer measures one response"),
        ({"env": "tools"}, {"eval": {"enabled": True, "engine": "vllm"}}, "held-out evaluation through rollout.agent runs on the HF engine"),
        ({"env": "tools"}, {"model": {"warm_start": {"stop_at_accuracy": 0.5}}}, "model.warm_start.stop_at_accuracy probes single answers"),
    ],
)
def test_a_bad_agent_config_is_one_clear_error(agent, extra, error):
    extra = {"eval": {"enabled": False}, **extra}
    with pytest.raises(ConfigError, match=re.escape(error)) as raised:
        config_from_dict({"rollout": {"agent": agent}, **extra})
    assert "\n" not in str(raised.value)

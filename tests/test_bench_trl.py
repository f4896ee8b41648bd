"""`tidal bench trl`: the mapping of Tidal's settings onto TRL's GRPOConfig (and the refusals), the
gradient comparison against TRL's real loss on a tiny model, and a smoke run of the command.

TRL is in the test extra (and the `bench` extra): these tests import it and fail, never skip, without it."""

from __future__ import annotations

import copy
import json

import pytest
import trl  # noqa: F401  (a missing TRL is a failure here, not a skip)

from tests.conftest import run_cli
from tidal.bench.versus_trl import (
    SettingsMismatch,
    check_settings,
    child_threads,
    gradient_check,
    prompt_rows,
    ratio_table,
    rep_orders,
    summarize_run,
    trl_reward_functions,
    trl_settings,
)
from tidal.config import config_from_dict
from tidal.data import load_dataset, prompts_for_iteration
from tidal.demo.warm_start import prepare_base_model
from tidal.rewards import RewardScorer

ARITHMETIC = {  # examples/arithmetic.yaml's RL settings
    "reward": {"functions": [{"name": "exact_match", "weight": 1.0}, {"name": "format", "weight": 0.1}]},
    "rollout": {"group_size": 8, "max_new_tokens": 10, "temperature": 1.0},
    "trainer": {"prompts_per_iteration": 64, "lr": 3e-4, "warmup_steps": 5, "clip_eps": 0.2, "kl_coef": 0.0},
}


def config(overrides: dict | None = None, base: dict | None = None):
    data = copy.deepcopy(base or ARITHMETIC)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_from_dict(data)


def test_the_example_settings_map_onto_grpo_config_one_for_one():
    kwargs, mismatches = trl_settings(config())
    assert mismatches == []
    assert kwargs["num_generations"] == 8 and kwargs["max_completion_length"] == 10 and kwargs["temperature"] == 1.0
    assert (kwargs["top_p"], kwargs["top_k"], kwargs["min_p"], kwargs["repetition_penalty"]) == (1.0, 0, None, 1.0)
    assert kwargs["learning_rate"] == 3e-4 and kwargs["epsilon"] == kwargs["epsilon_high"] == 0.2 and kwargs["beta"] == 0.0
    assert kwargs["loss_type"] == "dapo" and kwargs["scale_rewards"] == "group" and kwargs["importance_sampling_level"] == "token"
    assert kwargs["reward_weights"] == [1.0, 0.1] and kwargs["multi_objective_aggregation"] == "sum_then_normalize"
    # one optimizer step per generation batch of 64 x 8 completions, generated in one call
    assert kwargs["per_device_train_batch_size"] == 512 and kwargs["gradient_accumulation_steps"] == kwargs["steps_per_generation"] == 1
    assert kwargs["num_iterations"] == 1 and kwargs["shuffle_dataset"] is False and kwargs["use_vllm"] is False
    assert kwargs["bf16"] is False and kwargs["fp16"] is False and kwargs["gradient_checkpointing"] is False
    assert (kwargs["max_grad_norm"], kwargs["weight_decay"], kwargs["adam_beta1"], kwargs["adam_beta2"]) == (1.0, 0.0, 0.9, 0.999)


def test_micro_batches_keep_one_optimizer_step_per_generation_batch():
    kwargs, mismatches = trl_settings(config(), micro_batches=4)
    assert mismatches == []
    assert kwargs["per_device_train_batch_size"] == 128 and kwargs["gradient_accumulation_steps"] == kwargs["steps_per_generation"] == 4
    assert any("--trl-micro-batches 3" in m for m in trl_settings(config(), micro_batches=3)[1])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"trainer.loss_aggregation": "seq_mean_token_mean"}, {"loss_type": "grpo"}),
        ({"trainer.loss_aggregation": "seq_mean_token_sum_norm"}, {"loss_type": "dr_grpo"}),
        ({"trainer.policy_loss": "gspo"}, {"importance_sampling_level": "sequence"}),
        ({"trainer.advantage": "dr_grpo"}, {"scale_rewards": "none"}),
        ({"trainer.std_normalize": False}, {"scale_rewards": "none"}),
        ({"trainer.clip_eps_high": 0.28}, {"epsilon": 0.2, "epsilon_high": 0.28}),
        ({"rollout.temperature": 0.7, "trainer.max_grad_norm": 0.5}, {"temperature": 0.7, "max_grad_norm": 0.5}),
        ({"trainer.activation_checkpointing": True}, {"gradient_checkpointing": True}),
    ],
)
def test_each_mapped_setting(overrides, expected):
    kwargs, mismatches = trl_settings(config(overrides))
    assert mismatches == []
    assert {k: kwargs[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"trainer.kl_coef": 0.01}, "trainer.kl_coef"),
        ({"trainer.advantage": "rloo"}, "trainer.advantage"),
        ({"trainer.advantage": "tests.rewards:median_baseline"}, "trainer.advantage"),
        ({"trainer.dynamic_sampling": True}, "trainer.dynamic_sampling"),
        ({"trainer.tis_cap": 2.0}, "trainer.tis_cap"),
        ({"trainer.updates_per_iteration": 2}, "trainer.updates_per_iteration"),
        ({"trainer.loss_aggregation": "seq_mean_token_sum_norm", "trainer.aggregation_constant": 32.0}, "trainer.aggregation_constant"),
        ({"reward.overlong_buffer": 4}, "reward.overlong_buffer"),
        ({"rollout.engine": "vllm"}, "rollout.engine"),
        ({"rollout.deterministic": True}, "rollout.deterministic"),
        ({"trainer.strategy": "fsdp2"}, "trainer.strategy"),
    ],
)
def test_a_setting_without_a_trl_equivalent_is_refused_by_name(overrides, key):
    _, mismatches = trl_settings(config(overrides))
    assert len(mismatches) == 1 and mismatches[0].startswith(key), mismatches
    with pytest.raises(SettingsMismatch) as err:
        check_settings(config(overrides))
    assert key in str(err.value) and "cannot be run the same way in TRL" in str(err.value)


def test_every_refused_setting_is_listed_at_once():
    overrides = {"trainer.kl_coef": 0.01, "trainer.dynamic_sampling": True, "trainer.tis_cap": 2.0}
    assert [m.split()[0] for m in trl_settings(config(overrides))[1]] == ["trainer.kl_coef", "trainer.dynamic_sampling", "trainer.tis_cap"]


def test_the_command_refuses_before_running_and_names_the_settings(tmp_path):
    proc = run_cli("bench", "trl", "examples/arithmetic.yaml", "--set", "trainer.kl_coef=0.05", "--set", "trainer.dynamic_sampling=true")
    assert proc.returncode != 0
    assert "trainer.kl_coef 0.05" in proc.stderr and "trainer.dynamic_sampling" in proc.stderr and "Traceback" not in proc.stderr


def test_trl_reward_functions_score_as_tidals_scorer_does():
    cfg = config({"reward.functions": [{"name": "exact_match", "weight": 1.0}, {"name": "format", "weight": 0.1}]})
    funcs = trl_reward_functions(cfg)
    completions = ["A: 12", "A: 13", "12", "A: 12\nmore", "A: x"]
    answers = ["12"] * len(completions)
    trl_sums = [sum(w.weight * f([""] * 5, completions, answers)[i] for f, w in zip(funcs, cfg.reward.functions)) for i in range(5)]
    scorer = RewardScorer.from_config(cfg.reward)
    assert trl_sums == pytest.approx([scorer.score(c, a)[0] for c, a in zip(completions, answers)])
    chat = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's completions for chat prompts
    assert funcs[0]([""] * 5, chat, answers) == funcs[0]([""] * 5, completions, answers)


def test_trl_steps_get_tidals_prompts_of_each_iteration_in_order(tiny_config_dict):
    cfg = config_from_dict(copy.deepcopy(tiny_config_dict))
    dataset = load_dataset(cfg.data, cfg.seed)
    rows = prompt_rows(cfg, dataset, 3)
    P = cfg.trainer.prompts_per_iteration
    for v in range(3):
        expected = prompts_for_iteration(dataset, cfg.seed, v, P)
        assert [r["prompt_id"] for r in rows[v * P : (v + 1) * P]] == [p.id for p in expected]
        assert {r["iteration"] for r in rows[v * P : (v + 1) * P]} == {v}


# --- the gradient comparison: Tidal's learner against TRL's own scoring and loss, real forward/backward passes


@pytest.fixture
def graded(tiny_config_dict):
    """The tiny model with a graded reward, so every group carries signal."""

    def make(overrides: dict | None = None):
        data = copy.deepcopy(tiny_config_dict)
        data["reward"] = {"functions": [{"name": "tests.rewards:digit_count", "weight": 0.5}, {"name": "format", "weight": 0.1}]}
        cfg = config(overrides, base=data)
        dataset = load_dataset(cfg.data, cfg.seed)
        return cfg, dataset, str(prepare_base_model(cfg, dataset))

    return make


@pytest.mark.parametrize(
    ("overrides", "micro_batches"),
    [
        ({}, 1),
        ({"trainer.policy_loss": "gspo", "trainer.loss_aggregation": "seq_mean_token_mean"}, 2),
        ({"trainer.advantage": "dr_grpo", "trainer.loss_aggregation": "seq_mean_token_sum_norm", "trainer.clip_eps_high": 0.28}, 1),
    ],
)
def test_tidal_and_trl_give_the_same_gradient_on_the_same_completions(graded, tmp_path, overrides, micro_batches):
    cfg, dataset, base = graded(overrides)
    result = gradient_check(cfg, base, dataset, tmp_path, micro_batches)
    assert result["samples"] == cfg.trainer.prompts_per_iteration * cfg.rollout.group_size and result["tokens"] > result["samples"]
    assert result["groups_without_signal"] < cfg.trainer.prompts_per_iteration
    # what is left is TRL's std epsilon (1e-4 against Tidal's 1e-6): none without the std division
    limit = 1e-5 if cfg.trainer.advantage == "dr_grpo" else 2e-3
    assert result["max_relative_grad_diff"] < limit and result["advantage_max_abs_diff"] < 1e-2
    assert result["max_relative_grad_diff_loss_only"] < 1e-5  # the loss itself: float summation order


@pytest.mark.parametrize(("wrong", "why"), [({"scale_rewards": "none"}, "advantage"), ({"loss_type": "grpo"}, "aggregation")])
def test_the_gradient_check_catches_a_wrong_mapping(graded, tmp_path, wrong, why):
    cfg, dataset, base = graded()
    result = gradient_check(cfg, base, dataset, tmp_path, settings_override=wrong)
    assert result["max_relative_grad_diff"] > 0.05, (why, result)


# --- the timing and its figures


def test_step_seconds_run_end_to_end_and_the_warmup_is_left_out():
    raw = {"step_seconds": [9.0, 2.0, 2.0], "generate_seconds": [5.0, 1.0, 1.0], "reward_mean": [0.1, 0.2, 0.4], "samples": [16.0] * 3}
    s = summarize_run(raw, 1, 16)
    assert s["seconds_per_iteration"] == 2.0 and s["samples_per_s"] == 8.0 and s["reward_mean_measured"] == pytest.approx(0.3)
    assert s["generate_seconds_mean"] == 1.0 and s["iterations_measured"] == 2
    with pytest.raises(SystemExit, match="not 32"):
        summarize_run(raw, 1, 32)
    with pytest.raises(SystemExit, match="no iteration left to measure"):
        summarize_run(raw, 3, 16)


def test_trl_takes_trainer_threads_when_it_is_a_number_and_every_core_otherwise():
    assert child_threads(config({"trainer.threads": 1}), 2) == 1
    assert child_threads(config({"trainer.threads": 3}), 2) == 3
    assert child_threads(config(), 2) == 2  # the default, auto
    assert child_threads(config({"trainer.threads": "auto"}), 16) == 16


def test_repetitions_alternate_the_order_and_ratios_are_against_trl_and_sync():
    assert rep_orders(["trl", "sync", "periodic"], 3) == [["trl", "sync", "periodic"], ["periodic", "sync", "trl"], ["trl", "sync", "periodic"]]

    def rep(trl_s, sync_s, periodic_s):
        seconds = {"trl": trl_s, "sync": sync_s, "periodic": periodic_s}
        return {"samples_per_step": 100, "results": {name: {"seconds_per_iteration": s} for name, s in seconds.items()}}

    table = ratio_table([rep(1.0, 0.5, 0.5), rep(2.0, 1.0, 0.5), rep(1.0, 2.0, 1.0)], ["trl", "sync", "periodic"])
    assert table["trl"]["vs_trl"] == 1.0 and table["trl"]["samples_per_s"] == 100.0
    assert table["sync"]["vs_trl_per_rep"] == [2.0, 2.0, 0.5] and table["sync"]["seconds_per_step_median"] == 1.0 and table["sync"]["vs_trl"] == 1.0
    assert table["periodic"]["vs_sync_per_rep"] == [1.0, 2.0, 2.0] and table["periodic"]["vs_sync"] == 2.0 and table["sync"]["vs_sync"] == 1.0


def test_tidal_bench_trl_runs_trl_and_tidal_side_by_side(write_config, tmp_path):
    path = write_config({"reward.functions": [{"name": "tests.rewards:digit_count", "weight": 0.5}, {"name": "format", "weight": 0.1}]})
    out = tmp_path / "trl.json"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli("bench", "trl", str(path), "--steps", "2", "--warmup", "1", "--reps", "1", "--json", str(out), "--tracking-uri", store)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["gradient_check"]["max_relative_grad_diff"] < 2e-3
    summary = figures["summary"]
    assert list(summary) == ["trl", "sync", "periodic"] and summary["trl"]["vs_trl"] == 1.0 and summary["sync"]["vs_sync"] == 1.0
    (rep,) = figures["repetitions"]
    assert rep["order"] == ["trl", "sync", "periodic"]
    for name, result in rep["results"].items():
        assert len(result["step_seconds"]) == 2 and result["seconds_per_iteration"] == result["step_seconds"][1] > 0, name
        assert (
            result["samples"] == [24.0, 24.0]
            and summary[name]["vs_trl"] == summary["trl"]["seconds_per_step_median"] / result["seconds_per_iteration"]
        )
    assert "| periodic |" in proc.stdout and "samples/s vs TRL" in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("tidal-bench-trl").experiment_id])
    assert sorted(r.data.tags["system"] for r in runs) == ["periodic", "sync", "trl"]
    trl_run = next(r for r in runs if r.data.tags["system"] == "trl")
    assert [m.step for m in client.get_metric_history(trl_run.info.run_id, "time/step_seconds")] == [0, 1]
    assert trl_run.data.params["trl.loss_type"] == "dapo" and trl_run.info.status == "FINISHED"


# --- multi-turn: examples/calculator.yaml against TRL's tools= loop


def calculator(overrides: list[str] | None = None):
    from tidal.config import load_config

    return load_config("examples/calculator.yaml", overrides or [])


def test_the_calculator_settings_map_onto_trls_tool_loop():
    cfg = calculator()
    kwargs, mismatches = trl_settings(cfg)
    assert mismatches == []
    # a turn at most max_new_tokens (every generate call); at most max_turns turns; the trajectory's cap is
    # the most Tidal's can hold (3 turns of 80 + 2 observations of 96), so TRL never cuts one Tidal would not
    assert kwargs["generation_kwargs"] == {"max_new_tokens": 80} and kwargs["max_tool_calling_iterations"] == 2
    assert kwargs["max_completion_length"] == 3 * 80 + 2 * 96 == 432
    assert kwargs["num_generations"] == 8 and kwargs["per_device_train_batch_size"] == 256 and kwargs["reward_weights"] == [1.0]
    assert kwargs["loss_type"] == "dapo" and kwargs["beta"] == 0.0 and kwargs["use_vllm"] is False


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["rollout.agent.env=tests.envs:Custom"], "rollout.agent.env"),
        (["rollout.agent.tool_parser=tests.envs:parser"], "rollout.agent.tool_parser"),
        (["rollout.agent.max_tool_calls=1"], "rollout.agent.max_tool_calls"),
        (["rollout.agent.tool_latency.p50_seconds=0.05"], "rollout.agent.tool_latency"),
        (["trainer.loss_aggregation=seq_mean_token_sum_norm"], "trainer.aggregation_constant"),
        (["rollout.engine=vllm"], "rollout.engine"),
    ],
)
def test_a_calculator_setting_without_a_trl_equivalent_is_refused_by_name(overrides, key):
    _, mismatches = trl_settings(calculator(overrides))
    assert len(mismatches) == 1 and mismatches[0].startswith(key), mismatches


def test_dr_grpo_on_trajectories_needs_trls_trajectory_cap_as_its_constant():
    ok = ["trainer.loss_aggregation=seq_mean_token_sum_norm", "trainer.aggregation_constant=432"]
    kwargs, mismatches = trl_settings(calculator(ok))
    assert mismatches == [] and kwargs["loss_type"] == "dr_grpo" and kwargs["max_completion_length"] == 432


def test_the_command_refuses_the_calculator_settings_before_running(tmp_path):
    proc = run_cli(
        "bench",
        "trl",
        "--config",
        "examples/calculator.yaml",
        "--set",
        "rollout.agent.max_tool_calls=1",
        "--set",
        "rollout.agent.tool_latency.p50_seconds=0.1",
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "rollout.agent.max_tool_calls 1" in proc.stderr and "rollout.agent.tool_latency" in proc.stderr


def test_trl_accepts_the_tiny_tokenizer_only_with_the_benchs_templates_and_parses_its_calls():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from tidal.bench.versus_trl import prepare_tokenizer
    from tidal.demo.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    saved = build_char_tokenizer()
    saved.chat_template = TOOL_CHAT_TEMPLATE  # what the warm start saves: calls live in the text, tool_calls are not rendered
    assert not supports_tool_calling(saved)  # TRL's GRPOTrainer(tools=...) refuses it
    tok = prepare_tokenizer(calculator(), build_char_tokenizer())
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "931*140="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    # the prompt and what follows a turn's EOS render as before: only assistant messages with tool_calls differ
    assert prompt == saved.apply_chat_template(
        [{"role": "user", "content": "931*140="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )

    def parse(text):
        return parse_response(tok, tok(text, add_special_tokens=False).input_ids, prefix=prompt)

    call = parse('<tool_call>{"name":"calc","arguments":{"expression":"931*140"}}</tool_call><eos>')
    assert call["tool_calls"] == [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "931*140"}}}]
    assert parse("A: 130340<eos>") == {"role": "assistant", "content": "A: 130340"}
    assert "tool_calls" not in parse('<tool_call>{"name":"calc","argu</tool_call><eos>')  # TRL ends such a trajectory


def test_trl_gets_tidals_tool_with_its_schema_error_texts_and_observation_cut():
    from transformers.utils import get_json_schema

    from tidal.bench.versus_trl import agent_loop, prepare_tokenizer, trl_tools
    from tidal.demo.tiny import build_char_tokenizer
    from tidal.envs import resolve_tool

    tok = prepare_tokenizer(calculator(), build_char_tokenizer())
    (calc,) = trl_tools(calculator(), tok)
    assert calc.__name__ == "calc" and get_json_schema(calc) == resolve_tool("calc").schema
    assert calc(expression="6*7") == "42"
    assert calc(expr="6*7") == "error: calc: unknown argument(s) ['expr']; calc takes ['expression']"  # Tidal's text, not a TypeError
    cfg = calculator(["rollout.agent.max_env_tokens_per_turn=16"])
    (calc,) = trl_tools(cfg, tok)
    long = calc(expression="1" * 40 + "*1")
    assert long.endswith("…") and long.startswith("1111")
    loop = agent_loop(cfg, tok)
    assert len(loop.inserted_tokens([{"role": "tool", "name": "calc", "content": long}], [resolve_tool("calc").schema])) <= 16


def test_the_final_answer_and_the_departures_from_tidals_loop_are_read_from_trls_messages():
    from tidal.bench.versus_trl import final_text, tool_divergences

    def call(expression):
        return {"type": "function", "function": {"name": "calc", "arguments": {"expression": expression}}}

    used = [{"role": "assistant", "content": "", "tool_calls": [call("2*3")]}, {"role": "tool", "name": "calc", "content": "6"}]
    used.append({"role": "assistant", "content": "A: 6"})
    assert final_text(used) == "A: 6" and completion_text_of(used) == "A: 6"
    cut_at_max_turns = [{"role": "assistant", "content": "", "tool_calls": [call("1")]}]
    assert final_text(cut_at_max_turns) == '<tool_call>{"name":"calc","arguments":{"expression":"1"}}</tool_call>'
    greedy = [
        {"role": "assistant", "content": "", "tool_calls": [call("1"), call("2")]},
        {"role": "tool", "name": "calc", "content": "1"},
        {"role": "tool", "name": "calc", "content": "2"},
        {"role": "assistant", "content": "", "tool_calls": [call("3")]},
        {"role": "tool", "name": "calc", "content": "3"},
        {"role": "assistant", "content": "A: 3"},
    ]
    broken = [{"role": "assistant", "content": '<tool_call>{"name":"calc","argu</tool_call>'}]
    unknown = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "name": "search", "content": "x"}]
    counts = tool_divergences([used, greedy, broken, unknown], calculator())
    assert counts == {"over_call_budget": 1, "multi_call_turns": 1, "unparsed_tool_calls": 1, "unknown_tools": 1}


def completion_text_of(messages):
    from tidal.bench.versus_trl import completion_text

    return completion_text(messages)

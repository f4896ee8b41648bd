"""Rewards from served models: the protocols, the config, the client against a real HTTP server
process that misbehaves on purpose (tests.reward_stub), `tidal serve-reward` with a real model, and
short real runs that survive faults, or stop with one line when an endpoint fails too often."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, background_run, read_jsonl, run_cli, run_processes, run_stopped_by_a_failing_reward, wait_until
from tidal.config import ConfigError, RewardConfig, config_from_dict
from tidal.rewards import RewardScorer
from tidal.rewards.served import (
    FailureWindow,
    RewardServerError,
    Row,
    UnusableAnswer,
    backoff_seconds,
    classify_scores,
    judge_score,
    openrlhf_body,
    openrlhf_scores,
)

# --- the protocols, pure -------------------------------------------------------------------------


def test_openrlhf_request_and_answer():
    rows = [Row("1+2=", "A: 3", "3"), Row("2+2=", "A: 5", "4")]
    assert openrlhf_body(rows) == {"query": ["1+2=A: 3", "2+2=A: 5"], "prompts": ["1+2=", "2+2="], "labels": ["3", "4"]}
    assert openrlhf_scores({"rewards": [1, 0.5]}, 2) == [1.0, 0.5]
    for answer, reason in [
        ({"rewards": [1.0]}, "1 scores for 2 samples"),
        ({"rewards": [1.0, math.nan]}, "not a finite number"),
        ({"rewards": [1.0, "0.5"]}, "not a finite number"),
        ({"scores": [1.0, 1.0]}, "with 'rewards'"),
        ([1.0, 1.0], "with 'rewards'"),
    ]:
        with pytest.raises(UnusableAnswer, match=reason):
            openrlhf_scores(answer, 2)


def test_vllm_classify_answers_are_put_back_in_input_order():
    answer = {"data": [{"index": 1, "probs": [0.2, 0.8]}, {"index": 0, "probs": [0.9, 0.1]}]}
    assert classify_scores(answer, 2) == [0.1, 0.8]
    with pytest.raises(UnusableAnswer, match="1 results for 2 inputs"):
        classify_scores({"data": [{"index": 0, "probs": [1.0]}]}, 2)


@pytest.mark.parametrize(
    "text, how, expected",
    [
        ("Score: 7 out of 10... final: 8", "number", 8.0),
        ("Yes, it is right.", "yes_no", 1.0),
        ("no. (yes would be wrong)", "yes_no", 0.0),
        ('verdict: {"score": 0.75, "why": "close"}', "json", 0.75),
        ('{"score": true}', "json", 1.0),
    ],
)
def test_judge_replies_become_scores(text, how, expected):
    assert judge_score(text, how) == expected


@pytest.mark.parametrize("text, how", [("no digits", "number"), ("maybe", "yes_no"), ('{"grade": 1}', "json"), ('{"score": "high"}', "json")])
def test_an_unreadable_judge_reply_is_unusable(text, how):
    with pytest.raises(UnusableAnswer):
        judge_score(text, how)


def test_backoff_doubles_and_the_window_counts_the_last_requests():
    assert [backoff_seconds(0.5, a) for a in (1, 2, 3)] == [0.5, 1.0, 2.0]
    window = FailureWindow(size=4, rate=0.25)
    for failed in (True, False, False, False, True):
        window.record(failed)
    assert window.failures == 1 and not window.too_many()  # the first failure left the window
    window.record(True)
    assert window.too_many()


# --- the config ------------------------------------------------------------------------------------


def entry(**keys) -> dict:
    return {"reward": {"functions": [keys]}}


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"name": "exact_match", "url": "http://x"}, "reward.functions.0.url: only for type 'reward_model' or 'judge', not 'function'"),
        ({"type": "reward_model"}, "reward.functions.0: a reward_model needs exactly one of url"),
        ({"type": "reward_model", "url": "http://x", "serve": {"model": "/m"}}, "reward.functions.0: a reward_model needs exactly one of url"),
        ({"type": "reward_model", "url": "http://x", "samples": 3}, "reward.functions.0.samples: only for type 'judge', not 'reward_model'"),
        ({"type": "reward_model", "url": "http://x", "protocol": "vllm_classify"}, "reward.functions.0: protocol 'vllm_classify' needs model"),
        ({"type": "judge", "url": "http://x"}, "reward.functions.0.model: Field required"),
        ({"type": "judge", "model": "m"}, "reward.functions.0.url: Field required"),
        ({"type": "judge", "url": "http://x", "model": "m", "serve": {}}, "reward.functions.0.serve: only for type 'reward_model', not 'judge'"),
        ({"type": "judge", "url": "http://x", "model": "m", "prompt_template": "{question}"}, "must use {completion}"),
        ({"type": "judge", "url": "http://x", "model": "m", "api_key_env": "sk-abc123"}, "api_key_env must be the NAME of an environment variable"),
        ({"type": "judge", "url": "localhost:8000", "model": "m"}, "reward.functions.0.url: must start with http"),
        ({"type": "reward_model", "url": "http://x", "max_error_rate": 1.5}, "reward.functions.0.max_error_rate"),
        ({"type": "function"}, "reward.functions.0.name: Field required"),
        (
            {"name": "exact"},
            "reward.functions.0.name: unknown reward function 'exact': built in are exact_match, format, math_verify, or give module:name",
        ),
        ({"type": "rm", "url": "http://x"}, "reward.functions.0: type must be 'function', 'reward_model' or 'judge'"),
    ],
)
def test_a_wrong_reward_entry_is_one_error_naming_the_key(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        config_from_dict(entry(**keys))
    assert "\n" not in str(raised.value) and "abc123" not in str(raised.value)  # one line; an API key put in api_key_env is not echoed


def test_a_served_entry_goes_to_the_url_of_the_server_the_run_started_for_it(tmp_path):
    """`serve:` entries: the urls come from the run directory's record of the servers its launch started, which
    a role reads (RunDir.reward_server_urls); with none started, the entry says so."""
    from tidal.config import config_from_dict
    from tidal.rewards.served import RewardServerError, endpoint_url
    from tidal.rundir import RunDir

    rm = config_from_dict({"reward": {"functions": [{"type": "reward_model", "name": "rm", "serve": {"model": "/m"}}]}}).reward.functions[0]
    run = RunDir(tmp_path)
    assert run.reward_server_urls() == {}
    with pytest.raises(RewardServerError, match="reward 'rm': serve is set but no reward server was started for it"):
        endpoint_url(rm, run.reward_server_urls())
    run.save_reward_servers({"rm": "http://127.0.0.1:4321/score"})
    assert endpoint_url(rm, run.reward_server_urls()) == "http://127.0.0.1:4321/score"


def test_two_served_rewards_of_one_name_are_refused():
    functions = [{"type": "judge", "url": "http://a", "model": "m"}, {"type": "judge", "url": "http://b", "model": "m"}]
    with pytest.raises(ConfigError, match=r"\['judge'\] named more than once"):
        config_from_dict({"reward": {"functions": functions}})


def test_a_written_config_holds_only_the_keys_of_each_entrys_type():
    """Each kind is its own model: its dump has its keys only, and reads back as the same entry."""
    from tidal.config.files import dump_config

    cfg = config_from_dict(
        {"reward": {"functions": [{"name": "exact_match"}, {"type": "reward_model", "name": "rm", "url": "http://x/rm", "retries": 5}]}}
    )
    written = dump_config(cfg)
    function, rm = cfg.reward.functions
    assert "retries: 5" in written and "You grade an answer" not in written  # no judge rubric on a reward model
    assert set(function.model_dump()) == {"type", "name", "weight"}
    assert "serve" in rm.model_dump() and "prompt_template" not in rm.model_dump()
    assert config_from_dict(json.loads(json.dumps(cfg.model_dump(mode="json")))).reward == cfg.reward  # it reads back the same


# --- the client against a real server process -----------------------------------------------------


class StubServer:
    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.record = tmp_path / f"requests-{len(list(tmp_path.glob('requests-*')))}.jsonl"
        cmd = [sys.executable, "-m", "tests.reward_stub", "--record", str(self.record), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.base = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def requests(self) -> list[dict]:
        return read_jsonl(self.record)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def stub(tmp_path):
    started = []

    def start(*args: str, env: dict | None = None) -> StubServer:
        started.append(StubServer(tmp_path, *args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def served(url: str, **keys) -> RewardScorer:
    functions = [{"type": "reward_model", "name": "rm", "url": url, "timeout_seconds": 1.0, "backoff": 0.05, **keys}]
    return RewardScorer.from_config(RewardConfig(functions=functions))


ROWS = [Row(f"{a}+{a}=", f"A: {2 * a if a % 3 else 2 * a + 1}", str(2 * a)) for a in range(10)]
EXPECTED = [0.0 if a % 3 == 0 else 1.0 for a in range(10)]


@pytest.mark.parametrize("fault", ["slow", "500", "drop", "garbage", "count", "nan"])
def test_each_kind_of_fault_is_retried_and_counted_and_the_scores_are_right(stub, fault):
    server = stub("--faults", fault)
    scorer = served(server.base + "/rm", batch_size=4, concurrency=1)
    try:
        scored = scorer.score_many(ROWS, list(range(10)))
        assert [r for r, _, _ in scored] == EXPECTED and scorer.errors == 0
        stats = scorer.take_stats()
        assert stats["reward_server_requests"] == 3 and stats["reward_server_retries"] == 1 and stats["reward_server_failed_requests"] == 0
        assert stats["reward_server_samples"] == 10 and stats["reward_seconds"] > 0
        sent = server.requests()
        assert [r["fault"] for r in sent] == [fault, None, None, None]  # the first request, then its retry and the two others
        assert sorted(len(r["body"]["query"]) for r in sent[1:]) == [2, 4, 4]  # batches of batch_size across the rows
        assert sent[0]["body"] == sent[1]["body"]  # the retry is the same request
    finally:
        scorer.close()


def test_a_request_that_fails_every_retry_scores_zero_and_is_counted(stub):
    server = stub("--faults", "500,500,500")
    scorer = served(server.base + "/rm", batch_size=5, concurrency=1, retries=2, max_error_rate=1.0)
    try:
        scored = scorer.score_many(ROWS, list(range(10)))
        failed = [i for i, (_, parts, errors) in enumerate(scored) if errors]
        assert len(failed) == 5 and all(scored[i][1]["rm"] == 0.0 for i in failed)  # one batch of five lost, scored 0
        assert scorer.errors == 5 and "rm: its request failed" in scorer.last_error
        stats = scorer.take_stats()
        assert stats["reward_server_failed_requests"] == 1 and stats["reward_server_retries"] == 2 and stats["reward_server_requests"] == 2
    finally:
        scorer.close()


def test_a_refusal_is_not_retried(stub):
    server = stub("--faults", "401")
    scorer = served(server.base + "/rm", batch_size=10, max_error_rate=1.0)
    try:
        scorer.score_many(ROWS, list(range(10)))
        assert scorer.errors == 10 and len(server.requests()) == 1
        assert "HTTP 401" in scorer.served.entries[0].last_error
    finally:
        scorer.close()


def test_over_the_error_rate_scoring_stops_with_one_line_naming_the_endpoint(stub):
    server = stub("--always", "500")
    scorer = served(server.base + "/rm", batch_size=2, retries=1, error_window=4, max_error_rate=0.5)
    try:
        with pytest.raises(RewardServerError) as err:
            scorer.score_many(ROWS, list(range(10)))
        message = str(err.value)
        assert "\n" not in message and server.base + "/rm" in message and "4 of the last 4 requests failed" in message and "HTTP 500" in message
    finally:
        scorer.close()


def test_a_refused_connection_is_retried_then_counted(tmp_path):
    from tidal.rewards.server import free_port

    scorer = served(f"http://127.0.0.1:{free_port()}/rm", batch_size=10, retries=2, max_error_rate=1.0)
    try:
        scorer.score_many(ROWS, list(range(10)))
        stats = scorer.take_stats()
        assert (
            scorer.errors == 10 and stats["reward_server_retries"] == 2 and "connection failed (ConnectError" in scorer.served.entries[0].last_error
        )
    finally:
        scorer.close()


def test_the_api_key_comes_from_the_environment_variable_named(stub, monkeypatch):
    server = stub("--api-key-env", "STUB_KEY", env={"STUB_KEY": "s3cret"})
    monkeypatch.setenv("RM_KEY", "s3cret")
    scorer = served(server.base + "/rm", api_key_env="RM_KEY")
    try:
        assert [r for r, _, _ in scorer.score_many(ROWS[:2], [0, 1])] == EXPECTED[:2] and scorer.errors == 0
        assert server.requests()[0]["authorization"] == "Bearer s3cret"
    finally:
        scorer.close()
    monkeypatch.delenv("RM_KEY")
    scorer = served(server.base + "/rm", api_key_env="RM_KEY")
    try:
        with pytest.raises(RewardServerError, match="api_key_env names RM_KEY, which is not set"):
            scorer.score_many(ROWS[:2], [0, 1])
    finally:
        scorer.close()


def test_vllm_classify_protocol(stub):
    server = stub()
    scorer = served(server.base + "/v1", protocol="vllm_classify", model="rm-model")
    try:
        scored = scorer.score_many(ROWS[:3], [0, 1, 2])
        assert [parts["rm"] for _, parts, _ in scored] == [float(len(r.prompt + r.completion) % 7) for r in ROWS[:3]]
        (request,) = server.requests()
        assert request["path"] == "/v1/classify" and request["body"]["model"] == "rm-model"
    finally:
        scorer.close()


def test_a_judge_averages_its_samples_and_is_deterministic_with_the_runs_seed(stub):
    server = stub("--faults", "garbage")
    functions = [
        {"name": "exact_match", "weight": 0.5},
        {"type": "judge", "url": server.base + "/v1", "model": "judge-7b", "samples": 3, "temperature": 0.7, "backoff": 0.05},
    ]
    scorer = RewardScorer.from_config(RewardConfig(functions=functions), seed=11)
    try:
        scored = scorer.score_many(ROWS[:3], [0, 1, 2])
        assert [parts["judge"] for _, parts, _ in scored] == EXPECTED[:3]
        assert [total for total, _, _ in scored] == [1.5 * e for e in EXPECTED[:3]]
        sent = server.requests()
        assert len(sent) == 4 and {r["path"] for r in sent} == {"/v1/chat/completions"}  # one request a sample, one retried
        body = sent[-1]["body"]
        assert body["n"] == 3 and body["model"] == "judge-7b" and body["seed"] == 11 and body["temperature"] == 0.0
        assert "Reference answer:\n" in body["messages"][0]["content"]
    finally:
        scorer.close()


# --- tidal serve-reward -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny sequence-classification model (random weights) with the tiny model's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tidal.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("rm")
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_serve_reward_answers_the_openrlhf_protocol_with_the_models_scores(reward_model_dir, tmp_path):
    from tidal.config import ServeRewardModelConfig
    from tidal.rewards.server import RewardModel, RewardServer

    server = RewardServer("rm", ServeRewardModelConfig(model=str(reward_model_dir), batch_size=3), tmp_path / "rm.log")
    server.start()
    scorer = served(server.url, batch_size=4, timeout_seconds=60)
    try:
        scored = scorer.score_many(ROWS, list(range(10)))
        local = RewardModel(reward_model_dir).score([r.prompt + r.completion for r in ROWS])
        assert [parts["rm"] for _, parts, _ in scored] == pytest.approx(local, abs=1e-5)
        assert len(set(local)) > 1 and scorer.errors == 0
    finally:
        scorer.close()
        server.stop()
    assert server.proc.poll() is not None


def test_serve_reward_outputs_the_logit_its_sigmoid_or_its_sign(reward_model_dir):
    import math

    from tidal.rewards.server import RewardModel

    texts = [r.prompt + r.completion for r in ROWS]
    logits = RewardModel(reward_model_dir).score(texts)
    assert RewardModel(reward_model_dir, output="sigmoid").score(texts) == pytest.approx([1 / (1 + math.exp(-x)) for x in logits], abs=1e-6)
    assert RewardModel(reward_model_dir, output="binary").score(texts) == [1.0 if x > 0 else 0.0 for x in logits]
    assert min(logits) < 0 < max(logits)  # both verdicts occur


def test_serve_reward_refuses_a_directory_without_a_model(tmp_path):
    proc = run_cli("serve-reward", str(tmp_path), "--port", "1")
    assert proc.returncode == 2 and "is not a model directory (no config.json)" in proc.stderr


@pytest.fixture(scope="module")
def causal_lm_dir(tmp_path_factory):
    """A tiny causal LM as saved by a policy's training: a body and an LM head, no score head."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tidal.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("lm")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_serve_reward_refuses_a_causal_lm_directory_naming_it(causal_lm_dir):
    proc = run_cli("serve-reward", str(causal_lm_dir), "--port", "1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert f"{causal_lm_dir} is a Qwen2ForCausalLM, not a reward model" in proc.stderr and "no trained score head" in proc.stderr


def test_a_reward_model_whose_weights_lack_the_score_head_is_refused_not_given_a_random_one(causal_lm_dir, reward_model_dir):
    """The weights decide, whatever config.json claims: a causal LM's checkpoint loaded as a classifier lacks score.weight."""
    from tidal.rewards.server import NoScoreHeadError, RewardModel

    with pytest.raises(NoScoreHeadError, match=rf"{re.escape(str(causal_lm_dir))} has no trained score head: its weights lack score\.weight"):
        RewardModel(causal_lm_dir)
    assert len(RewardModel(reward_model_dir).score(["1+1=2"])) == 1  # a trained head loads


def test_a_run_serving_a_causal_lm_as_its_reward_model_is_refused_before_start(causal_lm_dir, tmp_path, write_config):
    rm = {"type": "reward_model", "name": "rm", "serve": {"model": str(causal_lm_dir)}}
    proc = run_cli("run", str(write_config({"reward.functions": [rm]})), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert f"reward.functions[rm].serve.model: {causal_lm_dir} is a Qwen2ForCausalLM, not a reward model" in proc.stderr
    assert not (tmp_path / "run" / "logs" / "reward-server-rm.log").exists()


# --- short real runs -----------------------------------------------------------------------------------


def test_a_run_against_a_misbehaving_reward_server_finishes_every_fault_retried_no_group_lost(stub, tmp_path, write_config):
    server = stub("--faults", "slow,500,drop,garbage,count,nan")
    # retries: 6, so that even a request that meets every fault (they are handed out to concurrent requests) gets through
    rm = {"type": "reward_model", "name": "rm", "url": server.base + "/rm", "timeout_seconds": 1.5, "backoff": 0.05, "batch_size": 8, "retries": 6}
    config = write_config({"reward.functions": [rm], "trainer.iterations": 2, "eval.enabled": False})
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == 2 * 6 and summary["reward_errors"] == 0
    assert summary["reward_server_retries"] == 6 and summary["reward_server_failed_requests"] == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(m["reward_seconds"] > 0 and m["reward_server_batch_size_mean"] > 4 for m in metrics)  # batched across groups
    faults = [r["fault"] for r in server.requests() if r["fault"]]
    assert faults == ["slow", "500", "drop", "garbage", "count", "nan"]
    groups = read_jsonl(run_dir / "groups.jsonl")
    assert len(groups) == 12
    assert "reward server" in proc.stdout and "6 retries" in proc.stdout


@pytest.mark.parametrize("mode", ["periodic", "sync"])
def test_a_run_whose_reward_server_keeps_failing_stops_with_one_line_naming_it(stub, tmp_path, write_config, mode):
    server = stub("--always", "500")
    rm = {"type": "reward_model", "name": "rm", "url": server.base + "/rm", "retries": 1, "backoff": 0.05, "error_window": 4, "max_error_rate": 0.5}
    config = write_config({"reward.functions": [rm], "eval.enabled": False, "mode": mode})
    last = run_stopped_by_a_failing_reward(config, tmp_path / "run", mode)
    if mode == "periodic":  # a worker's engine call is 2 groups, one request: its third fills the window mid-iteration
        assert last.startswith(f"reward server {server.base}/rm (rm): 3 of the last 3 requests failed"), last
    else:  # sync mode scores the iteration in fewer requests than the window: the first iteration's end stops it
        assert last.startswith("reward rm failed every one of its 24 calls in iteration 0, the run's first: HTTP 500"), last
        assert f"({server.base}/rm)" in last


def test_tidal_run_serves_the_reward_model_itself_and_stops_it(reward_model_dir, tmp_path, write_config):
    rm = {"type": "reward_model", "name": "rm", "serve": {"model": str(reward_model_dir), "output": "sigmoid"}}
    config = write_config({"reward.functions": [rm], "trainer.iterations": 2, "eval.enabled": False})
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(0 < m["reward_mean"] < 1 and m["reward_server_requests"] > 0 and m["reward_errors"] == 0 for m in metrics)
    log = (run_dir / "logs" / "reward-server-rm.log").read_text()
    assert "serving reward model" in log
    urls = json.loads((run_dir / "reward-servers.json").read_text())  # where the roles read the server's url
    assert list(urls) == ["rm"] and urls["rm"].startswith("http://127.0.0.1:")
    assert run_processes(run_dir) == [] and not any(str(reward_model_dir) in p for p in _all_processes())


@pytest.mark.parametrize("mode", ["periodic", "sync"])
def test_a_reward_server_killed_mid_run_is_restarted_on_its_port_and_no_score_is_lost(reward_model_dir, tmp_path, write_config, mode):
    # retries with back-off span ~2 minutes: the requests made while the server restarts get through
    rm = {"type": "reward_model", "name": "rm", "serve": {"model": str(reward_model_dir)}, "retries": 8, "backoff": 0.5}
    config = write_config({"mode": mode, "reward.functions": [rm], "trainer.iterations": 4, "eval.enabled": False})
    run_dir = tmp_path / "run"
    with background_run(config, run_dir) as proc:
        wait_until(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, proc)
        (server,) = [p for p in _all_processes(with_pid=True) if "serve-reward" in p[1] and str(reward_model_dir) in p[1]]
        os.kill(server[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "restarting it on port" in (run_dir / "logs" / "launcher.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == 4 * 6 and summary["reward_errors"] == 0
    assert run_processes(run_dir) == [] and not any(str(reward_model_dir) in p for p in _all_processes())


def _all_processes(with_pid: bool = False) -> list:
    """Every live process's command line (with its pid: (pid, command line))."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            except OSError:
                continue
            found.append((int(entry.name), cmdline) if with_pid else cmdline)
    return found


# --- the built-in tiny reward model ---------------------------------------------------------------------


def test_the_reward_models_examples_are_one_right_and_one_wrong_answer_per_problem():
    import random

    from tidal.data import Problem
    from tidal.demo.reward_model import labelled_examples, wrong_answers
    from tidal.rewards import exact_match

    rng = random.Random(0)
    assert all(wrong_answers(a, rng) != str(a) for a in [0, 5, 11, 99, 100, 121, 198] for _ in range(50))
    problems = [Problem(i, f"{i}+{i}=", str(2 * i)) for i in range(200)]
    rows = labelled_examples(problems, rng)
    assert len(rows) == 400 and sum(label for _, _, label in rows) == 200
    assert all(exact_match(completion, p.answer) == label for (_, completion, label), p in zip(rows, [p for p in problems for _ in (0, 1)]))


def test_the_built_in_reward_model_is_for_the_tiny_arithmetic_model_only(tiny_config):
    from tidal.demo.reward_model import prepare_reward_model

    cfg = tiny_config.model_copy(update={"model": tiny_config.model.model_copy(update={"name_or_path": "/models/qwen"})})
    with pytest.raises(ValueError, match=r"reward.functions\[\].serve.model is unset: the built-in reward model is for the tiny model"):
        prepare_reward_model(cfg, "/models/qwen")


def test_the_reward_models_loss_ranks_each_right_answer_above_its_wrong_one():
    import torch

    from tidal.demo.reward_model import pair_loss

    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    ranked = pair_loss(torch.tensor([3.0, -3.0, 2.0, -2.0]), labels)
    reversed_ = pair_loss(torch.tensor([-3.0, 3.0, -2.0, 2.0]), labels)
    assert ranked < 0.2 < 3.0 < reversed_


def test_the_reward_model_learns_from_the_policys_own_samples_labelled_by_exact_match(tiny_config):
    import random

    import torch

    from tidal.data import Problem, prompt_encoder
    from tidal.demo.reward_model import policy_pairs, policy_samples
    from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
    from tidal.rewards import exact_match

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(tiny_config.model.tiny, tok)
    encode = prompt_encoder(tok, tiny_config.data)
    problems = [Problem(i, f"{i}+1=", str(i + 1)) for i in range(5)]
    samples = policy_samples(model, tok, encode, problems, (0.7, 1.3), 4, 6, seed=3)
    again = policy_samples(model, tok, encode, problems, (0.7, 1.3), 4, 6, seed=3)
    assert [s.problem for s in samples] == problems and all(len(s.right) + len(s.wrong) == 8 for s in samples)
    assert samples == again  # seeded per problem and temperature
    assert all(exact_match(t, s.problem.answer) > 0 for s in samples for t in s.right)
    assert all(exact_match(t, s.problem.answer) == 0 for s in samples for t in s.wrong)

    rows = policy_pairs(samples, random.Random(0))
    assert [label for _, _, label in rows] == [1.0, 0.0] * 5
    for s, (right, wrong) in zip(samples, zip(rows[0::2], rows[1::2])):
        assert right[0] == wrong[0] == s.problem.prompt
        assert exact_match(right[1], s.problem.answer) > 0 and wrong[1] in s.wrong


def test_the_reward_models_policy_pair_accuracy_counts_the_pairs_within_each_problem():
    from tidal.data import Problem
    from tidal.demo.reward_model import PolicySamples, pair_accuracy

    samples = [
        PolicySamples(Problem(0, "1+1=", "2"), ["A: 2"], ["A: 3", "A: 12"]),  # scores 0.9 | 0.1, 0.95: 1 of 2 pairs
        PolicySamples(Problem(1, "2+2=", "4"), ["A: 4", "A: 4"], ["A: 5"]),  # 0.8, 0.7 | 0.2: 2 of 2
    ]
    assert pair_accuracy(samples, [0.9, 0.1, 0.95, 0.8, 0.7, 0.2]) == 3 / 4
    assert pair_accuracy(samples, [0.0, 0.1, 0.95, 0.1, 0.1, 0.2]) == 0.0


def test_the_reward_models_classifier_trains_until_a_check_reaches_the_target_and_fails_without_it():
    from tidal.demo.reward_model import train_until

    steps: list[int] = []
    accuracies = iter([0.6, 0.85, 0.93, 0.99])
    trained = train_until(steps.append, lambda: next(accuracies), every=3, max_steps=30, target=0.9, floor=0.8)
    assert (trained.steps, trained.accuracy) == (9, 0.93) and steps == list(range(1, 10))

    # no check reaches the target: the best one's state is restored if it reached the floor
    state = {"weights": 0, "kept": None}

    def step(n: int) -> None:
        state["weights"] = n

    accuracies = iter([0.7, 0.86, 0.8])
    kept = dict(keep=lambda: state.update(kept=state["weights"]), restore=lambda: state.update(weights=state["kept"]))
    trained = train_until(step, lambda: next(accuracies), every=4, max_steps=10, target=0.9, floor=0.85, **kept)
    assert (trained.steps, trained.accuracy) == (8, 0.86) and state["weights"] == 8

    steps.clear()
    with pytest.raises(
        ValueError, match=r"did not learn: in 10 steps it ranked at best 0.700 .* under the 0.85 it needs; give reward.functions\[\].serve.model"
    ):
        train_until(steps.append, lambda: 0.7, every=4, max_steps=10, target=0.9, floor=0.85)
    assert steps == list(range(1, 11))  # checked at 4, 8 and the last step

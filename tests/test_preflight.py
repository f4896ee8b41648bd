"""The bad-input corpus: each is one line on stderr naming the key, file and line, a non-zero exit,
no traceback, before any process of the run starts."""

import importlib.util
import json

import pytest

from tests.conftest import run_cli

GOOD = {"question": "1+2=", "answer": "3"}


def jsonl(path, rows: list) -> str:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(path)


def bad_data(tmp_path, bad_row, at: int = 3) -> dict:
    rows = [GOOD] * 5
    rows.insert(at - 1, bad_row)
    return {"data.task": "jsonl", "data.path": jsonl(tmp_path / "train.jsonl", rows)}


CASES = {
    "unknown key": (lambda t: {"trainer.iteratons": 3}, ["trainer.iteratons: unknown key"]),
    "missing data file": (lambda t: {"data.task": "jsonl", "data.path": str(t / "none.jsonl")}, ["dataset file not found", "none.jsonl"]),
    "row not JSON": (lambda t: bad_data(t, b"{not json"), ["train.jsonl:3: not valid JSON"]),
    "row not UTF-8": (lambda t: bad_data(t, b'{"question": "\xff\xfe", "answer": "1"}'), ["train.jsonl:3: not UTF-8"]),
    "row without answer": (lambda t: bad_data(t, {"question": "1+1="}), ["train.jsonl:3: a row needs string fields"]),
    "50 MB row": (
        lambda t: bad_data(t, {"question": "1" * 50 * 2**20, "answer": "1"}),
        ["train.jsonl:3: the row is 50.0 MB", "transport.max_payload_mb"],
    ),
    "prompt over the context": (
        lambda t: bad_data(t, {"question": "1+" * 100 + "1=", "answer": "101"}, at=2),
        ["train.jsonl:2: the prompt is 203 tokens", "model.tiny.max_position_embeddings", "rollout.max_new_tokens"],
    ),
    "template over the context": (lambda t: {"data.prompt_template": "x" * 200 + "{prompt}"}, ["data.prompt_template", "model's context of 128"]),
    "chat template without one": (lambda t: {"data.chat_template": True}, ["data.chat_template is true"]),
    "unknown reward": (lambda t: {"reward.functions": [{"name": "exact"}]}, ["unknown reward function 'exact'"]),
    "reward module missing": (lambda t: {"reward.functions": [{"name": "nosuch.mod:f"}]}, ["'nosuch.mod:f'", "cannot import module 'nosuch.mod'"]),
    "reward not callable": (lambda t: {"reward.functions": [{"name": "tests.rewards:nothing"}]}, ["'tests.rewards:nothing'", "has no callable"]),
    "model folder missing": (
        lambda t: {"model.name_or_path": str(t / "models" / "policy")},
        ["model.name_or_path", "models/policy'", "no such directory"],
    ),
    "unreachable MLflow server": (
        lambda t: {"tracking.uri": "http://127.0.0.1:1"},
        ["cannot reach the MLflow server at http://127.0.0.1:1 (tracking.uri)"],
    ),
    "an accelerator this machine lacks": (
        lambda t: {"trainer.device": "npu"},
        ["trainer.device is 'npu' but this process sees no npu device"],
    ),
    "flex attention on the CPU": (
        lambda t: {"trainer.attention": "flex", "trainer.device": "cpu"},
        ["trainer.attention 'flex' trains on CUDA only, and the trainer's device here is 'cpu'"],
    ),
    "unreachable reward server": (
        lambda t: {"reward.functions": [{"name": "exact_match"}, {"type": "reward_model", "name": "rm", "url": "http://127.0.0.1:1/rm"}]},
        ["cannot reach reward 'rm' at http://127.0.0.1:1/rm (reward.functions[rm].url)"],
    ),
    "unreachable judge": (
        lambda t: {"reward.functions": [{"type": "judge", "url": "http://127.0.0.1:1/v1", "model": "m"}]},
        ["cannot reach reward 'judge' at http://127.0.0.1:1/v1 (reward.functions[judge].url)"],
    ),
    "unreachable NATS": (lambda t: {"transport.nats_url": "nats://127.0.0.1:1"}, ["nats://127.0.0.1:1", "transport.nats_url"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_naming_what_is_wrong(case, tmp_path, write_config):
    make, expected = CASES[case]
    config = write_config(make(tmp_path))
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stderr
    assert not (tmp_path / "run" / "logs" / "trainer.log").exists() and not (tmp_path / "run" / "nats").exists()  # nothing started


def test_a_missing_config_file_and_a_run_directory_that_is_a_file_are_one_line(tmp_path, write_config):
    missing = run_cli("run", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run"))
    (tmp_path / "file").write_text("x")
    in_the_way = run_cli("run", str(write_config()), "--run-dir", str(tmp_path / "file"))
    for proc, text in [(missing, "config file not found"), (in_the_way, "a file is in the way")]:
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and text in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this environment")
def test_a_vllm_engine_without_vllm_installed_is_one_line_before_anything_starts(tmp_path, write_config):
    for key in ("rollout.engine", "eval.engine"):
        run = tmp_path / key
        proc = run_cli("run", str(write_config({key: "vllm"})), "--run-dir", str(run), "--no-progress")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert f"{key} is 'vllm' but vllm is not installed" in proc.stderr
        assert not (run / "run.json").exists() and not (run / "nats").exists()

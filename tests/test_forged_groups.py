"""The security audit's forged-groups attack, replayed end to end against a real `tidal run`: a local process
connects to the run's embedded NATS, publishes groups of its own (rewards +-1000, its own tokens) for
every prompt and answers work items it pulls from the workers' consumer (tests/forger.py). Without
the run's token it is refused, and the run trains exactly what an unattacked deterministic run trains.
With the token the same process does get its groups trained: the attack is real, the token is what stops it."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, read_jsonl, run_cli, start_run, wait_until

REWARDS = [{"name": "tests.rewards:slow_exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}]


def start_forger(run_dir, token: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.forger", str(run_dir)] + (["--token", token] if token else [])
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def final_weights(run_dir, iterations: int = 3) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "weights" / f"v{iterations:06d}" / "model.safetensors"))


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def attacked_run(config, run_dir, token_of_run: bool) -> tuple[subprocess.CompletedProcess, list[list[dict]]]:
    """`tidal run` with forgers started once its trainer is up: with no credentials and a wrong token,
    or (token_of_run) with the run's own token. Returns the run's result and each forger's events."""
    proc = start_run(config, run_dir)
    wait_until(lambda: (run_dir / "logs" / "trainer.pid").is_file() and (run_dir / "nats-token").is_file(), proc)
    tokens = [(run_dir / "nats-token").read_text()] if token_of_run else [None, "t" + "0" * 64]
    forgers = [start_forger(run_dir, t) for t in tokens]
    out, err = proc.communicate(timeout=900)
    reports = []
    for f in forgers:
        if f.poll() is None:  # a connected forger goes on until it is stopped
            f.terminate()
        f_out, f_err = f.communicate(timeout=120)
        reports.append(events(f_out))
        assert reports[-1], f_err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), reports


def test_a_process_without_the_runs_token_is_refused_and_none_of_its_forged_groups_is_trained(tmp_path, write_config):
    config = write_config({"rollout.deterministic": True, "eval.enabled": False, "rollout.groups_per_batch": 1, "reward.functions": REWARDS})
    reference = run_cli("run", str(config), "--run-dir", str(tmp_path / "reference"), "--no-progress")
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "attacked"
    result, (no_credentials, wrong_token) = attacked_run(config, run_dir, token_of_run=False)
    assert result.returncode == 0, result.stderr[-3000:]
    for report in (no_credentials, wrong_token):
        assert len(report) == 1 and "refused the connection" in report[0]["refused"] and "Authorization Violation" in report[0]["refused"], report
    assert largest_difference(final_weights(run_dir), final_weights(tmp_path / "reference")) < 1e-5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == summary["groups_generated"] == 3 * 6
    assert "forger" not in {r["worker_id"] for r in read_jsonl(run_dir / "groups.jsonl")}

    # the control: the same forger holding the run's token gets its groups trained
    stolen_dir = tmp_path / "with-token"
    result, [with_token] = attacked_run(config, stolen_dir, token_of_run=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert with_token[0] == {"connected": True} and with_token[-1]["forged"] == 3 * 6
    assert "forger" in {r["worker_id"] for r in read_jsonl(stolen_dir / "groups.jsonl")}
    assert largest_difference(final_weights(stolen_dir), final_weights(tmp_path / "reference")) > 1e-3

"""Shared fixtures: a tiny config (warm start cached once per session) and a real nats-server."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.processes import SESSION_ENV, kill, session_leftovers
from tidal.config import config_from_dict
from tidal.parentdeath import set_parent_death_signal
from tidal.sandbox import PASS_ENV
from tidal.transport.server import EmbeddedNats

# switches of the tests' own user code, passed into its sandbox
TEST_SWITCHES = ("TIDAL_TEST_MARKERS", "TIDAL_TEST_TARGETS", "TIDAL_TEST_REWARD_GATE", "TIDAL_TEST_KILL_MARKER", "TIDAL_TEST_KILL_AT")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_trusted_key_between_tests():
    """A role trusts its run's public key for the rest of its process (tidal.weights.signing.trust_public_key): a
    test that plays a role in-process does not hand the key on to the next test."""
    yield
    signing = sys.modules.get("tidal.weights.signing")
    if signing is not None:
        signing.trust_public_key(None)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running():
    """Every process the session's tests started has ended when the session does: each pytest process
    (each xdist worker its own) marks its children's environment, and at the end any process still
    carrying the mark, or still descended from it, is killed and fails the session."""
    os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # tool and reward processes (sandboxed) get the session's mark too, and the tests' own switches
    os.environ[PASS_ENV] = ",".join([SESSION_ENV, *TEST_SWITCHES])
    yield
    left = session_leftovers(f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode(), os.getpid(), seconds=30)
    kill(list(left))
    assert not left, "processes the tests started were still running at the end of the session (killed now):\n" + "\n".join(
        f"{pid}: {cmd}" for pid, cmd in left.items()
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tidal-cache")


@pytest.fixture(scope="session")
def tiny_config_dict(cache_dir) -> dict:
    """Small enough that a whole run takes seconds on 2 cores."""
    return {
        "seed": 0,
        "model": {
            "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
            "warm_start": {"steps": 40, "batch_size": 32, "lr": 3e-3, "cache_dir": str(cache_dir)},
        },
        "data": {"num_train": 300, "num_eval": 16},
        "rollout": {"group_size": 4, "max_new_tokens": 8, "groups_per_batch": 2},
        "trainer": {"iterations": 3, "prompts_per_iteration": 6, "lr": 1e-3},
        "eval": {"batch_size": 16},
    }


@pytest.fixture
def tiny_config(tiny_config_dict):
    return config_from_dict(copy.deepcopy(tiny_config_dict))


@pytest.fixture
def write_config(tmp_path, tiny_config_dict):
    def write(overrides: dict | None = None, name: str = "config.yaml") -> Path:
        data = copy.deepcopy(tiny_config_dict)
        for dotted, value in (overrides or {}).items():
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write


@pytest.fixture
def nats_server(tmp_path):
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


def ends_with_the_tests() -> None:
    """preexec_fn of the `tidal` commands the tests start: SIGTERM when the test process ends, even killed
    (SIGKILL, a timeout), so a run a killed test session started stops in order instead of running on."""
    set_parent_death_signal(signal.SIGTERM)


def run_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs `tidal ...` as a user would, in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        preexec_fn=ends_with_the_tests,
    )


def run_stopped_by_a_failing_reward(config: Path, run_dir: Path, mode: str) -> str:
    """`tidal run` of a config whose reward fails too often: it ends with the reward's exit (a rollout worker's in
    periodic mode, the sync trainer's own code 77), never restarted, nothing left running; its last stderr line,
    less the prefix that names the failed worker."""
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == (1 if mode == "periodic" else 77), proc.stderr[-3000:]
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()  # it would fail the same way
    assert run_processes(run_dir) == []
    last = proc.stderr.strip().splitlines()[-1]
    prefix = "tidal: rollout worker worker-0 failed: " if mode == "periodic" else "tidal: "
    assert last.startswith(prefix), last
    return last.removeprefix(prefix)


def run_misbehaving_once(config: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """`tidal run` of a config whose user code misbehaves the first time in a run (a marker file in
    $TIDAL_TEST_MARKERS each, tests.rewards._first_call): the process, the run directory and the markers."""
    markers = tmp_path / "markers"
    markers.mkdir()
    run_dir = tmp_path / "run"
    # the sandbox lets user code write nowhere but its own directory and sandbox.write_paths
    writable = f"sandbox.write_paths=[{json.dumps(str(markers))}]"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", writable, env={"TIDAL_TEST_MARKERS": str(markers)})
    return proc, run_dir, sorted(p.name for p in markers.iterdir())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def start_run(config: Path, run_dir: Path) -> subprocess.Popen:
    """`tidal run` in the background, as a user starts it; its output is piped."""
    cmd = [sys.executable, "-m", "tidal.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ends_with_the_tests)


@contextlib.contextmanager
def background_run(config: Path, run_dir: Path):
    """`start_run` for the block; a run the block leaves running (a failed assertion) is killed and reaped."""
    proc = start_run(config, run_dir)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def trained_in(run_dir: Path, iteration: int) -> bool:
    """Whether the trainer has trained a group of `iteration` (its log says so as it goes; groups.jsonl
    gets the iteration's records only at its boundary)."""
    log = run_dir / "logs" / "trainer.log"
    return log.is_file() and f" iteration {iteration}: " in log.read_text()


def run_and_kill(config: Path, run_dir: Path, pid_file: str, when, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `tidal run` and SIGKILLs the process named by logs/`pid_file` once `when(run_dir)` holds
    (a crash at a chosen point); returns the finished run's result."""
    import signal
    import time

    proc = start_run(config, run_dir)
    deadline = time.time() + timeout
    while not when(run_dir) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(int((run_dir / "logs" / pid_file).read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def embedded_nats_url(run_dir: Path) -> str:
    """The URL of a running `tidal run`'s embedded nats-server, from the config it wrote."""
    import re

    conf = (run_dir / "nats" / "nats-server.conf").read_text()
    return "nats://" + re.search(r'listen: "([^"]+)"', conf).group(1)


def wait_until(condition, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Polls `condition()` while the background run `proc` lives; fails with its stderr if it ended first."""
    import time

    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before the condition held:\n{proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError("the condition did not hold in time")
        time.sleep(0.05)


def run_processes(run_dir: Path) -> list[str]:
    """Live processes (zombies aside) whose command line names `run_dir`: a run's roles and nats-server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def learner_run(out: Path, ranks: int, *args: str) -> dict:
    """tests/distributed_learner.py on `ranks` gloo ranks (torchrun above 1); its counts.json."""
    out.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(
        [*launcher, str(ROOT / "tests" / "distributed_learner.py"), str(out), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "counts.json").read_text())


def max_diff(a: Path, b: Path) -> float:
    """Max |a - b| over the tensors of two safetensors files with the same keys."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def eos_prone(model, tok, eos_logit: float):
    """The tiny model with an untied output layer whose EOS bias makes rows (and turns) finish at
    different steps: an untrained model rarely samples EOS."""
    import torch

    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = eos_logit
    model.lm_head = head
    return model


def mask_runs(mask) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in a loss mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out

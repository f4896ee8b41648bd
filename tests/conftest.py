"""Shared fixtures: a tiny config (warm start cached once per session) and a real nats-server."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tidal.config import config_from_dict
from tidal.transport.server import EmbeddedNats

ROOT = Path(__file__).resolve().parent.parent


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


def run_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs `tidal ...` as a user would, in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )

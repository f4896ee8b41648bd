"""Partial rollouts end to end in one process: a real trainer loop (learner, weight store with its probe),
real NATS, and real HF rollout workers in bounded mode with rollout.partial. The trigger is deterministic:
the first decode step of iteration 1's first response waits until the trainer has published version 1
(the worker's own watcher sees it on the KV pointer), so that response continues with version 1, loaded
through the arrival path and its probe check."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter

import pytest

from tests.conftest import read_jsonl
from tidal.config import config_from_dict
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.rewards import RewardScorer
from tidal.roles import build_learner, group_limits, load_policy, trainer_weight_store
from tidal.rollout import lease, partial
from tidal.rollout.engine import HFEngine
from tidal.rollout.worker import RolloutWorker
from tidal.rundir import RunDir
from tidal.trainer.loop import train
from tidal.trainer.sources import QueueSource
from tidal.transport import Transport

ITERATIONS, PROMPTS = 2, 4


class WorkerCrashed(RuntimeError):
    """What the test makes a worker die of, right after it took new weights mid-response."""


def bounded_partial(tiny_config_dict) -> object:
    data = copy.deepcopy(tiny_config_dict)
    data |= {"mode": "bounded", "eval": {"enabled": False}}
    data["rollout"] |= {"partial": True, "max_staleness": 1, "groups_per_batch": 1}
    data["trainer"] |= {"iterations": ITERATIONS, "prompts_per_iteration": PROMPTS, "group_timeout_seconds": 120.0}
    data["transport"] = {"ack_wait_seconds": 5.0}
    return config_from_dict(data)


@pytest.fixture
def held_until_published(monkeypatch):
    """Iteration 1's first response: its first interrupt question waits (on the engine's thread) until
    a newer version is published, then says stop. Every other question is the real one."""
    real = partial.PolicyRefresh.interrupt
    held: list[int] = []

    def interrupt(self) -> bool:
        if self.iteration == 1 and not held:
            held.append(1)
            assert self.waiting.wait(timeout=120), "version 1 was never published"
        return real(self)

    monkeypatch.setattr(partial.PolicyRefresh, "interrupt", interrupt)
    return held


async def scenario(cfg, tmp_path, nats_server, worker_ids: list[str]) -> tuple[list[dict], list[RolloutWorker]]:
    """Trains the run while the workers of `worker_ids` serve one after another: the next starts when the
    previous one ends (a crash)."""
    dataset = load_dataset(cfg.data, cfg.seed)
    base = prepare_base_model(cfg, dataset)
    run = RunDir(tmp_path / "run")
    run.weights.mkdir(parents=True, exist_ok=True)
    learner, _ = build_learner(cfg, str(base))
    store = trainer_weight_store(cfg, run, str(base), learner)
    trainer_side = await Transport.connect(nats_server.url, "partial", cfg.transport)
    workers: list[RolloutWorker] = []

    async def serve() -> None:
        for worker_id in worker_ids:
            model, tokenizer = load_policy(cfg, str(base))
            transport = await Transport.connect(nats_server.url, "partial", cfg.transport)
            worker = RolloutWorker(
                cfg,
                HFEngine.for_rollout(model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature),
                tokenizer,
                transport,
                worker_id,
                run.weights,
                RewardScorer.from_config(cfg.reward),
            )
            workers.append(worker)
            try:
                await worker.run()
            except WorkerCrashed:
                pass
            finally:
                await transport.close()

    serving = asyncio.create_task(serve())
    try:
        source = QueueSource(trainer_side, group_limits(cfg, learner, trainer_side.max_message_bytes), lambda v: str(store.path(v)))
        metrics = await asyncio.wait_for(train(cfg, learner, source, dataset, store, run, None), 300)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await trainer_side.close()
    return metrics, workers


def test_a_response_started_with_version_0_goes_on_with_version_1_and_trains_with_per_token_staleness(
    tmp_path, tiny_config_dict, nats_server, held_until_published
):
    cfg = bounded_partial(tiny_config_dict)
    metrics, _ = asyncio.run(scenario(cfg, tmp_path, nats_server, ["w1"]))
    assert held_until_published == [1]
    first, second = metrics
    assert first["mixed_version_sample_fraction"] == 0.0 and first["token_staleness_fraction_0"] == 1.0
    # iteration 1: the held group's responses hold tokens of version 0 (staleness 1) and of version 1
    assert second["mixed_version_sample_fraction"] > 0.0
    assert 0.0 < second["token_staleness_fraction_1"] < 1.0
    assert second["token_staleness_fraction_0"] + second["token_staleness_fraction_1"] == pytest.approx(1.0)
    assert second["staleness_max"] == 1.0  # the group counts as old as its oldest token
    records = read_jsonl(tmp_path / "run" / "groups.jsonl")
    assert Counter((r["iteration"], r["prompt_id"]) for r in records) == Counter({k: 1 for k in {(r["iteration"], r["prompt_id"]) for r in records}})
    assert len(records) == ITERATIONS * PROMPTS


def die_after_new_weights_and_replay(cfg, tmp_path, nats_server, monkeypatch, hands_back: bool) -> tuple[list[dict], list[dict]]:
    """Workers w1 and w2; w1 loads version 1 in the middle of its responses and dies there (handing its work
    back, or as SIGKILL leaves it: no NAK, no last heartbeat). Checks that every group was trained exactly once
    and the one w1 died in was made by w2 from scratch with version 1; returns the metrics and group records."""
    real_swap = partial.PolicyRefresh.swap
    crashed: list[int] = []

    async def swap_then_die(self) -> int:
        version = await real_swap(self)
        if not crashed:
            crashed.append(version)
            raise WorkerCrashed(f"died mid-response with v{version} loaded")
        return version

    monkeypatch.setattr(partial.PolicyRefresh, "swap", swap_then_die)
    if not hands_back:

        async def nothing(*args) -> None:
            return None

        monkeypatch.setattr(lease, "hand_back", nothing)
    metrics, workers = asyncio.run(scenario(cfg, tmp_path, nats_server, ["w1", "w2"]))
    assert crashed == [1] and len(workers) == 2
    records = read_jsonl(tmp_path / "run" / "groups.jsonl")
    trained = Counter((r["iteration"], r["prompt_id"]) for r in records)
    assert len(trained) == ITERATIONS * PROMPTS and set(trained.values()) == {1}
    by_w2 = [r for r in records if r["worker_id"] == "w2"]
    assert by_w2 and all(r["iteration"] == 1 and r["policy_version"] == 1 for r in by_w2)
    return metrics, records


@pytest.mark.parametrize("hands_back", [True, False], ids=["hands-back", "killed"])
def test_a_worker_that_dies_mid_response_after_new_weights_loses_nothing_and_trains_nothing_twice(
    tmp_path, tiny_config_dict, nats_server, held_until_published, monkeypatch, hands_back
):
    """The first worker takes version 1 in the middle of a response and dies before finishing it: its
    work item goes back (the lease's hand-back; or, killed, it hands back nothing and the item returns
    when its heartbeat falls silent or its ack deadline passes), the second worker generates that group
    from scratch, and every group of the run is trained exactly once."""
    cfg = bounded_partial(tiny_config_dict)
    metrics, _ = die_after_new_weights_and_replay(cfg, tmp_path, nats_server, monkeypatch, hands_back)
    assert metrics[1]["mixed_version_sample_fraction"] == 0.0
    assert [m["samples"] for m in metrics] == [PROMPTS * cfg.rollout.group_size] * ITERATIONS


def test_a_bounded_run_with_partial_rollouts_finishes_and_logs_per_token_staleness(tmp_path, write_config):
    """`tidal run` as a user starts it (HF engine, bounded, rollout.partial): it finishes, every group is
    trained once, and every iteration's per-token staleness histogram sums to 1."""
    import json

    from tests.conftest import run_cli

    config = write_config({"mode": "bounded", "rollout.partial": True, "rollout.max_staleness": 1, "trainer.iterations": 3, "eval.enabled": False})
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "run" / "groups.jsonl")
    assert len(records) == len({(r["iteration"], r["prompt_id"]) for r in records}) == 3 * 6
    for m in (json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()):
        assert m["token_staleness_fraction_0"] + m["token_staleness_fraction_1"] == pytest.approx(1.0)
        assert 0.0 <= m["mixed_version_sample_fraction"] <= 1.0

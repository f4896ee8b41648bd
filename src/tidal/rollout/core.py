"""The parts every rollout worker is made of, built in one place: its heartbeat record, the lease on
its work items, how weights arrive, and the group generator. A worker adds only its schedule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.config import TidalConfig
from tidal.model.probe import trainer_compute_dtypes
from tidal.rewards import RewardScorer
from tidal.rollout.arrival import WeightArrival
from tidal.rollout.engine import RolloutEngine
from tidal.rollout.generator import Generator
from tidal.rollout.lease import Lease
from tidal.transport import Transport
from tidal.transport.health import WorkerHealth


@dataclass
class WorkerCore:
    health: WorkerHealth
    lease: Lease
    arrival: WeightArrival
    generator: Generator

    @classmethod
    def build(
        cls,
        cfg: TidalConfig,
        engine: RolloutEngine,
        tokenizer,
        transport: Transport,
        worker_id: str,
        weights_root: Path | None,
        scorer: RewardScorer | None,
    ) -> WorkerCore:
        """`scorer` None: reward.functions' (deterministic mode: LLM judges seeded with the run's seed)."""
        scorer = scorer or RewardScorer.from_config(cfg.reward, seed=cfg.seed if cfg.rollout.deterministic else None)
        health = WorkerHealth(worker_id)
        return cls(
            health=health,
            lease=Lease(transport, health, cfg.transport.ack_wait_seconds),
            arrival=WeightArrival(
                cfg.weights.arrival_tolerance,
                trainer_compute_dtypes(cfg.model.dtype, cfg.trainer.param_dtype),
                engine,
                transport,
                health,
                weights_root,
            ),
            generator=Generator.for_worker(cfg, engine, tokenizer, scorer, worker_id),
        )

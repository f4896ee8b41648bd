"""Each role as a function: what `tidal train` and `tidal rollout-worker` run (locally or in a pod)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.config import TidalConfig
from tidal.data import load_dataset
from tidal.model.loading import load_model_and_tokenizer, prepare_base_model
from tidal.rollout.engine import HFEngine
from tidal.rollout.worker import RolloutWorker
from tidal.runtime import set_threads, split_cores
from tidal.tracking import Tracker
from tidal.trainer.learner import Learner
from tidal.trainer.loop import RunFiles, run_periodic_trainer
from tidal.trainer.weight_push import NcclWeightPush
from tidal.transport import Transport
from tidal.weights import WeightStore

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """Written once per run (run.json); every role reads it from the shared run directory."""

    run_id: str
    base_model: str
    tracking_uri: str
    mlflow_run_id: str

    def save(self, run_dir: Path) -> None:
        (run_dir / "run.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> "RunInfo":
        path = run_dir / "run.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: start the run with `tidal run` (or the pipeline's prepare step) first")
        return cls(**json.loads(path.read_text()))


def build_learner(cfg: TidalConfig, base_model: str) -> tuple[Learner, object]:
    model, tokenizer = load_model_and_tokenizer(base_model, cfg.model.dtype)
    learner = Learner(cfg.trainer, model, tokenizer.pad_token_id, cfg.rollout.temperature, cfg.reward, cfg.rollout.max_new_tokens)
    return learner, tokenizer


def require_single_rank() -> None:
    """The trainer is one process today; several ranks would each consume the ROLLOUTS stream."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(
            f"WORLD_SIZE={world}: the Tidal trainer does not shard across ranks yet; "
            "run the trainer job with 1 node and nproc_per_node=1"
        )


async def trainer_role(cfg: TidalConfig, run_dir: Path, nats_url: str, iterations: int | None = None) -> list[dict]:
    require_single_rank()
    info = RunInfo.load(run_dir)
    set_threads(split_cores(cfg)[0])
    dataset = load_dataset(cfg.data, cfg.seed)
    learner, _ = build_learner(cfg, info.base_model)
    store = WeightStore(run_dir / "weights", info.base_model)
    transport = await Transport.connect(nats_url, info.run_id, cfg.transport, create=True)
    tracker = Tracker(info.tracking_uri, info.mlflow_run_id)
    try:
        state = await transport.get("run")
        if not state or state.get("state") != "running":
            await transport.put("run", {"state": "running"})
        weight_push = await NcclWeightPush.for_run(cfg, transport)
        history = await run_periodic_trainer(cfg, learner, dataset, store, RunFiles(run_dir), tracker, transport, iterations, weight_push)
        finished = (store.latest_version() or 0) >= cfg.trainer.iterations
        await transport.put("run", {"state": "done" if finished else "round_done"})
        log.info("trainer finished %d iterations", len(history))
        return history
    except BaseException:
        await transport.put("run", {"state": "failed"})
        raise
    finally:
        await transport.close()


def rollout_engine(cfg: TidalConfig, base_model: str) -> tuple[object, object, type]:
    """(engine, tokenizer, worker class) for `rollout.engine`; vLLM is imported only when asked for."""
    if cfg.rollout.engine == "vllm":
        from tidal.model.loading import load_tokenizer
        from tidal.rollout.vllm_adapter import VLLMEngine
        from tidal.rollout.vllm_worker import VLLMRolloutWorker

        return VLLMEngine.create(cfg, base_model), load_tokenizer(base_model), VLLMRolloutWorker
    model, tokenizer = load_model_and_tokenizer(base_model, cfg.model.dtype)
    return HFEngine.for_rollout(model, tokenizer, cfg.rollout), tokenizer, RolloutWorker


async def worker_role(cfg: TidalConfig, run_dir: Path, nats_url: str, worker_id: str) -> int:
    info = RunInfo.load(run_dir)
    set_threads(split_cores(cfg)[1])
    engine, tokenizer, worker_class = rollout_engine(cfg, info.base_model)
    try:
        transport = await Transport.connect(nats_url, info.run_id, cfg.transport, create=False)
        worker = worker_class(cfg, engine, tokenizer, transport, worker_id)
        try:
            await worker.run()
        finally:
            await transport.close()
    finally:
        engine.shutdown()  # vLLM's engine processes would otherwise outlive the worker
    return worker.groups_published


def ensure_base_model(cfg: TidalConfig, progress=None) -> str:
    return str(prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed), progress))


def check_prompt_settings(cfg: TidalConfig, base_model: str | Path) -> None:
    """data.prompt_template / chat_template against the model's tokenizer, once, before any worker
    starts (a tokenizer without a chat template is a DatasetError naming the key)."""
    from tidal.data import prompt_encoder
    from tidal.model.loading import load_tokenizer

    prompt_encoder(load_tokenizer(base_model), cfg.data)("1+1=")


def run_async(coro):
    return asyncio.run(coro)

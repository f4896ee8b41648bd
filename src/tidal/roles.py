"""Each role as a function: what `tidal train` and `tidal rollout-worker` run (locally or in a pod).

This module wires the packages together (the trainer and the rollout package never import each
other): the trainer's group source, its NCCL weight push over the vLLM adapter, and sync mode's
in-process generation."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from tidal.config import TidalConfig
from tidal.data import load_dataset
from tidal.model.loading import load_model_and_tokenizer
from tidal.model.warm_start import prepare_base_model
from tidal.protocol import GroupLimits, RunState
from tidal.rewards import RewardScorer
from tidal.rollout.engine import HFEngine
from tidal.rollout.worker import RolloutWorker, generate_groups
from tidal.rundir import RunFiles, RunInfo
from tidal.runtime import set_threads, split_cores
from tidal.tracking import Tracker
from tidal.trainer.learner import Learner
from tidal.trainer.loop import train
from tidal.trainer.sources import InProcessSource, QueueSource
from tidal.trainer.weight_push import NcclWeightPush, rendezvous_endpoint
from tidal.transport import Transport, weight_handshake
from tidal.weights import WeightStore

log = logging.getLogger(__name__)


def build_learner(cfg: TidalConfig, base_model: str) -> tuple[Learner, object]:
    model, tokenizer = load_model_and_tokenizer(base_model, cfg.model.dtype)
    learner = Learner(cfg.trainer, model, tokenizer.pad_token_id, cfg.rollout.temperature, cfg.reward, cfg.rollout.max_new_tokens)
    return learner, tokenizer


def require_single_rank() -> None:
    """The trainer is one process today; several ranks would each consume the ROLLOUTS stream."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(
            f"WORLD_SIZE={world}: the Tidal trainer does not shard across ranks yet; run the trainer job with 1 node and nproc_per_node=1"
        )


def group_limits(cfg: TidalConfig, learner: Learner, max_bytes: int):
    """version -> what a group of that iteration may contain (validated at decode)."""
    vocab = int(learner.model.get_input_embeddings().num_embeddings)

    def limits(version: int) -> GroupLimits:
        return GroupLimits(
            vocab_size=vocab,
            max_new_tokens=cfg.rollout.max_new_tokens,
            group_size=cfg.rollout.group_size,
            newest_version=version,
            max_bytes=max_bytes,
        )

    return limits


async def nccl_weight_push(cfg: TidalConfig, transport: Transport) -> NcclWeightPush | None:
    """None unless the config asks for NCCL; turned off at once (with the reason) when this process cannot."""
    if cfg.rollout.engine != "vllm" or cfg.rollout.vllm.weight_sync != "nccl":
        return None
    from tidal.rollout import vllm_adapter

    reason = vllm_adapter.nccl_unavailable_reason()
    if reason:
        await weight_handshake.turn_off(transport, reason)
        return None
    v = cfg.rollout.vllm
    return NcclWeightPush(
        transport,
        cfg.rollout.workers,
        v.tensor_parallel_size,
        v.nccl_timeout_seconds,
        vllm_adapter.NcclWeightSender,
        vllm_adapter.nccl_update_info,
        rendezvous_endpoint(),
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
        status = await transport.run_status()
        if status is None or status.state is not RunState.RUNNING:
            await transport.put_run_state(RunState.RUNNING, status.round if status else None)
        push = await nccl_weight_push(cfg, transport)
        weight_push = None if push is None else (lambda v: push.push(v, learner.model.state_dict()))
        source = QueueSource(transport, group_limits(cfg, learner, transport.max_message_bytes), lambda v: str(store.path(v)), weight_push)
        history = await train(cfg, learner, source, dataset, store, RunFiles(run_dir), tracker, iterations)
        finished = (store.latest_version() or 0) >= cfg.trainer.iterations
        await transport.put_run_state(RunState.DONE if finished else RunState.ROUND_DONE, status.round if status else None)
        log.info("trainer finished %d iterations", len(history))
        return history
    except BaseException:
        await transport.put_run_state(RunState.FAILED)
        raise
    finally:
        await transport.close()


def in_process_source(cfg: TidalConfig, learner: Learner, tokenizer, store: WeightStore, engine=None) -> InProcessSource:
    """Sync mode's source: generation in this process. `engine` None: the HF engine over the
    learner's own model (no copy); else an engine with `load_snapshot` (vLLM) that loads version v
    from the weight store before generating it."""
    scorer = RewardScorer.from_config(cfg.reward)
    if engine is None:
        engine = HFEngine.for_rollout(learner.model, tokenizer, cfg.rollout)
        load_weights = None
    else:

        def load_weights(version: int) -> None:
            if engine.version != version:
                engine.load_snapshot(store.path(version), version)

    return InProcessSource(lambda items, version: generate_groups(engine, tokenizer, scorer, items, cfg, version, "sync"), load_weights)


def sync_trainer(cfg: TidalConfig, run_dir: Path, info: RunInfo, dataset, tracker, on_iteration=None, engine=None) -> list[dict]:
    """Sync mode in this process: generate, then train, all cores to each phase."""
    learner, tokenizer = build_learner(cfg, info.base_model)
    store = WeightStore(run_dir / "weights", info.base_model)
    source = in_process_source(cfg, learner, tokenizer, store, engine)
    return asyncio.run(train(cfg, learner, source, dataset, store, RunFiles(run_dir, on_iteration), tracker))


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

"""Each role as a function: what `tidal train` and `tidal rollout-worker` run (locally or in a pod).

This module wires the packages together (the trainer and the rollout package never import each
other): the trainer's group source, its NCCL weight push over the vLLM adapter, and sync mode's
in-process generation. The rollout side (engines, workers, rewards, environments) is imported where
a role generates (a worker, sync mode): a periodic trainer's process never loads it."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.config import TidalConfig
from tidal.data import load_dataset
from tidal.devices import resolve_device
from tidal.model.base_model import prepare_base_model
from tidal.model.loading import load_model, load_tokenizer
from tidal.model.lora import adapter_config, apply_lora
from tidal.model.probe import make_probe
from tidal.protocol import GroupLimits, RunState
from tidal.run_keys import load_public_key, load_signing_key
from tidal.rundir import RunDir, RunInfo
from tidal.sandbox import confine_user_code
from tidal.threads import core_split, set_threads, sync_generation_threads, torch_threads
from tidal.trainer.compute import on_compute_thread
from tidal.trainer.distributed import DistContext, context_from_env, init_process_group
from tidal.trainer.distributed import shutdown as shutdown_process_group
from tidal.trainer.learner import Learner
from tidal.trainer.loop import train
from tidal.trainer.sources import BroadcastSource, InProcessSource, QueueSource
from tidal.trainer.strategy import Strategy, build_strategy, resolve_strategy_name
from tidal.trainer.weight_push import NcclWeightPush, rendezvous_endpoint
from tidal.transport import Transport, session, weight_handshake
from tidal.weights import WeightStore

log = logging.getLogger(__name__)


def load_policy(cfg: TidalConfig, base_model: str | Path, tokenizer=None) -> tuple[torch.nn.Module, object]:
    """The base model and its tokenizer (`tokenizer`: the one this process holds already, else loaded); under
    model.lora wrapped by peft (the adapter at its start: the base exactly)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(base_model)
    model = load_model(base_model, cfg.model.dtype)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora, cfg.seed)
    return model, tokenizer


def build_learner(
    cfg: TidalConfig, base_model: str, strategy: Strategy | None = None, device: str | None = None, tokenizer=None
) -> tuple[Learner, object]:
    model, tokenizer = load_policy(cfg, base_model, tokenizer)
    learner = Learner(
        cfg.trainer, model, tokenizer.pad_token_id, cfg.rollout.temperature, cfg.reward, cfg.rollout.max_new_tokens, strategy=strategy, device=device
    )
    return learner, tokenizer


def trainer_weight_store(
    cfg: TidalConfig, run: RunDir, base_model: str, learner: Learner, signing_key: str | None = None, loaded_by_engines: bool = True
) -> WeightStore:
    """The run's weight store as the trainer writes it: adapters under LoRA, each version with its probe log-probs
    (every rank builds the same probe, responses sampled from the base model: each runs the probe forward, rank 0
    writes). `loaded_by_engines` False (sync mode's HF engine generates with the learner's own weights): no
    engine loads a version, so none would check it, and the probe's forward per version is left out."""
    adapter = adapter_config(learner.peft_model, str(base_model)) if learner.lora else None
    checked = cfg.weights.arrival_tolerance != 0 and loaded_by_engines  # None: the engine's default
    if not checked:
        return WeightStore(run.weights, base_model, adapter, signing_key=signing_key)
    # built before a resumed run loads its checkpoint: the learner holds the base model, so every start of the run
    # samples the same probe, and records the base's log-probs for engines to calibrate on (rollout.arrival.ArrivalCheck)
    probe = learner.sample_probe(make_probe(cfg.seed, int(learner.model.get_input_embeddings().num_embeddings)), cfg.seed)
    return WeightStore(run.weights, base_model, adapter, probe, learner.probe_logprobs(probe), signing_key)


def rank_device(cfg: TidalConfig, ctx: DistContext) -> str:
    """trainer.device for this rank: an accelerator is indexed by the local rank under torchrun."""
    device = resolve_device(cfg.trainer.device)
    kind = device.partition(":")[0]
    if ctx.distributed and kind in ("cuda", "npu"):
        device = f"{kind}:{ctx.local_rank}"
        getattr(torch, kind).set_device(ctx.local_rank)
    return device


def role_cores(cfg: TidalConfig) -> tuple[int, int]:
    """(trainer threads over all its ranks, threads per rollout worker) from the thread plan in the config
    (numbers, as `tidal run` writes them; a pod's `auto`: an even split of this machine's cores)."""
    return core_split(cfg.mode, cfg.rollout.initial_workers, cfg.trainer.threads, cfg.rollout.threads)


def start_trainer_ranks(cfg: TidalConfig, run: RunDir) -> tuple[DistContext, Strategy, str]:
    """This process's rank (torchrun's environment), its process group, strategy and device."""
    ctx = context_from_env()
    set_threads(max(1, role_cores(cfg)[0] // ctx.local_world_size))
    resolve_strategy_name(cfg.trainer.strategy, ctx.world_size)  # one that cannot run here: an error before any rendezvous
    device = rank_device(cfg, ctx)
    init_process_group(ctx, device.partition(":")[0])
    strategy = build_strategy(cfg.trainer, ctx)
    if ctx.distributed:
        run.logs.mkdir(parents=True, exist_ok=True)
        run.pid_file(f"trainer-rank{ctx.rank}").write_text(str(os.getpid()))
        log.info("trainer rank %d of %d on %s, strategy %s", ctx.rank, ctx.world_size, device, strategy.name)
    return ctx, strategy, device


def group_limits(cfg: TidalConfig, learner: Learner, max_bytes: int):
    """version -> what a group of that iteration may contain (validated at decode)."""
    vocab = int(learner.model.get_input_embeddings().num_embeddings)

    def limits(version: int) -> GroupLimits:
        return GroupLimits(
            vocab_size=vocab,
            max_new_tokens=cfg.rollout.max_new_tokens,
            max_turns=cfg.rollout.agent.max_turns if cfg.rollout.agent else 1,
            max_env_tokens_per_turn=cfg.rollout.agent.max_env_tokens_per_turn if cfg.rollout.agent else 0,
            group_size=cfg.rollout.group_size,
            newest_version=version,
            max_bytes=max_bytes,
        )

    return limits


async def nccl_weight_push(cfg: TidalConfig, transport: Transport, adapter: dict | None = None) -> NcclWeightPush | None:
    """None unless the config asks for NCCL; turned off at once (with the reason) when this process cannot.
    `adapter` (model.lora: peft's adapter config): each version is the adapter's tensors alone, added as a LoRA adapter."""
    if cfg.rollout.engine != "vllm" or cfg.rollout.vllm.weight_sync != "nccl":
        return None
    from tidal.rollout import vllm_weights

    reason = vllm_weights.nccl_unavailable_reason()
    if reason:
        await weight_handshake.turn_off(transport, reason)
        return None
    v = cfg.rollout.vllm
    return NcclWeightPush(
        transport,
        cfg.rollout.initial_workers,
        v.tensor_parallel_size,
        v.nccl_timeout_seconds,
        vllm_weights.NcclWeightSender,
        functools.partial(vllm_weights.nccl_update_info, adapter_config=adapter),
        rendezvous_endpoint(),
    )


async def trainer_role(cfg: TidalConfig, run: RunDir, nats_url: str, iterations: int | None = None, credentials: dict | None = None) -> list[dict]:
    """The trainer, on one rank or many (torchrun): rank 0 alone talks to NATS and MLflow, and signs the snapshots
    it writes with the private key it reads from its file."""
    confine_user_code(cfg, run.root)
    load_public_key(cfg.weights.public_key_file, run)  # a resume loads the weights its checkpoint names, checked
    info = run.info()
    ctx, strategy, device = start_trainer_ranks(cfg, run)
    try:
        if not ctx.is_main:
            return await follower_trainer(cfg, run, info, ctx, strategy, device, iterations)
        return await main_trainer(cfg, run, nats_url, info, ctx, strategy, device, iterations, credentials)
    finally:
        shutdown_process_group()


async def follower_trainer(cfg, run: RunDir, info: RunInfo, ctx: DistContext, strategy: Strategy, device: str, iterations: int | None) -> list[dict]:
    learner, _ = build_learner(cfg, info.base_model, strategy, device)
    store = trainer_weight_store(cfg, run, info.base_model, learner)
    source = BroadcastSource(None, ctx)
    return await train(cfg, learner, source, load_dataset(cfg.data, cfg.seed), store, run, None, iterations)


async def main_trainer(
    cfg,
    run: RunDir,
    nats_url: str,
    info: RunInfo,
    ctx: DistContext,
    strategy: Strategy,
    device: str,
    iterations: int | None,
    credentials: dict | None,
) -> list[dict]:
    async with session(nats_url, info.run_id, cfg.transport, create=True, credentials=credentials) as transport:
        try:  # from here on, any failure (a model that does not load included) is written to the run state
            dataset = load_dataset(cfg.data, cfg.seed)
            learner, _ = build_learner(cfg, info.base_model, strategy, device)
            store = trainer_weight_store(cfg, run, info.base_model, learner, load_signing_key(cfg.weights.signing_key_file, run))
            tracker = run.tracker()
            status = await transport.run_status()
            if status is None or status.state is not RunState.RUNNING:
                await transport.put_run_state(RunState.RUNNING, status.round if status else None)
            push = await nccl_weight_push(cfg, transport, store.adapter_config)
            if push is not None and ctx.distributed:
                # the full weights are a collective of every rank; the push runs on rank 0 alone
                await weight_handshake.turn_off(transport, f"the trainer has {ctx.world_size} ranks: weights go through the weight store")
                push = None
            weight_push = None if push is None else (lambda v: push.push(v, learner.pushed_state()))
            # one rank only: gathering the weights is a collective under several ranks
            repair = (lambda v: on_compute_thread(lambda: store.repair(v, learner.full_state_dict()))) if ctx.world_size == 1 else None
            source = QueueSource(
                transport, group_limits(cfg, learner, transport.max_message_bytes), lambda v: str(store.path(v)), weight_push, repair
            )
            if ctx.distributed:
                source = BroadcastSource(source, ctx)
            history = await train(cfg, learner, source, dataset, store, run, tracker, iterations)
            finished = (store.latest_version() or 0) >= cfg.trainer.iterations
            await transport.put_run_state(RunState.DONE if finished else RunState.ROUND_DONE, status.round if status else None)
            log.info("trainer finished %d iterations", len(history))
            return history
        except BaseException:
            try:
                await transport.put_run_state(RunState.FAILED)
            except Exception as err:  # noqa: BLE001 - NATS may be what failed: the original error is the one to report
                log.warning("could not record the failed run state: %s", err)
            raise


def judge_seed(cfg: TidalConfig) -> int | None:
    """rollout.deterministic: LLM judges sample at temperature 0 with the run's seed."""
    return cfg.seed if cfg.rollout.deterministic else None


def in_process_source(cfg: TidalConfig, run: RunDir, learner: Learner, tokenizer, store: WeightStore, engine=None) -> InProcessSource:
    """Sync mode's source: generation in this process. `engine` None: the HF engine over the
    learner's own model (no copy); else an engine with `load_snapshot` (vLLM) that loads version v
    from the weight store before generating it."""
    from tidal.rewards import RewardScorer
    from tidal.rollout.agent import AgentLoop
    from tidal.rollout.engine import HFEngine
    from tidal.rollout.generator import generate_groups

    scorer = RewardScorer.from_config(cfg.reward, seed=judge_seed(cfg), served_urls=run.reward_server_urls())
    if engine is None:
        engine = HFEngine.for_rollout(learner.model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
        engine.generate_inline = True  # InProcessSource generates on the trainer's compute thread
        load_weights = None
    else:

        def load_weights(version: int) -> None:
            if engine.version != version:
                t0 = time.perf_counter()
                engine.load_snapshot(store.path(version), version)
                log.info("sync mode: the engine loaded weights v%d in %.3fs", version, time.perf_counter() - t0)

    agent = AgentLoop.from_config(cfg, tokenizer, engine.context_length) if cfg.rollout.agent is not None else None

    threads = sync_generation_threads(cfg, on_cpu=str(learner.device).startswith("cpu")) if load_weights is None else None

    def generate(items, version):
        with torch_threads(threads):
            return generate_groups(
                engine,
                tokenizer,
                scorer,
                items,
                cfg,
                version=version,
                worker_id="sync",
                max_groups_per_call=cfg.rollout.sync_groups_per_call,
                agent=agent,
            )

    return InProcessSource(generate, load_weights)


def sync_trainer(
    cfg: TidalConfig,
    run: RunDir,
    dataset,
    tracker,
    engine=None,
    signing_key: str | None = None,
    on_iteration: Callable[[dict], None] | None = None,
    tokenizer=None,
) -> list[dict]:
    """Sync mode in this process: generate, then train, all cores to each phase. `signing_key`: the run's
    private key, handed over by the launcher (never put in the environment its other children inherit);
    `tokenizer`: the base model's, which the launcher holds already."""
    confine_user_code(cfg, run.root)
    learner, tokenizer = build_learner(cfg, run.info().base_model, tokenizer=tokenizer)
    store = trainer_weight_store(cfg, run, run.info().base_model, learner, signing_key, loaded_by_engines=engine is not None)
    source = in_process_source(cfg, run, learner, tokenizer, store, engine)
    return asyncio.run(train(cfg, learner, source, dataset, store, run, tracker, on_iteration=on_iteration))


def rollout_engine(cfg: TidalConfig, base_model: str) -> tuple[object, object, type]:
    """(engine, tokenizer, worker class) for `rollout.engine`; vLLM is imported only when asked for."""
    from tidal.rollout.engine import HFEngine
    from tidal.rollout.worker import RolloutWorker

    if cfg.rollout.engine == "vllm":
        from tidal.rollout.vllm_adapter import VLLMEngine
        from tidal.rollout.vllm_worker import VLLMRolloutWorker

        # rollout.partial: one call's groups stop together for newer weights, which the pull-at-a-time worker
        # has (its engine calls are one iteration's); the continuous-batching worker never stops its groups
        worker = RolloutWorker if cfg.rollout.partial else VLLMRolloutWorker
        return VLLMEngine.create(cfg, base_model), load_tokenizer(base_model), worker
    model, tokenizer = load_policy(cfg, base_model)  # under LoRA the base once, each version's adapter set in place
    return HFEngine.for_rollout(model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature), tokenizer, RolloutWorker


def cancel_on_sigterm() -> Callable[[], bool]:
    """SIGTERM (the launcher stopping, a preemption) cancels the running task: the worker's `finally`
    blocks run (vLLM's engine shut down in order) instead of the process ending where it stands.
    Returns whether SIGTERM came: a cancellation can be lost (Python 3.11's wait_for, inside the NATS
    client, swallows one that meets a message arriving), so the worker also checks this between pulls."""
    task, requested = asyncio.current_task(), []

    def on_sigterm() -> None:
        requested.append(True)
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    return lambda: bool(requested)


async def worker_role(cfg: TidalConfig, run: RunDir, nats_url: str, worker_id: str, credentials: dict | None = None) -> int:
    from tidal.rewards import RewardScorer

    confine_user_code(cfg, run.root)
    load_public_key(cfg.weights.public_key_file, run)  # every snapshot it loads is checked against it
    stop_requested = cancel_on_sigterm()
    info = run.info()
    set_threads(role_cores(cfg)[1])
    # user rewards' process starts beside the model load; not before vLLM, whose engine processes
    # would inherit its pipes and keep it alive after this worker dies
    scorer = RewardScorer.from_config(cfg.reward, prestart=cfg.rollout.engine == "hf", seed=judge_seed(cfg), served_urls=run.reward_server_urls())
    engine, tokenizer, worker_class = rollout_engine(cfg, info.base_model)
    try:
        async with session(nats_url, info.run_id, cfg.transport, credentials=credentials) as transport:
            worker = worker_class(
                cfg, engine, tokenizer, transport, worker_id, weights_root=run.weights, scorer=scorer, stop_requested=stop_requested
            )
            await worker.run()
    finally:
        engine.shutdown()  # vLLM's engine processes would otherwise outlive the worker
        scorer.close()
    return worker.groups_published


def ensure_base_model(cfg: TidalConfig, progress=None) -> str:
    return str(prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed), progress))


def check_prompt_settings(cfg: TidalConfig, base_model: str | Path) -> None:
    """data.prompt_template / chat_template against the model's tokenizer, once, before any worker
    starts (a tokenizer without a chat template is a DatasetError naming the key)."""
    from tidal.data import prompt_encoder
    from tidal.preflight import tokenizer_of

    prompt_encoder(tokenizer_of(str(base_model)), cfg.data)("1+1=")


def run_async(coro):
    return asyncio.run(coro)

"""The one iteration loop, for every mode: `train(cfg, learner, source, ...)`.

Per iteration v: open it (weights v available, v's prompts asked for), collect its groups (each
trained as it arrives), close it (one step, v+1 published and opened, v made durable) and record
its metrics; iteration.py has the steps. The modes differ only in the source (in-process generation
for sync, the queue for periodic and bounded) and in how much staleness is allowed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from tidal.config import TidalConfig
from tidal.data import Dataset
from tidal.rundir import RunDir
from tidal.trainer.boundary import forget_unfinished, prune_snapshots, publish_weights
from tidal.trainer.checkpoint import resume_version
from tidal.trainer.iteration import Iteration, IterationUpdates, LoopContext, TailThreads
from tidal.trainer.iteration_plan import IterationPlan, StalenessError
from tidal.trainer.learner import Learner
from tidal.trainer.sources import GroupSource
from tidal.weights import WeightStore

# the trainer's entry point, and the names the rest of Tidal and its tests take from here
__all__ = ["train", "IterationPlan", "IterationUpdates", "StalenessError", "TailThreads", "forget_unfinished", "prune_snapshots"]


async def train(
    cfg: TidalConfig,
    learner: Learner,
    source: GroupSource,
    dataset: Dataset,
    store: WeightStore,
    files: RunDir,
    tracker,
    iterations: int | None = None,
    on_iteration: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Runs iterations from the last checkpoint to `trainer.iterations` (or `iterations` more: a
    pipeline round) and returns their metrics.

    Under several ranks every rank runs this loop on the same groups (the source broadcasts them)
    and trains its share; only rank 0 writes the weight store, the run's records and MLflow."""
    start = resume_version(files, learner, store)
    if learner.ctx.is_main:
        forget_unfinished(files, store, start)
    end = cfg.trainer.iterations if iterations is None else min(cfg.trainer.iterations, start + iterations)
    if store.latest_version() is None or store.latest_version() < start:
        publish_weights(store, start, learner)
    # Everything built so far (the model, transformers, MLflow, NATS) lives for the whole run: out of the
    # cyclic collector's scans, whose full (generation 2) passes over so many objects would stall iterations
    gc.freeze()
    run = LoopContext.start(cfg, learner, source, dataset, store, files, tracker, end, on_iteration)
    history: list[dict] = []
    iteration = await Iteration.open(run, start) if start < end else None
    while iteration is not None:
        await iteration.collect()  # every expected group in, each trained as it arrived
        if iteration.version == start:  # before its step: a reward failing on every sample would train on zeros
            stop_on_a_reward_failing_every_call(cfg, iteration.plan)
        following = await iteration.close()  # the step, v+1 published and opened, v made durable
        history.append(run.record(iteration.metrics()))
        iteration = following
    await run.writer.drain()
    await source.finish(end)
    return history


def stop_on_a_reward_failing_every_call(cfg: TidalConfig, plan: IterationPlan) -> None:
    """RewardFailingError naming a reward that failed every one of its calls in `plan`'s iteration (the
    first of this run or resume): a reward URL that refuses, a function that always raises or returns
    no number. reward.max_error_rate's window would need hundreds of calls to say so, a short run never."""
    from tidal.rewards import reward_error_rates
    from tidal.rewards.failures import RewardFailingError, failing_every_call

    found = failing_every_call(plan.failures, reward_error_rates(cfg.reward))
    if found is not None:
        name, (calls, _, error) = found
        raise RewardFailingError(f"reward {name} failed every one of its {calls} calls in iteration {plan.version}, the run's first: {error}")

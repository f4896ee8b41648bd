"""How many threads each process of a run uses. `tidal run` resolves the plan once (the planner's
figures, or an even split of the cores) and writes it into the run's config.yaml as numbers; every
role then reads its threads from the config it is given, like any other setting."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from tidal.config import TidalConfig


def set_threads(n: int) -> None:
    import torch  # here, not at the top: a refusal before anything starts should not wait for torch

    torch.set_num_threads(max(1, n))
    os.environ["OMP_NUM_THREADS"] = str(max(1, n))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Torch's threads set to `n` inside the block and put back after it (None: unchanged). Process-wide:
    only for phases that nothing else computes beside (sync mode's generation)."""
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sync_generation_threads(cfg: TidalConfig, on_cpu: bool) -> int | None:
    """Sync mode's threads while it generates (None: the trainer's): rollout.threads when a number; unset,
    one for multi-turn calls on CPU, whose decode steps run on the event loop's helper threads between tool
    calls, where another OpenMP team per hop costs more than a second thread gains a small decode batch
    (docs/benchmarks.md); single-turn calls generate on the trainer's own thread and team."""
    if isinstance(cfg.rollout.threads, int):
        return cfg.rollout.threads
    return 1 if on_cpu and cfg.rollout.agent is not None else None


def split_cores(cfg: TidalConfig, cores: int | None = None) -> tuple[int, int]:
    """(trainer threads over all its ranks, threads per rollout worker), unless set in config. `tidal
    run` replaces `auto` by the capacity planner's figures before any role starts; a role started
    another way (a pod) reads `auto` as an even split. Sync mode has no worker process: the trainer,
    which generates too, gets every core."""
    return core_split(cfg.mode, cfg.rollout.initial_workers, cfg.trainer.threads, cfg.rollout.threads, cores)


def core_split(mode: str, workers: int, trainer: int | str, rollout: int | str, cores: int | None = None) -> tuple[int, int]:
    """split_cores from the values it reads: the mode, the worker count, trainer.threads and rollout.threads."""
    cores = cores or os.cpu_count() or 1
    share = cores if mode == "sync" else max(1, cores // (workers + 1))
    trainer = trainer if isinstance(trainer, int) else share
    rollout = rollout if isinstance(rollout, int) else max(1, (cores - trainer) // workers)
    return trainer, rollout


def tail_thread_total(setting: int | str | None, trainer_threads: int, worker_threads: int, cores: int) -> int | None:
    """trainer.tail_threads as a count over all trainer ranks, at most the cores: `auto` is the
    trainer's threads and its workers' together (the cores those workers leave idle at the
    iteration's tail); None when it would not add a thread."""
    if setting is None:
        return None
    tail = trainer_threads + worker_threads if setting == "auto" else int(setting)
    tail = min(tail, cores)
    return tail if tail > trainer_threads else None


def eval_threads(cfg: TidalConfig, cores: int) -> int | None:
    """The eval.every follower's threads: it runs beside the trainer and the workers, and takes a share of
    the cores as if it were two more workers; None when there is no follower."""
    if not (cfg.eval.enabled and cfg.eval.every):
        return None
    return max(1, cores // (cfg.rollout.initial_workers + 2))


def resolve_threads(cfg: TidalConfig, cores: int | None = None) -> TidalConfig:
    """The config a run's separate processes read: trainer.threads, rollout.threads and
    trainer.tail_threads as numbers (tail None where it adds nothing), and eval.threads for an
    eval.every follower. Sync mode's trainer runs in the launcher and keeps its settings."""
    cores = cores or os.cpu_count() or 1
    if cfg.eval.threads is None and eval_threads(cfg, cores) is not None:
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"threads": eval_threads(cfg, cores)})}, deep=True)
    if cfg.mode == "sync":
        return cfg
    trainer, worker = split_cores(cfg, cores)
    per_rank = max(1, trainer // cfg.trainer.ranks)
    tail = None
    if cfg.mode == "periodic":
        tail = tail_thread_total(cfg.trainer.tail_threads, per_rank * cfg.trainer.ranks, cfg.rollout.initial_workers * worker, cores)
    return cfg.model_copy(
        update={
            "trainer": cfg.trainer.model_copy(update={"threads": per_rank * cfg.trainer.ranks, "tail_threads": tail}),
            "rollout": cfg.rollout.model_copy(update={"threads": worker}),
        },
        deep=True,
    )


def tail_threads(setting: int | str | None, mode: str, ranks: int, threads: int) -> int | None:
    """One trainer rank's threads once its iteration's groups are all in (trainer.tail_threads over `ranks`),
    when more than `threads`; None otherwise. Only a number counts: `auto` is resolved by `tidal run`, which
    knows whose cores are free; a pod started with `auto` does not."""
    if mode != "periodic" or not isinstance(setting, int):
        return None
    per_rank = max(1, setting // ranks)
    return per_rank if per_rank > threads else None

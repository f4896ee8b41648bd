"""Sync mode's iteration, phase by phase, under several thread plans in one process: the example's warm start,
its prompts, `generate_groups` over the HF engine that shares the learner's model (as sync mode runs it) and the
`Learner`'s training call and step. The plans alternate iteration by iteration (A B B A ...), so a busy machine's
load falls on each alike. Per plan: median wall seconds of generation (with scoring) and of training (with the
step), and the process CPU seconds per iteration. With one thread the CPU time barely depends on the load; with
two, it counts libgomp's spinning too.

Plans: `t1` one torch thread; `t2` two, generation on a new thread per iteration (sync mode's plan: a second
OpenMP team); `t2one` two, generation on the training thread (one team); a trailing `-call` (e.g. `t1-call`)
generates every group of the iteration in one engine call instead of `rollout.generation_token_budget`'s chunks.

    PYTHONPATH=src python benchmarks/sync_phases.py [examples/arithmetic.yaml] --iterations 13 --plans t1,t2,t1-call
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidal.config import load_config
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.rewards import RewardScorer
from tidal.roles import build_learner, judge_seed
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import Generator, generate_groups, generation_chunks, response_tokens
from tidal.trainer.iteration_plan import IterationPlan

PLANS = ("t1", "t2", "t2one")


def plan_order(plans: list[str], iterations: int) -> list[str]:
    """A B B A A B ... for two plans (each plan first and last alike), rotations of the list for more."""
    return [plans[(v + v // len(plans)) % len(plans)] for v in range(iterations)]


def on_this_thread(cfg, engine, tokenizer, scorer, items, version: int) -> list:
    """generate_groups' calls and scoring, run on the calling thread (no event loop, no second thread)."""
    gen = Generator(cfg, engine, tokenizer, scorer, "sync")
    prompts = [gen.prompt(it) for it in items]
    chunks = generation_chunks([len(p) for p in prompts], cfg.rollout.group_size, response_tokens(cfg), cfg.rollout.generation_token_budget)
    groups = []
    for chunk in chunks:
        batch = [items[i] for i in chunk]
        requests = [gen.request(it, prompts[i]) for i, it in zip(chunk, batch)]
        outputs = engine.generate(requests)
        groups += gen.score([(it, r.prompt_ids, out, version, 0.0, 0.0) for it, r, out in zip(batch, requests, outputs)])
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="examples/arithmetic.yaml")
    ap.add_argument("--iterations", type=int, default=13)
    ap.add_argument("--warmup", type=int, default=1, help="leading iterations of each plan left out")
    ap.add_argument("--plans", default="t1,t2")
    args = ap.parse_args()
    plans = args.plans.split(",")
    for p in plans:
        if p.removesuffix("-call") not in PLANS:
            raise SystemExit(f"unknown plan {p!r}: one of {PLANS}, each optionally with -call")
    cfg = load_config(args.config, ["mode=sync", "eval.enabled=false"])
    one_call = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"generation_token_budget": 1 << 30})}, deep=True)
    dataset = load_dataset(cfg.data, cfg.seed)
    learner, tokenizer = build_learner(cfg, str(prepare_base_model(cfg, dataset)))
    engine = HFEngine.for_rollout(learner.model, tokenizer, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    scorer = RewardScorer.from_config(cfg.reward, seed=judge_seed(cfg))
    rows: dict[str, list[tuple[float, float, float]]] = {p: [] for p in plans}
    for v, plan in enumerate(plan_order(plans, args.iterations)):
        base, call = plan.removesuffix("-call"), plan.endswith("-call")
        c = one_call if call else cfg
        torch.set_num_threads(1 if base == "t1" else 2)
        w0, c0 = time.perf_counter(), time.process_time()
        _, items = IterationPlan.for_iteration(c, dataset, v)
        if base == "t2one":
            groups = on_this_thread(c, engine, tokenizer, scorer, items, v)
        else:
            groups = generate_groups(engine, tokenizer, scorer, items, c, version=v, worker_id="sync")
        w1 = time.perf_counter()
        learner.begin_iteration(v)
        learner.train_on_groups(groups)
        learner.step()
        w2 = time.perf_counter()
        rows[plan].append((w1 - w0, w2 - w1, time.process_time() - c0))
    print("| plan | generate s | train s | iteration s | process CPU s |\n| --- | --- | --- | --- | --- |")
    for plan in plans:
        kept = rows[plan][args.warmup :] or rows[plan]
        gen, train, cpu = (statistics.median(r[i] for r in kept) for i in range(3))
        print(f"| {plan} | {gen:.3f} | {train:.3f} | {gen + train:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()

"""One iteration's generation of the calculator example on the HF engine, as sync mode makes it: wall and
CPU seconds, engine calls, forward passes and their batch sizes, with the tools' processes warm.

    PYTHONPATH=src python benchmarks/calculator_generation.py [--budget N] [--threads N] [--prompts 32]

To compare two trees (say main and a branch) on a shared machine, run it alternately under each tree's
PYTHONPATH, three times or more, and compare medians of both the wall and the CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tidal.config import load_config
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.model.loading import load_model_and_tokenizer
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import generate_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/calculator.yaml")
    ap.add_argument("--budget", type=int, default=None, help="rollout.generation_token_budget (default: the config's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.budget:
        cfg.rollout.generation_token_budget = args.budget
    dataset = load_dataset(cfg.data, cfg.seed)
    model, tok = load_model_and_tokenizer(prepare_base_model(cfg, dataset))
    torch.set_num_threads(args.threads)
    engine = HFEngine.for_rollout(model, tok, cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    scorer = RewardScorer.from_config(cfg.reward)
    agent = AgentLoop.from_config(cfg, tok, engine.context_length)
    items = [WorkItem(0, i, p.prompt, p.answer) for i, p in enumerate(dataset.train[: args.prompts])]
    warm = [WorkItem(1, 10_000 + i, it.prompt, it.answer) for i, it in enumerate(items[:8])]
    generate_groups(engine, tok, scorer, warm, cfg, version=0, worker_id="w", agent=agent)  # the tools' processes start

    batches: dict[int, int] = {}
    model.register_forward_pre_hook(
        lambda m, a, kw: batches.__setitem__(kw["input_ids"].shape[0], batches.get(kw["input_ids"].shape[0], 0) + 1), with_kwargs=True
    )
    wall, cpu = time.perf_counter(), time.process_time()
    groups = generate_groups(engine, tok, scorer, items, cfg, version=0, worker_id="w", agent=agent)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    agent.close()
    samples = [s for g in groups for s in g.samples]
    print(
        json.dumps(
            {
                "wall_seconds": round(wall, 3),
                "cpu_seconds": round(cpu, 3),
                "trajectories": len(samples),
                "sampled_tokens_per_trajectory": round(sum(int(s.loss_mask.sum()) for s in samples) / len(samples), 2),
                "turns_per_trajectory": round(sum(g.env_stats["turns"] for g in groups) / len(samples), 3),
                "forward_passes": sum(batches.values()),
                "rows_per_forward": round(sum(b * n for b, n in batches.items()) / max(1, sum(batches.values())), 1),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()

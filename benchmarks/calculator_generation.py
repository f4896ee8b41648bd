"""One iteration's generation of the calculator example on the HF engine, as sync mode makes it: wall and
CPU seconds, engine calls, forward passes and their batch sizes, with the tools' processes warm.

    PYTHONPATH=src python benchmarks/calculator_generation.py [--budget N] [--threads N] [--prompts 32] [--reps 3]

Each repetition times the engine's own decode step (tidal.rollout.decode_step) and the transformers
forward in its place, one after the other (alternating which goes first); it prints both medians and
their ratio. Both sample the same trajectories.

To compare two trees (say main and a branch) on a shared machine, run it alternately under each tree's
PYTHONPATH, three times or more, and compare medians of both the wall and the CPU seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from tidal.config import load_config
from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.model.loading import load_model_and_tokenizer
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.agent import AgentLoop
from tidal.rollout.decode_step import DecodeStep
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import generate_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/calculator.yaml")
    ap.add_argument("--budget", type=int, default=None, help="rollout.generation_token_budget (default: the config's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
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
    count_forwards(model, batches)
    runs: dict[str, list[dict]] = {"own step": [], "transformers forward": []}
    for rep in range(args.reps):
        for name in sorted(runs, reverse=rep % 2 == 1):
            batches.clear()
            with decode_steps(name == "own step"):
                wall, cpu = time.perf_counter(), time.process_time()
                groups = generate_groups(engine, tok, scorer, items, cfg, version=0, worker_id="w", agent=agent)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            samples = [s for g in groups for s in g.samples]
            runs[name].append(
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
            print(json.dumps({"step": name, **runs[name][-1]}))
    agent.close()
    medians = {name: statistics.median(r["wall_seconds"] for r in rs) for name, rs in runs.items()}
    print(json.dumps({"median_wall_seconds": medians, "speed-up": round(medians["transformers forward"] / medians["own step"], 3)}))


def count_forwards(model, batches: dict[int, int]) -> None:
    """Counts every forward pass by its rows: the model's own (prefills, joins; its `forward` wrapped, since
    a hook would turn the engine's own step off) and the engine's decode steps."""
    forward, logits = model.forward, DecodeStep.logits

    def counted(rows: int) -> None:
        batches[rows] = batches.get(rows, 0) + 1

    def model_forward(*args, **kwargs):
        counted(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    def step_logits(self, input_ids, *args):
        counted(input_ids.shape[0])
        return logits(self, input_ids, *args)

    model.forward = model_forward
    DecodeStep.logits = step_logits


@contextlib.contextmanager
def decode_steps(own: bool):
    """The engine's own decode step (the default), or the transformers forward in its place."""
    of = DecodeStep.__dict__["of"]
    if not own:
        DecodeStep.of = classmethod(lambda cls, model: None)
    try:
        yield
    finally:
        DecodeStep.of = of


if __name__ == "__main__":
    main()

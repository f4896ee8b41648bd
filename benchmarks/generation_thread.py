"""Sync mode's thread plan, measured: generation on the compute thread that trains (one OpenMP team of
torch threads for both phases, as sync mode ran until 2026-12-04 18:15) against generation on a new
thread per iteration (`asyncio.to_thread` under a fresh `asyncio.run`, as `generate_groups` runs it
since: a second team). The arithmetic example's model and shapes (64 prompts x 8 samples, 10 new
tokens, 28 groups per engine call); the two plans alternate iteration by iteration in one process, so
a busy machine's load falls on both alike. Prints the medians of the generation's and the following
training step's wall time and the process CPU time per iteration. libgomp reads its wait policy when
it loads: compare OMP_WAIT_POLICY=PASSIVE (or GOMP_SPINCOUNT) by running the script under each.

    PYTHONPATH=src python benchmarks/generation_thread.py --iterations 12 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tidal.config import TinyModelConfig
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.rollout.engine import GroupRequest, HFEngine, group_generator

PROMPTS, GROUP, NEW_TOKENS, PER_CALL = 64, 8, 10, 28


def requests(tok, iteration: int) -> list[GroupRequest]:
    return [GroupRequest(tok(f"{i % 90 + 10}+{(7 * i) % 90 + 10}=").input_ids, GROUP, group_generator(0, iteration, i)) for i in range(PROMPTS)]


def generate(engine: HFEngine, reqs: list[GroupRequest]) -> list:
    """One group of completions per request, PER_CALL requests per engine call."""
    return [group for start in range(0, len(reqs), PER_CALL) for group in engine.generate(reqs[start : start + PER_CALL])]


def on_new_thread(engine: HFEngine, reqs: list[GroupRequest]) -> list:
    """As generate_groups ran before the fix: every engine call through asyncio.to_thread of a new event loop."""

    async def calls() -> list:
        return [
            group for start in range(0, len(reqs), PER_CALL) for group in await asyncio.to_thread(engine.generate, reqs[start : start + PER_CALL])
        ]

    return asyncio.run(calls())


def train_step(model, optimizer, completions, reqs) -> None:
    rows = [r.prompt_ids + c.token_ids for r, group in zip(reqs, completions) for c in group]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def iteration(plan: str, engine, optimizer, tok, i: int) -> tuple[float, float, float]:
    reqs = requests(tok, i)
    cpu0, t0 = time.process_time(), time.perf_counter()
    completions = generate(engine, reqs) if plan == "compute thread" else on_new_thread(engine, reqs)
    t1 = time.perf_counter()
    train_step(engine.model, optimizer, completions, reqs)
    return t1 - t0, time.perf_counter() - t1, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=12, help="iterations per plan, after one warm-up each")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (sync mode: every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2), tok)
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, NEW_TOKENS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    compute = ThreadPoolExecutor(1, thread_name_prefix="compute")  # the learner's compute thread
    plans = ("compute thread", "new thread per iteration")
    times: dict[str, list] = {p: [] for p in plans}
    for i in range(args.iterations + 1):
        for plan in plans if i % 2 else reversed(plans):
            figures = compute.submit(iteration, plan, engine, optimizer, tok, i).result()
            if i:
                times[plan].append(figures)
    print(f"{args.iterations} iterations per plan, {args.threads} torch threads, medians")
    print("| generation on | generate s | train step s | CPU s per iteration |")
    print("| --- | --- | --- | --- |")
    for plan in plans:
        gen, train, cpu = (statistics.median(x) for x in zip(*times[plan]))
        print(f"| {plan} | {gen:.3f} | {train:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()

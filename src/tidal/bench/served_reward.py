"""Scoring beside generation: one worker pull's engine calls against a reward server that answers
after a fixed latency, scored after each call (no overlap) and on the worker's scoring thread while
the engine runs the next call (what the worker does), in one run.

    tidal bench served-reward                        # 0.3 s latency, 6 engine calls of 128 new tokens
    tidal bench served-reward --latency 1.0 --json out.json
    (or: python benchmarks/served_reward.py ...)

Prints the seconds of each, the ratio (no overlap / overlap), and the generation alone (the same
pass against a server that answers at once): the overlap hides at most the smaller of the
generation and the scoring, so a ratio is read against those two. The model is the built-in tiny
model (random weights); the servers are OpenRLHF-protocol servers in this process (threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from tidal.config import config_from_dict
from tidal.data import load_dataset
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer, exact_match
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import Generator


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tidal bench served-reward", description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", type=float, default=0.3, help="seconds the reward server takes per request")
    p.add_argument("--calls", type=int, default=6, help="engine calls (of --groups-per-call groups)")
    p.add_argument("--groups-per-call", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", dest="json_path", help="write the figures here")
    return p.parse_args(argv)


def latency_server(latency: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            rewards = [exact_match(q[len(p) :], a) for q, p, a in zip(body["query"], body["prompts"], body["labels"])]
            out = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def one_pass(engine, tok, scorer, items, cfg, overlap: bool) -> float:
    scoring = ThreadPoolExecutor(max_workers=1) if overlap else None
    t0 = time.perf_counter()
    try:
        calls = Generator(cfg, engine, tok, scorer, "bench").calls(items, 1, max_groups_per_call=cfg.rollout.groups_per_batch, scoring=scoring)

        async def collect() -> list:
            return [call async for call in calls]

        results = asyncio.run(collect())
        groups = [g for r in results for g in (r.result() if overlap else r)]
    finally:
        if scoring is not None:
            scoring.shutdown()
    assert len(groups) == len(items) and scorer.errors == 0
    return time.perf_counter() - t0


def bench_config(args: argparse.Namespace, port: int):
    n = args.calls * args.groups_per_call
    return config_from_dict(
        {
            "data": {"num_train": max(200, n), "num_eval": 16},
            "rollout": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "groups_per_batch": args.groups_per_call},
            "reward": {"functions": [{"type": "reward_model", "name": "rm", "url": f"http://127.0.0.1:{port}/", "batch_size": 1024}]},
        }
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    server, instant = latency_server(args.latency), latency_server(0.0)
    n = args.calls * args.groups_per_call
    cfg = bench_config(args, server.server_port)
    problems = load_dataset(cfg.data, 0).train[:n]
    items = [WorkItem(1, p.id, p.prompt, p.answer) for p in problems]
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    engine = HFEngine(build_tiny_model(cfg.model.tiny, tok).eval(), tok.eos_token_id, tok.pad_token_id, args.max_new_tokens)
    scorer = RewardScorer.from_config(cfg.reward)
    instant_scorer = RewardScorer.from_config(bench_config(args, instant.server_port).reward)
    try:
        one_pass(engine, tok, scorer, items[: args.groups_per_call], cfg, False)  # warm-up
        seconds = {"no_overlap": [], "overlap": [], "generation": []}
        for _ in range(args.reps):
            seconds["no_overlap"].append(one_pass(engine, tok, scorer, items, cfg, False))
            seconds["overlap"].append(one_pass(engine, tok, scorer, items, cfg, True))
            seconds["generation"].append(one_pass(engine, tok, instant_scorer, items, cfg, False))
    finally:
        scorer.close()
        instant_scorer.close()
        server.shutdown()
        instant.shutdown()
    best = {k: min(v) for k, v in seconds.items()}
    figures = {"latency": args.latency, "calls": args.calls, "seconds": seconds, "best": best, "ratio": best["no_overlap"] / best["overlap"]}
    print(
        f"served reward ({args.latency:g}s per request, {args.calls} engine calls of {args.groups_per_call} groups, "
        f"{args.max_new_tokens} new tokens): no overlap {best['no_overlap']:.2f}s, overlap {best['overlap']:.2f}s: "
        f"{figures['ratio']:.2f}x (best of {args.reps}); generation alone {best['generation']:.2f}s, "
        f"scoring alone at least {args.calls * args.latency:.2f}s"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()

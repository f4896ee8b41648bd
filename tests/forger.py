"""The forged-groups attack of the security audit, as a process of its own: connect to a running `tidal run`'s
embedded NATS (with no credentials, or the token given), publish a forged group (the forger's own
tokens, rewards of +-1000) for every prompt of every iteration before the workers answer it, and pull
work items from the workers' consumer, answering each with a forged group. Prints one JSON line per
event: {"refused": why} (and exits 0), {"connected": true}, {"forged": n, "stolen": m}.

    python -m tests.forger RUN_DIR [--token TOKEN]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np

from tests.conftest import embedded_nats_url
from tidal.config import load_config
from tidal.data import iteration_prompt_order, load_dataset
from tidal.protocol import Group, Sample, decode_work_item
from tidal.rundir import RunDir
from tidal.transport import NatsUnavailableError, Transport


def forged_group(iteration: int, prompt_id: int, group_size: int, new_tokens: int) -> Group:
    tokens = np.arange(5, 5 + new_tokens, dtype=np.int32)
    samples = [Sample(tokens, np.full(new_tokens, -0.1, dtype=np.float32), 1000.0 if i % 2 else -1000.0) for i in range(group_size)]
    return Group(iteration, prompt_id, iteration, "forger", np.array([5, 6, 7], dtype=np.int32), samples)


def say(**event) -> None:
    print(json.dumps(event), flush=True)


async def attack(run_dir, credentials: dict) -> None:
    cfg = load_config(run_dir / "config.yaml")
    try:
        transport = await Transport.connect(embedded_nats_url(run_dir), RunDir(run_dir).run_id, cfg.transport, create=False, credentials=credentials)
    except NatsUnavailableError as err:
        say(refused=str(err))
        return
    say(connected=True)
    dataset = load_dataset(cfg.data, cfg.seed)
    group_size, new_tokens = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    forged = stolen = 0
    for v in range(cfg.trainer.iterations):
        for problem in iteration_prompt_order(dataset, cfg.seed, v)[: cfg.trainer.prompts_per_iteration]:
            await transport.publish_group(forged_group(v, problem.id, group_size, new_tokens))
            forged += 1
    say(forged=forged, stolen=stolen)
    work = await transport.work_subscription()
    while True:  # until the test stops this process
        for m in await transport.fetch(work, 8, timeout=1.0):
            item = decode_work_item(m.data)
            await transport.publish_group(forged_group(item.iteration, item.prompt_id, group_size, new_tokens))
            await m.ack()
            stolen += 1
            say(forged=forged, stolen=stolen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--token")
    args = ap.parse_args()
    from pathlib import Path

    asyncio.run(attack(Path(args.run_dir), {"token": args.token} if args.token else {}))


if __name__ == "__main__":
    main()

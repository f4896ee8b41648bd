"""Groups that finish one by one are scored in batches of what waited while the scorer was busy."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tidal.rollout.scoring_queue import GroupScoringQueue, Waiting, take_batch


def waiting(*samples):
    return [Waiting(i, n, None) for i, n in enumerate(samples)]


def test_a_batch_is_the_longest_prefix_within_the_samples_and_never_empty():
    assert [w.entry for w in take_batch(waiting(8, 8, 8, 8), 20)] == [0, 1]
    assert [w.entry for w in take_batch(waiting(8, 8), 16)] == [0, 1]
    assert [w.entry for w in take_batch(waiting(30, 8), 16)] == [0]  # one group over the cap still goes alone


def run_queue(groups: int, max_samples: int, fail_on: int | None = None):
    """Group 0 finishes first; groups 1.. finish while it is being scored (its call waits until they
    all wait), 4 samples each. Returns each caller's result (or exception) and the calls' entries."""
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        first_call_started = asyncio.Event()
        pool = ThreadPoolExecutor(max_workers=1)

        def build(entries):
            calls.append(list(entries))
            if len(calls) == 1:
                loop.call_soon_threadsafe(first_call_started.set)
                while len(queue.waiting) < groups - 1:
                    threading.Event().wait(0.01)
            if fail_on is not None and fail_on in entries:
                raise RuntimeError(f"reward server down at {fail_on}")
            return [f"scored {e}" for e in entries]

        queue = GroupScoringQueue(pool, build, max_samples)

        async def group(i):
            if i:
                await first_call_started.wait()
            return await queue.score(i, 4)

        try:
            return await asyncio.gather(*(group(i) for i in range(groups)), return_exceptions=True)
        finally:
            pool.shutdown()

    return asyncio.run(main()), calls


def test_groups_that_finish_while_one_is_scored_go_together_and_each_gets_its_own_result():
    results, calls = run_queue(5, max_samples=12)
    assert results == [f"scored {i}" for i in range(5)]
    assert calls[0] == [0]  # a lone group is scored at once, not held for a batch
    assert calls[1:] == [[1, 2, 3], [4]]  # what waited, up to 12 samples (3 groups of 4)


def test_a_failed_scoring_call_fails_its_groups_only():
    results, calls = run_queue(4, max_samples=8, fail_on=1)
    assert results[0] == "scored 0" and results[3] == "scored 3"
    assert [type(r) for r in results[1:3]] == [RuntimeError, RuntimeError]
    with pytest.raises(RuntimeError, match="down at 1"):
        raise results[1]
    assert calls == [[0], [1, 2], [3]]

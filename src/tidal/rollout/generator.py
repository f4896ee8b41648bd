"""Group generation: work items in, scored groups out, on any engine (rollout.engine.RolloutEngine).

A `Generator` owns what making a group needs: the engine, the tokenizer, the scorer and, with
rollout.agent, the agent loop. `calls` generates the groups of many work items in engine calls of
`generation_chunks` (the HF worker, sync mode); `group` one group, alone in its engine call (the vLLM
worker, many in flight at once). Every group is assembled by `make_group`.

Deterministic mode (rollout.deterministic): each group's samples depend on (seed, iteration, prompt
id) alone, through its own RNG (HF) or seed (vLLM), and every engine call holds one group.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Executor, Future
from functools import partial
from itertools import accumulate

import numpy as np

from tidal.blocking import run_blocking
from tidal.config import TidalConfig
from tidal.data import prompt_encoder
from tidal.images import ImageInputs
from tidal.protocol import Group, Sample, WorkItem
from tidal.rewards import RewardScorer, exact_match
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import Completion, GroupRequest, RolloutEngine, group_generator, group_seed
from tidal.rollout.partial import complete_partial
from tidal.rollout.refresh import Refresh
from tidal.rollout.scoring_queue import GroupScoringQueue
from tidal.rollout.trajectory import RowFeed
from tidal.token_versions import NO_VERSION


def generation_chunks(
    prompt_lengths: list[int],
    group_size: int,
    max_new_tokens: int,
    token_budget: int,
    max_groups: int | None = None,
    first_groups: int | None = None,
) -> list[range]:
    """Consecutive groups per engine call: as many whole groups as fit ``token_budget`` tokens
    (G rows of prompt + max_new_tokens each), at most ``max_groups``, at least one. Evened out, so an
    iteration's last call is not a small remainder. ``first_groups``: the first call holds only that
    many, so the trainer gets its first groups sooner (the rest are chunked as before)."""
    if not prompt_lengths:
        return []
    if first_groups:  # never more than the budget and cap would give the first call anyway
        head = len(generation_chunks(prompt_lengths, group_size, max_new_tokens, token_budget, max_groups)[0])
        if head > first_groups:
            rest = generation_chunks(prompt_lengths[first_groups:], group_size, max_new_tokens, token_budget, max_groups)
            return [range(0, first_groups), *(range(r.start + first_groups, r.stop + first_groups) for r in rest)]
    per_group = [group_size * (p + max_new_tokens) for p in prompt_lengths]
    cap = max(1, max_groups or len(per_group))
    calls, used, count = 1, 0, 0
    for tokens in per_group:
        if count and (used + tokens > token_budget or count >= cap):
            calls, used, count = calls + 1, 0, 0
        used, count = used + tokens, count + 1
    size = -(-len(per_group) // calls)  # ceil: the same number of calls, sizes within one of each other
    return [range(start, min(start + size, len(per_group))) for start in range(0, len(per_group), size)]


def response_tokens(cfg: TidalConfig) -> int:
    """The most tokens one row may add after its prompt: one response, or with rollout.agent every
    turn and what the environment inserts between turns."""
    r, agent = cfg.rollout, cfg.rollout.agent
    if agent is None:
        return r.max_new_tokens
    return agent.max_turns * r.max_new_tokens + (agent.max_turns - 1) * agent.max_env_tokens_per_turn


def finished(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Generator:
    """Generates and scores groups for one worker (or sync mode's trainer)."""

    def __init__(
        self, cfg: TidalConfig, engine: RolloutEngine, tokenizer, scorer: RewardScorer, worker_id: str, agent: AgentLoop | None = None, processor=None
    ):
        self.cfg, self.engine, self.tokenizer, self.scorer, self.worker_id = cfg, engine, tokenizer, scorer, worker_id
        self.agent = agent
        self.encode = prompt_encoder(tokenizer, cfg.data)
        self.processor = processor or getattr(
            engine, "processor", None
        )  # a vision-language model's (tidal.model.vision.VisionProcessor): items with images
        self.images: dict[str, ImageInputs] = {}  # an item's processed images, from its prompt until its group is made

    @classmethod
    def for_worker(cls, cfg: TidalConfig, engine: RolloutEngine, tokenizer, scorer: RewardScorer, worker_id: str) -> Generator:
        """With rollout.agent, with an agent loop of its own (`close` stops its tools)."""
        agent = AgentLoop.from_config(cfg, tokenizer, engine.context_length) if cfg.rollout.agent is not None else None
        return cls(cfg, engine, tokenizer, scorer, worker_id, agent)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()  # its tools' process

    def prompt(self, item: WorkItem) -> list[int]:
        """The prompt tokens of `item`'s group (with rollout.agent: one environment's first messages, rendered)."""
        self.check_processor(item)
        if self.agent is not None:
            return self.agent.first_prompt(item, self.processor, self.processed_images(item))
        if not item.images:
            return self.encode(item.prompt)
        prompt, self.images[item.msg_id] = self.processor.encode(self.encode(item.prompt, len(item.images)), item.images)
        return prompt

    def processed_images(self, item: WorkItem) -> ImageInputs | None:
        """`item`'s images processed, once, kept until its group is made (rollout.agent: the loop renders the prompt)."""
        if item.images and item.msg_id not in self.images:
            self.check_processor(item)
            self.images[item.msg_id] = self.processor.process_images(item.images)
        return self.images.get(item.msg_id)

    def check_processor(self, item: WorkItem) -> None:
        if item.images and self.processor is None:
            raise ValueError(f"work item {item.msg_id} has images: a vision-language model's processor takes them")

    def request(self, item: WorkItem, prompt: list[int]) -> GroupRequest:
        """The group's request: G rows, and in deterministic mode its own RNG (HF) and seed (vLLM)."""
        r, seed = self.cfg.rollout, self.cfg.seed
        return GroupRequest(
            prompt,
            r.group_size,
            group_generator(seed, item.iteration, item.prompt_id),
            group_seed(seed, item.iteration, item.prompt_id) if r.deterministic else None,
            images=self.images.get(item.msg_id),
            image_files=item.images or None,
        )

    async def calls(
        self,
        items: list[WorkItem],
        version: int,
        *,
        max_groups_per_call: int | None = None,
        first_call_groups: int | None = None,
        scoring: Executor | None = None,
        refresh: Refresh | None = None,
    ) -> AsyncIterator[list[Group] | Future]:
        """One group per work item, one engine call at a time: yields each call's groups as soon as they
        are scored (with rollout.agent, each group as soon as its trajectories have ended, so not
        necessarily in the items' order). With `scoring` (an executor of one thread), a call's groups are scored there while the
        engine runs the next call, and each yield is a Future of them. With `refresh` (rollout.partial),
        a call's rows may go on with newer weights (tidal.rollout.partial); each call starts with the
        version the engine then holds."""
        r = self.cfg.rollout
        prompts = [self.prompt(it) for it in items]
        cap = 1 if r.deterministic else max_groups_per_call
        chunks = generation_chunks(
            [len(p) for p in prompts], r.group_size, response_tokens(self.cfg), r.generation_token_budget, cap, first_call_groups
        )
        if self.agent is not None and getattr(self.engine, "joins_running_calls", False) and not r.deterministic and len(chunks) > 1:
            # one running call: a chunk's worth of groups in flight, the next items joining as groups end
            requests = [self.request(it, prompts[i]) for i, it in enumerate(items)]
            version = version if refresh is None else refresh.version
            stream = self.agent_stream(items, requests, version, refresh=refresh, in_flight=max(map(len, chunks)), first=len(chunks[0]))
            async with contextlib.aclosing(stream) as groups_as_they_end:
                async for groups in groups_as_they_end:
                    yield groups if scoring is None else finished(groups)
            return
        for chunk in chunks:
            batch = [items[i] for i in chunk]
            requests = [self.request(it, prompts[i]) for i, it in zip(chunk, batch)]
            if self.agent is not None:  # each group goes out as soon as its trajectories have ended
                version = version if refresh is None else refresh.version
                async with contextlib.aclosing(self.agent_stream(batch, requests, version, refresh=refresh)) as stream:
                    async for groups in stream:
                        yield groups if scoring is None else finished(groups)
                continue
            gen_start = time.time()
            if refresh is None:
                outputs = await self.engine.complete(requests)
            else:
                version = refresh.version
                outputs = await complete_partial(self.engine, requests, r.max_new_tokens, refresh)
            entries = [(it, request.prompt_ids, out, version, gen_start, time.time()) for it, request, out in zip(batch, requests, outputs)]
            score = partial(self.score, entries)
            yield (await asyncio.to_thread(score)) if scoring is None else scoring.submit(score)

    async def group(self, item: WorkItem, version: int, queue: GroupScoringQueue, score_pool: Executor) -> Group:
        """One group, alone in its engine call; scored through `queue` (batched with the groups that
        finish meanwhile), or with rollout.agent on `score_pool`."""
        if self.agent is not None:  # the agent loop renders its prompt
            self.processed_images(item)
            request = self.request(item, [])
            (group,) = await self.agent_groups([item], [request], version, score_pool)
            return group
        request = self.request(item, self.prompt(item))
        gen_start = time.time()
        (completions,) = await self.engine.complete([request], tag=f"{item.iteration}-{item.prompt_id}")
        return await queue.score((item, request.prompt_ids, completions, version, gen_start, time.time()), len(completions))

    async def agent_groups(
        self, items: list[WorkItem], requests: list[GroupRequest], version: int, score_pool: Executor | None = None, refresh: Refresh | None = None
    ) -> list[Group]:
        """`agent_stream`'s groups, all of them, in the items' order."""
        async with contextlib.aclosing(self.agent_stream(items, requests, version, score_pool, refresh)) as stream:
            made = [group async for groups in stream for group in groups]
        return in_item_order(items, made)

    async def agent_stream(
        self,
        items: list[WorkItem],
        requests: list[GroupRequest],
        version: int,
        score_pool: Executor | None = None,
        refresh: Refresh | None = None,
        in_flight: int | None = None,
        first: int | None = None,
    ) -> AsyncIterator[list[Group]]:
        """rollout.agent: the items' trajectories in one engine call, each group scored (on `score_pool`:
        rewards may be slow user code) and yielded as soon as its G trajectories have ended, while the
        call's other rows go on; so a group held by a slow tool call delays only itself. With `in_flight`
        (an engine that `joins_running_calls`), the call starts with `first` groups and the rest join it
        as groups end, at most `in_flight` groups playing at once (continuous batching: the tail of one
        batch of groups overlaps the next). With `refresh` (rollout.partial) a trajectory may go on with
        newer weights: its group's version is the one the engine held when the group started, the oldest
        among its tokens."""
        agent, loop = self.agent, asyncio.get_running_loop()
        group_of = [g for g, request in enumerate(requests) for _ in range(request.n)]
        first_row = [0, *accumulate(r.n for r in requests)]
        rows_left = [r.n for r in requests]
        played: dict[int, tuple] = {}
        ended: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        started = min(first or len(items), in_flight or len(items), len(items))
        feed = RowFeed() if started < len(items) else None
        begun = [(time.time(), version)] * started  # each group's start and the version it started with

        def record(row: int, entry: tuple) -> None:
            played[row] = entry
            rows_left[group_of[row]] -= 1
            if rows_left[group_of[row]]:
                return
            ended.put_nowait((group_of[row], time.time()))
            if feed is not None and not feed.closed:  # room in the call: the next items join it
                room = in_flight - sum(1 for g in range(len(begun)) if rows_left[g])
                joining = range(len(begun), min(len(begun) + room, len(items)))
                now = (time.time(), version if refresh is None else refresh.version)
                begun.extend([now] * len(joining))
                feed.put([(agent.problem(items[g]), requests[g]) for g in joining])
                if len(begun) == len(items):
                    feed.close()

        def row_done(row: int, entry: tuple) -> None:  # on the engine's event loop, another thread's with the blocking vLLM engine
            loop.call_soon_threadsafe(record, row, entry)

        problems = [agent.problem(item) for item in items[:started]]
        play = asyncio.ensure_future(agent.play(self.engine, problems, requests[:started], refresh=refresh, on_done=row_done, feed=feed))
        emitted: set[int] = set()
        try:
            while len(emitted) < len(requests):
                if ended.empty() and not play.done():
                    waiting = asyncio.ensure_future(ended.get())
                    await asyncio.wait({waiting, play}, return_when=asyncio.FIRST_COMPLETED)
                    if waiting.done():
                        ended.put_nowait(waiting.result())
                    else:
                        waiting.cancel()
                ready = []
                while not ended.empty():
                    ready.append(ended.get_nowait())
                if not ready and play.done():  # the call is over; an engine that did not tell of each row as it ended is read here
                    done_at = time.time()
                    played.update(dict(enumerate(play.result())))
                    ready = [(g, done_at) for g in range(len(requests)) if g not in emitted]
                ready = [(g, at) for g, at in ready if g not in emitted]
                emitted.update(g for g, _ in ready)
                if not ready:
                    continue

                def scored(ready=ready) -> list[Group]:
                    return [
                        self.agent_group(
                            items[g],
                            requests[g],
                            [played[row] for row in range(first_row[g], first_row[g] + requests[g].n)],
                            begun[g][1],
                            (begun[g][0], at),
                        )
                        for g, at in ready
                    ]

                yield await loop.run_in_executor(score_pool, scored)
            play.result()
        finally:
            if not play.done():
                play.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await play

    def agent_group(self, item: WorkItem, request: GroupRequest, played: list[tuple], version: int, times: tuple[float, float]) -> Group:
        """One group of finished trajectories, scored."""
        errors_before = self.scorer.errors
        samples, stats = self.agent.scored(played, item, self.scorer)
        for sample, (_, tokens) in zip(samples, played, strict=True):
            sample.versions = mixed_versions(tokens.versions, version)
        errors = self.scorer.errors - errors_before
        failures = self.scorer.ledger.take()
        return self.make_group(item, request.prompt_ids, samples, version, times, errors, env_stats=stats, failures=failures)

    def score(self, entries: list[tuple]) -> list[Group]:
        """Single-turn groups, every sample scored in one `score_many` (served rewards batch across the
        groups). `entries`: (item, prompt, completions, version, generation start, end) per group, of one
        version. The call's scoring seconds, served-reward counts and each reward's calls and failures
        ride on its first group."""
        from tidal.rewards.served import Row

        items, prompts, outputs, versions, starts, ends = zip(*entries, strict=True)
        assert len(set(versions)) == 1, f"groups of versions {sorted(set(versions))} scored together"
        decode = self.tokenizer.decode
        texts = [[decode(c.token_ids, skip_special_tokens=True) for c in completions] for completions in outputs]
        prompt_texts = [decode(p, skip_special_tokens=False) for p in prompts]
        rows = [Row(pt, text, it.answer) for it, pt, group_texts in zip(items, prompt_texts, texts) for text in group_texts]
        prompt_ids = [it.prompt_id for it, group_texts in zip(items, texts) for _ in group_texts]
        scored = iter(self.scorer.score_many(rows, prompt_ids))
        groups = []
        for item, prompt, completions, group_texts, times in zip(items, prompts, outputs, texts, zip(starts, ends), strict=True):
            samples, errors = [], 0
            for c, text in zip(completions, group_texts):
                reward, parts, failed = next(scored)
                errors += failed
                samples.append(completion_sample(c, reward, parts, exact_match(text, item.answer)))
            groups.append(self.make_group(item, prompt, samples, versions[0], times, errors))
        if groups:
            groups[0].reward_stats = self.scorer.take_stats()
            groups[0].failures = self.scorer.ledger.take()  # each reward's calls and failures, for the trainer's count
        return groups

    def make_group(
        self, item: WorkItem, prompt: list[int], samples: list[Sample], version: int, times: tuple[float, float], reward_errors: int, **extra
    ) -> Group:
        """The one place a group is assembled."""
        return Group(
            iteration=item.iteration,
            prompt_id=item.prompt_id,
            policy_version=version,
            worker_id=self.worker_id,
            prompt_ids=np.asarray(prompt, dtype=np.int32),
            samples=samples,
            gen_start=times[0],
            gen_end=times[1],
            reward_errors=reward_errors,
            images=self.images.pop(item.msg_id, None),
            **extra,
        )


class ByPrompt:
    """Values waiting per prompt (iteration, prompt id: a work item's, or the group that answers it),
    handed out first in, first out: groups come out of an agent call in the order they end, not the
    order of their items. `taken`: how many have been handed out."""

    def __init__(self, pairs: Iterable[tuple[WorkItem | Group, object]]):
        self.waiting: dict[tuple[int, int], list] = {}
        for key, value in pairs:
            self.waiting.setdefault((key.iteration, key.prompt_id), []).append(value)
        self.taken = 0

    def take(self, key: WorkItem | Group):
        self.taken += 1
        return self.waiting[(key.iteration, key.prompt_id)].pop(0)


def in_item_order(items: list[WorkItem], groups: list[Group]) -> list[Group]:
    """`groups` (one per item, in any order) in the order of their work items."""
    waiting = ByPrompt((group, group) for group in groups)
    return [waiting.take(item) for item in items]


def mixed_versions(versions: list[int] | None, group_version: int) -> np.ndarray | None:
    """A trajectory's per-token versions as its sample carries them: None (every sampled token the
    group's version) unless some sampled token has another."""
    if versions is None:
        return None
    array = np.asarray(versions, dtype=np.int32)
    sampled = array[array != NO_VERSION]
    return None if not sampled.size or (sampled == group_version).all() else array


def completion_sample(c: Completion, reward: float, parts: dict[str, float], correct: float) -> Sample:
    return Sample(
        token_ids=np.asarray(c.token_ids, dtype=np.int32),
        logprobs=np.asarray(c.logprobs, dtype=np.float32),
        reward=reward,
        finish_reason=c.finish_reason,
        reward_parts=parts,
        correct=correct,
        versions=None if c.versions is None else np.asarray(c.versions, dtype=np.int32),
    )


def generate_groups(
    engine: RolloutEngine,
    tokenizer,
    scorer: RewardScorer,
    items: list[WorkItem],
    cfg: TidalConfig,
    *,
    version: int,
    worker_id: str,
    max_groups_per_call: int | None = None,
    agent: AgentLoop | None = None,
    processor=None,
) -> list[Group]:
    """Generator.calls, blocking, every call's groups in one list (sync mode, planning, benchmarks); call
    it where no event loop runs. With rollout.agent and no `agent`, one is built here and closed after."""
    own = agent is None and cfg.rollout.agent is not None
    generator = (
        Generator.for_worker(cfg, engine, tokenizer, scorer, worker_id)
        if own
        else Generator(cfg, engine, tokenizer, scorer, worker_id, agent, processor)
    )

    async def collect() -> list[Group]:
        made = [group async for call in generator.calls(items, version, max_groups_per_call=max_groups_per_call) for group in call]
        return in_item_order(items, made)

    try:
        return run_blocking(collect())
    finally:
        if own:
            generator.close()

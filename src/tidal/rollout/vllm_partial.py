"""Partial rollouts on vLLM (rollout.partial, bounded mode): a group's request streamed, and stopped for newer weights.

The group's `n=G` request streams its tokens (`RequestOutputKind.DELTA`); after each output the worker's
`interrupt` is asked, and when newer weights wait the request is aborted (its child requests with it)
and each row keeps the tokens and log-probs it has received so far, finish reason INTERRUPTED. The
tokens vLLM sampled after the last output read are dropped with the request: only what was read counts.
tidal.rollout.partial.complete_partial then loads the new version (the arrival path: the weights, the
prefix cache dropped, the probe checked) and resumes each stopped row as a request of its own: a token
prompt of the prompt and the row's tokens so far, n=1, the tokens left, in deterministic mode the seed
`turn_seed(group seed, row, stop)`. Its prefill runs under the new weights, so every later token's
log-prob is the new version's.

A row of a prompt with images resumes with the same image files (one image token each in the prompt,
widened again by vLLM).

Multi-turn calls (rollout.agent) run every row as one request per turn; under rollout.partial each turn's
request streams the same way (`partial_turn`), and `TurnSwaps` loads the new version once no request of
the call is in flight: turns stopped mid-way resume under it, turns about to start wait for it, and a row
between turns (its environment answering) is not held.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tidal.rollout.engine import INTERRUPTED, Completion, GroupRequest, Interrupt, turn_seed
from tidal.rollout.refresh import Refresh
from tidal.rollout.trajectory import Turn


@dataclass
class StreamedRow:
    """One sample of a streamed request: its tokens and log-probs read so far, and how it ended (None: it had not)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, output) -> None:
        """Adds a CompletionOutput's delta (DELTA mode: only its new tokens and their log-probs)."""
        if output.finish_reason is not None and output.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"sample {output.index} finished with {output.finish_reason!r}")
        tokens = list(output.token_ids)
        self.token_ids += tokens
        self.logprobs += [step[token].logprob for step, token in zip(output.logprobs, tokens, strict=True)]
        self.finish_reason = output.finish_reason or self.finish_reason

    def completion(self) -> Completion:
        return Completion(self.token_ids, self.logprobs, self.finish_reason or INTERRUPTED)


def streaming(params):
    """`params` with every step's new tokens returned as they come (a copy: the caller's is left as it was)."""
    from copy import copy

    from vllm.sampling_params import RequestOutputKind

    streamed = copy(params)
    streamed.output_kind = RequestOutputKind.DELTA
    return streamed


async def streamed_group(engine, request: GroupRequest, params, tag: str, interrupt: Interrupt) -> list[Completion]:
    """`request`'s samples on VLLMEngine `engine`, streamed; when `interrupt()` turns True before every row
    has ended, the request is aborted and its unfinished rows end there (finish reason INTERRUPTED)."""
    rows = [StreamedRow() for _ in range(params.n)]
    request_id = f"{tag}-{uuid.uuid4().hex[:8]}"
    prompt = engine._prompt(request.prompt_ids, request.image_files)
    stream = engine.llm.generate(prompt, streaming(params), request_id=request_id, lora_request=engine.lora_request)
    stopped = False
    async with contextlib.aclosing(stream):  # leaving early closes the stream, which aborts the request
        async for out in stream:
            if request.image_files and list(out.prompt_token_ids) != list(request.prompt_ids):
                raise RuntimeError(
                    f"request {tag}: vLLM widened the image tokens to {len(out.prompt_token_ids)} prompt tokens, not {len(request.prompt_ids)}"
                )
            for output in out.outputs:
                rows[output.index].extend(output)
            if out.finished:
                break
            if interrupt():
                stopped = True
                break
    if stopped:
        await engine.llm.abort(request_id)  # by its external id: every child request of the n=G parent
    elif any(row.finish_reason is None for row in rows):
        raise RuntimeError(f"request {tag} ended without every sample finished")
    return [row.completion() for row in rows]


class TurnSwaps:
    """The turns of one multi-turn call on vLLM under rollout.partial: each turn's request streams and stops
    when newer weights wait (`streamed_group`); once none of the call's requests is in flight the weights
    are swapped, once, and every stopped turn goes on under them. A turn that would start while newer
    weights wait, or while they load, starts after: no request runs across a swap, so the version a
    request starts with is the one that samples all its tokens."""

    def __init__(self, refresh: Refresh):
        self.refresh = refresh
        self.streaming = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.swapping: asyncio.Future | None = None

    async def enter(self) -> int:
        """Waits until no newer weights wait and none load; returns the version the request samples with."""
        while True:
            if self.swapping is not None:
                await asyncio.shield(self.swapping)
            elif self.refresh.interrupt():
                await self.idle.wait()
                if self.swapping is None and self.refresh.interrupt():
                    self.swapping = asyncio.ensure_future(self._swap())
            else:
                break
        self.streaming += 1
        self.idle.clear()
        return self.refresh.version

    def leave(self) -> None:
        self.streaming -= 1
        if self.streaming == 0:
            self.idle.set()

    async def _swap(self) -> None:
        try:
            await self.refresh.swap()
        finally:
            self.swapping = None


async def partial_turn(
    engine, swaps: TurnSwaps, request: GroupRequest, params: Callable[[int | None, int], object], max_tokens: int, tag: str
) -> Turn:
    """One turn of one row (`request`: its token prompt, n=1, its seed) under rollout.partial: streamed,
    stopped when newer weights wait, and resumed after the swap as a request of the prompt and the turn's
    tokens so far, with the tokens left (`params(seed, max tokens)`: the sampling; in deterministic mode
    resumption k draws with `turn_seed(seed, 0, k)`). Each token carries the version that sampled it."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    stops = 0
    while True:
        version = await swaps.enter()
        seed = request.seed if request.seed is None or not stops else turn_seed(request.seed, 0, stops)
        try:
            part = replace(request, prompt_ids=[*request.prompt_ids, *tokens])
            (sampled,) = await streamed_group(engine, part, params(seed, max_tokens - len(tokens)), f"{tag}-{stops}", swaps.refresh.interrupt)
        finally:
            swaps.leave()
        tokens += sampled.token_ids
        logprobs += sampled.logprobs
        versions += [version] * len(sampled.token_ids)
        if sampled.finish_reason != INTERRUPTED:
            return Turn(tokens, logprobs, sampled.finish_reason, versions)
        if request.image_files:
            raise ValueError("rollout.partial: a multi-turn row with images cannot resume under new weights yet")
        stops += 1

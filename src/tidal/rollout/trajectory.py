"""One trajectory: its token record, its state, and the turn loops both engines run.

A trajectory is every token after the prompt, sampled or inserted. The loss mask is written where
the tokens are appended: `add_sampled` (a turn the policy sampled: its log-probs, mask 1) and
`add_inserted` (what the environment and the chat template put between turns: log-prob 0, mask 0).
After each sampled turn a `Responder` gives the tokens to insert before the next turn, or None when
the trajectory is over. The kept tokens are the ones sampled and the ones the responder gave, never
a re-tokenisation of decoded text.

The turn loops: `play_rows` runs the rows of one engine call over one decode batch that a row leaves
when its turn ends and joins again when the responder has answered it (the HF engine); `play_row`
runs one row as one request per turn (vLLM: every row its own task). Either way, while one row waits
on its environment the others decode.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tidal.rollout.refresh import Refresh
from tidal.token_versions import NO_VERSION


@dataclass
class Turn:
    """One assistant turn of one row: the tokens sampled and their behaviour log-probs."""

    token_ids: list[int]
    logprobs: list[float]  # under the processed (temperature-scaled) distribution
    finish_reason: str  # "stop" (EOS) or "length"
    versions: list[int] | None = None  # rollout.partial: the policy version that sampled each token


class TrajectoryState(enum.Enum):
    SAMPLING = "sampling"  # its next turn is to be sampled
    ANSWERING = "answering"  # a turn was sampled: the responder decides what follows
    DONE = "done"


@dataclass
class TrajectoryTokens:
    """A trajectory as a sample carries it: every token after the prompt, sampled or inserted."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, on sampled tokens; 0 on inserted ones
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = inserted by the environment or the template
    turns: int = 0
    finish_reason: str = "stop"  # the last turn's (stop, length), or max_turns when the environment wanted more
    state: TrajectoryState = TrajectoryState.SAMPLING
    versions: list[int] | None = None  # rollout.partial: per token, the version that sampled it (NO_VERSION where inserted)

    def add_sampled(self, turn: Turn) -> None:
        """A turn the policy sampled: its tokens and log-probs, mask 1."""
        if turn.versions is not None:
            self.versions = [*(self.versions or []), *turn.versions]
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.loss_mask += [1] * len(turn.token_ids)
        self.turns += 1
        self.finish_reason = turn.finish_reason
        self.state = TrajectoryState.ANSWERING

    def add_inserted(self, tokens: list[int]) -> None:
        """Tokens the environment or the chat template inserted: log-prob 0, mask 0."""
        if self.versions is not None:
            self.versions += [NO_VERSION] * len(tokens)
        self.token_ids += tokens
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.state = TrajectoryState.SAMPLING

    def answered(self, tokens: list[int] | None, last: bool) -> list[int] | None:
        """The responder's answer to the turn just sampled (None: the trajectory is over), inserted and
        returned when another turn follows. After the `last` allowed turn an answer only sets the finish
        reason: the environment wanted more (max_turns)."""
        if tokens is None or last:
            if tokens is not None:
                self.finish_reason = "max_turns"
            self.state = TrajectoryState.DONE
            return None
        self.add_inserted(list(tokens))
        return list(tokens)


class Responder(Protocol):
    """What answers a row's turn: the token ids to insert before its next turn, or None when its
    trajectory is over; on the event loop, while the other rows decode."""

    async def respond(self, row: int, turn: Turn) -> list[int] | None: ...


class RowBatch(Protocol):
    """The rows of one engine call over one decode batch that a row leaves when its turn ends and
    joins again for its next one (the HF engine's hf_rows.HFRows)."""

    @property
    def rows(self) -> list[int]: ...

    @property
    def decoding(self) -> bool: ...

    version: int | None  # rollout.partial: the version stamped on the tokens it samples
    stopped: list[int]  # rows stopped mid-turn for newer weights (decode's interrupt), until reload

    def decode(
        self, max_new_tokens: int, greedy: bool = False, wake: threading.Event | None = None, interrupt: Callable[[], bool] | None = None
    ) -> dict[int, Turn]: ...

    def join(self, inserted: dict[int, list[int]]) -> None: ...

    def reload(self, version: int) -> None: ...

    def drop(self, rows: list[int]) -> None: ...

    def add(self, requests: list) -> list[int]: ...


class RowFeed:
    """Groups that join a running call (continuous batching): whoever feeds the call `put`s entries as it
    sees room; `play_rows` turns them into requests (`prepare`, set by whoever owns the rows' responder:
    the rows must be known to it before they decode) and adds their rows between decode steps, until
    the feed is `close`d. A call with a feed ends only when it is closed and every row has ended."""

    def __init__(self):
        self.waiting: list = []
        self.closed = False
        self.changed = asyncio.Event()
        self.prepare: Callable[[list], list] = lambda entries: entries

    def put(self, entries: list) -> None:
        self.waiting += entries
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()

    def take(self) -> list:
        """The requests of the entries put since the last take (prepared)."""
        entries, self.waiting = self.waiting, []
        self.changed.clear()
        return self.prepare(entries) if entries else []


RowDone = Callable[[int, "TrajectoryTokens"], None]  # a row's trajectory has ended: (row, its tokens), final


async def play_rows(
    batch: RowBatch,
    responder: Responder,
    max_turns: int,
    max_new_tokens: int,
    greedy: bool = False,
    refresh: Refresh | None = None,
    on_done: RowDone | None = None,
    feed: RowFeed | None = None,
) -> list[TrajectoryTokens]:
    """One trajectory per row of `batch`, in row order. The batch decodes (on a thread) until some
    row's turn ends; that row's answer is asked for at once, and the rows whose answers are in join
    the batch again for their next turn while the others decode on. A trajectory that still wants a
    turn after `max_turns` ends there (finish reason max_turns). With `refresh` (rollout.partial),
    newer weights stop the batch between decode steps, are loaded, and every row goes on with them:
    nothing is sampled or asked of an environment again, and each sampled token carries its version.
    `on_done(row, tokens)` is told of each trajectory as it ends, while the others go on. With `feed`,
    more groups' rows join the batch as they are put there (row numbers go on after the batch's), and
    the call ends when the feed is closed and every row has ended."""
    if refresh is not None:
        batch.version = refresh.version
    out = {row: TrajectoryTokens() for row in batch.rows}
    answers: dict[int, list[int] | None] = {}
    wake = threading.Event()  # an answer came in: the decode thread returns at its next step
    tasks: set[asyncio.Task] = set()

    async def answer(row: int, turn: Turn) -> None:
        reply = await responder.respond(row, turn)
        answers[row] = out[row].answered(reply, out[row].turns == max_turns)
        if answers[row] is None and on_done is not None:
            on_done(row, out[row])
        wake.set()

    try:
        while True:
            for task in [t for t in tasks if t.done()]:
                tasks.discard(task)
                task.result()  # a responder that raised: the call fails, as it would on one thread
            if feed is not None and feed.waiting:
                requests = feed.take()
                added = await asyncio.to_thread(batch.add, requests)
                out.update({row: TrajectoryTokens() for row in added})
                continue
            if answers:
                ready = dict(answers)
                answers.clear()
                batch.drop([row for row, tokens in ready.items() if tokens is None])
                going = {row: tokens for row, tokens in ready.items() if tokens is not None}
                if going:
                    await asyncio.to_thread(batch.join, going)
                continue
            if batch.decoding:
                wake.clear()
                ended = await asyncio.to_thread(batch.decode, max_new_tokens, greedy, wake, refresh and refresh.interrupt)
                for row, turn in ended.items():
                    out[row].add_sampled(turn)
                    tasks.add(asyncio.create_task(answer(row, turn)))
                if batch.stopped:  # newer weights wait: loaded here, while no forward runs
                    await asyncio.to_thread(batch.reload, await refresh.swap())
            elif tasks or (feed is not None and not feed.closed):
                waits = set(tasks)
                if feed is not None and not feed.closed:
                    waits.add(asyncio.ensure_future(feed.changed.wait()))
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in waits - tasks:
                    task.cancel()
            else:
                break
    finally:
        for task in tasks:
            task.cancel()
    return [out[row] for row in sorted(out)]


SampleTurn = Callable[[list[int], int], Awaitable[Turn]]


async def play_row(
    sample: SampleTurn, prompt_ids: list[int], row: int, responder: Responder, max_turns: int, on_done: RowDone | None = None
) -> TrajectoryTokens:
    """Row `row`'s trajectory, one request per turn: `sample(token_prompt, turn_index)` samples a turn
    on the prompt and every token so far, exactly as sampled and inserted. `on_done` as play_rows'."""
    out = TrajectoryTokens()
    for turn_index in range(max_turns):
        turn = await sample([*prompt_ids, *out.token_ids], turn_index)
        out.add_sampled(turn)
        if out.answered(await responder.respond(row, turn), turn_index + 1 == max_turns) is None:
            break
    if on_done is not None:
        on_done(row, out)
    return out

"""Multi-turn rollouts: the environment loop of one engine call's groups (rollout.agent).

Every row (one trajectory) gets its own environment instance. The prompt is the environment's
first messages in the chat template (with the tools); after each assistant turn the environment
answers, and the tokens the template renders for that answer (up to and including the next
assistant header) are inserted into the trajectory as token ids, loss mask 0. The sampled tokens
are kept exactly as sampled: the decoded text goes to the environment, never back into the
trajectory. A prompt's images (a vision-language model) are image parts of the first user message, and
the prompt's image tokens are widened to each image's token count as in a single-turn prompt; the
later turns hold text only. A trajectory ends when the environment says done, at rollout.agent.max_turns, when a turn
hits max_new_tokens (it was cut mid-turn), past rollout.agent.trajectory_timeout_seconds (checked between
turns), when it would outgrow the model's context, when a turn or an answer holds an image placeholder token (a vision-language model: no
image stands behind it, and vLLM would take it as one), or when the environment raises (counted, the
worker goes on).

The environment logic (`EnvResponder`, the trajectory.Responder of one engine call) is the same for
both engines, which ask for each row's answer as soon as its turn ends (`respond`: the step on a
thread, so that the other rows keep decoding meanwhile). The HF engine runs a call's rows over one
decode batch that a row leaves while its environment steps; the vLLM engine runs each trajectory as a
request per turn. Both turn loops are in tidal.rollout.trajectory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from jinja2 import TemplateError

from tidal.config import TidalConfig
from tidal.envs import EnvError, Environment, EnvironmentFactory, Trajectory
from tidal.images import ImageInputs
from tidal.protocol import Sample, WorkItem
from tidal.rewards import RewardScorer, checked_reward, exact_match
from tidal.rewards.failures import RewardFailingError
from tidal.rollout.engine import GroupRequest, RolloutEngine
from tidal.rollout.refresh import Refresh
from tidal.rollout.trajectory import RowFeed, TrajectoryTokens, Turn

log = logging.getLogger(__name__)

RENDERS_KEPT = 4096  # AgentLoop.render's cache

# a fixed conversation ending with an assistant turn: what the template renders after that turn's
# end-of-turn token, when observations and the generation prompt follow, is what a trajectory inserts
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

# the conversations the start-up check renders whole: after each one's last assistant turn, the
# template must put exactly what the rule above inserts (reasoning blocks, earlier tool rounds, a
# system prompt and a user reply are where non-append-only templates such as Qwen3's differ)
_THOUGHT_CALL = '<think>\nr\n</think>\n\n<tool_call>\n{"name": "probe", "arguments": {}}\n</tool_call>'
_PROBES = (
    (
        "a first turn with reasoning and a tool call, answered by a tool result",
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": _THOUGHT_CALL}],
        [{"role": "tool", "content": "t"}],
    ),
    (
        "a second turn with reasoning, answered by two tool results",
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": _THOUGHT_CALL},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": _THOUGHT_CALL},
        ],
        [{"role": "tool", "content": "t"}, {"role": "tool", "content": "t2"}],
    ),
    (
        "a turn with reasoning answered by a user message",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": _THOUGHT_CALL},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "<think>\nr\n</think>\n\na"},
        ],
        [{"role": "user", "content": "again"}],
    ),
)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {"type": "object", "properties": {}}}}]


@dataclass
class Problem:
    """What an environment's reset() is given."""

    id: int
    prompt: str
    answer: str


@dataclass
class _Row:
    env: Environment
    messages: list[dict]
    length: int = 0  # tokens of the trajectory so far
    finish_reason: str | None = None  # set when the loop ends the trajectory for a reason of its own
    env_error: str | None = None
    steps: int = 0  # calls of the environment's step() that returned
    truncated_observations: int = 0

    @property
    def final_text(self) -> str:
        return Trajectory(None, self.messages).final_text


def env_method(env: Environment, method: str) -> str:
    """How an environment's method is named in the failure tallies and the end-of-run table."""
    return f"environment {type(env).__qualname__}.{method}()"


def record_steps(ledger, row: _Row) -> None:
    """A trajectory's step() calls into the ledger: the ones that returned, and the one that raised."""
    if row.steps:
        ledger.record(env_method(row.env, "step"), failed=False, calls=row.steps)
    if row.env_error is not None:
        ledger.record(env_method(row.env, "step"), failed=True, error=row.env_error)


class AgentLoop:
    """Runs rollout.agent over a rollout engine and builds the trajectory groups."""

    def __init__(self, cfg: TidalConfig, tokenizer, factory: EnvironmentFactory, chat_template: str | None, context: int | None = None):
        self.cfg, self.tokenizer, self.factory, self.chat_template, self.context = cfg, tokenizer, factory, chat_template, context
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise EnvError("rollout.agent needs a chat template: the tokenizer of model.name_or_path has none")
        self.eos = tokenizer.eos_token_id
        self.template_kwargs = dict(cfg.rollout.agent.chat_template_kwargs) if cfg.rollout.agent else {}
        self._env_pool: ThreadPoolExecutor | None = None
        self._renders: dict[str, list[int]] = {}  # render's, by the conversation's JSON
        # checked now, not at the first tool call mid-run: a tokenizer whose EOS is not the token the
        # template ends a turn with (a base model's <|endoftext|> under a ChatML template) would let
        # every turn run on to max_new_tokens (HF) or end its trajectory on another stop token (vLLM);
        # a template whose rendering after a turn depends on what came before would insert tokens the
        # template does not render there
        self.turn_end(self.render(_BASE, [], False))
        self.check_insertion_rule()

    def env_pool(self) -> ThreadPoolExecutor:
        """The threads environment steps run on (async engines): one per trajectory in flight, so a
        slow tool holds only its own trajectory."""
        if self._env_pool is None:
            r = self.cfg.rollout
            self._env_pool = ThreadPoolExecutor(max_workers=r.max_inflight_groups * r.group_size, thread_name_prefix="tidal-env")
        return self._env_pool

    @classmethod
    def from_config(cls, cfg: TidalConfig, tokenizer, context: int | None = None) -> AgentLoop:
        """The built-in tiny model renders with tidal.model.templates.TOOL_CHAT_TEMPLATE unless its
        tokenizer has a template of its own; any other model with its tokenizer's."""
        from tidal.model.templates import TOOL_CHAT_TEMPLATE

        factory = EnvironmentFactory.from_config(cfg.rollout.agent, tokenizer, cfg.seed)
        own = getattr(tokenizer, "chat_template", None)
        return cls(cfg, tokenizer, factory, None if own or cfg.model.name_or_path is not None else TOOL_CHAT_TEMPLATE, context)

    def close(self) -> None:
        """Stops the tools' process (it would also exit when this process does) and the step threads."""
        self.factory.close()
        if self._env_pool is not None:
            self._env_pool.shutdown(wait=False, cancel_futures=True)
            self._env_pool = None

    # --- the chat template -------------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> list[int]:
        """The conversation's token ids under the chat template. A worker renders the same conversations
        again and again (a prompt for its chunking and for each of its group's rows, the fixed one before
        every tool result), and the template is most of an agent call's Python time: renders are kept,
        by the conversation's JSON, for the last RENDERS_KEPT conversations."""
        key = json.dumps([messages, tools, generation_prompt], sort_keys=True, default=str)
        ids = self._renders.get(key)
        if ids is None:
            if len(self._renders) >= RENDERS_KEPT:
                self._renders.clear()
            ids = self._renders[key] = self._render(messages, tools, generation_prompt)
        return list(ids)

    def _render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> list[int]:
        kwargs = {"chat_template": self.chat_template} if self.chat_template else {}
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
            **kwargs,
            **self.template_kwargs,
        )
        return list(ids)

    def inserted_tokens(self, observations: list[dict], tools: list[dict]) -> list[int]:
        """The tokens the template puts after an assistant turn's end-of-turn token (EOS, sampled)
        when `observations` follow, through the next assistant header (and whatever the generation
        prompt adds after it). Rendered after _BASE's assistant turn and cut at that turn's EOS in the
        same rendering: a template that renders an assistant turn one way when it is last and another
        when messages follow (Qwen3's reasoning block) changes the turn, never what follows its EOS."""
        turn_eos = self.render(_BASE, tools, False).count(self.eos)
        full = self.render([*_BASE, *observations], tools, True)
        ends = [i for i, t in enumerate(full) if t == self.eos]
        if len(ends) < turn_eos:
            raise EnvError(
                "the chat template renders an assistant turn without its EOS token when messages follow it: inserted tokens cannot be told apart"
            )
        return full[ends[turn_eos - 1] + 1 :]

    def check_insertion_rule(self) -> None:
        """Refuses, in one line naming the boundary, a template after whose assistant turns the rendering of
        the next messages is not what `inserted_tokens` gives: the trajectory keeps each sampled turn as
        sampled and inserts those tokens, so it is what the policy saw only when they agree everywhere."""
        for what, history, observations in _PROBES:
            for tools in ([], _PROBE_TOOLS):
                try:
                    whole = self.render([*history, *observations], tools, True)
                except TemplateError:  # a conversation the template refuses (raise_exception) is one no run can have
                    continue
                expected = [self.eos, *self.inserted_tokens(observations, tools)]
                if whole[-len(expected) :] != expected:
                    rendered = self.tokenizer.decode(whole[-len(expected) :], skip_special_tokens=False)
                    inserted = self.tokenizer.decode(expected, skip_special_tokens=False)
                    raise EnvError(
                        f"rollout.agent: the chat template cannot be continued token-exactly: after {what}{' (with tools)' if tools else ''}: "
                        f"it renders {rendered[-160:]!r} where a trajectory would insert {inserted[-160:]!r} (what it puts after an "
                        "assistant turn depends on the turns before it)"
                    )

    def turn_end(self, base: list[int]) -> int:
        """Where the assistant turn of `base` (_BASE rendered) ends: after its last EOS token."""
        ends = [i for i, t in enumerate(base) if t == self.eos]
        if not ends:
            name = getattr(self.tokenizer, "eos_token", None)
            raise EnvError(
                f"the chat template does not end an assistant turn with the tokenizer's EOS token ({name!r}); the engine could not tell "
                "a turn's end: give the tokenizer the template's end-of-turn token as its EOS (an instruct model's tokenizer has it)"
            )
        return ends[-1] + 1

    def fit_observations(self, observations: list[dict], tools: list[dict], row: _Row) -> list[int] | None:
        """The inserted tokens, at most rollout.agent.max_env_tokens_per_turn: the longest observations are
        cut (counted) until they fit; None when the template's own tokens alone do not."""
        return self.fitted_observations(observations, tools, row)[0]

    def fitted_observations(self, observations: list[dict], tools: list[dict], row) -> tuple[list[int] | None, list[dict]]:
        """`fit_observations`, with the observations as cut (`row`: anything with a `truncated_observations` count)."""
        limit = self.cfg.rollout.agent.max_env_tokens_per_turn
        observations = [dict(o) for o in observations]
        for _ in range(len(observations) + 2):
            tokens = self.inserted_tokens(observations, tools)
            over = len(tokens) - limit
            if over <= 0:
                return tokens, observations
            longest = max(range(len(observations)), key=lambda i: len(str(observations[i].get("content", ""))), default=None)
            content = self.tokenizer(str(observations[longest].get("content", "")), add_special_tokens=False).input_ids if longest is not None else []
            if not content:
                return None, observations
            observations[longest]["content"] = self.tokenizer.decode(content[: max(0, len(content) - over - 1)]) + "…"
            row.truncated_observations += 1
        return None, observations

    # --- one engine call ---------------------------------------------------------------------

    async def play(
        self,
        engine: RolloutEngine,
        problems: list[Problem],
        requests: list[GroupRequest],
        greedy: bool = False,
        refresh: Refresh | None = None,
        on_done: Callable[[int, tuple[_Row, TrajectoryTokens]], None] | None = None,
        feed: RowFeed | None = None,
    ) -> list[tuple[_Row, TrajectoryTokens]]:
        """The trajectories of `problems` (request i gives problem i's G rows their RNG and images; its prompt
        is set here): each row's environment and messages, and its tokens, in row order. `refresh`
        (rollout.partial): the rows go on with newer weights published meanwhile. `on_done(row,
        (environment row, tokens))`: told of each trajectory as it ends, on the engine's event loop.
        `feed` (HF engine): more (problem, request) pairs whose rows join the call while it runs."""
        r = self.cfg.rollout
        responder = self.begin(problems, requests, getattr(engine, "processor", None))
        newer = {} if refresh is None else {"refresh": refresh}
        if on_done is not None:
            newer["on_done"] = lambda row, tokens: on_done(row, (responder.rows[row], tokens))
        if feed is not None:

            def joining(pairs: list[tuple[Problem, GroupRequest]]) -> list[GroupRequest]:
                joined = [request for _, request in pairs]
                responder.extend([problem for problem, _ in pairs], joined)
                return joined

            feed.prepare = joining
            newer["feed"] = feed
        trajectories = await engine.play(requests, responder, r.agent.max_turns, r.max_new_tokens, greedy, **newer)
        return list(zip(responder.rows, trajectories))

    def begin(self, problems: list[Problem], requests: list[GroupRequest], processor=None) -> EnvResponder:
        """One environment per row (G per problem, in order), and each request's prompt: the first messages,
        rendered, with the request's images (`processor`: the vision-language model's, which processes them
        when the request does not carry them processed already)."""
        responder = EnvResponder(self, placeholder_ids(processor), processor)
        responder.extend(problems, requests)
        return responder

    def group_rows(self, problem: Problem, request: GroupRequest, processor=None) -> list[_Row]:
        """One problem's G rows, each with its environment, and its request's prompt set: their first
        messages rendered (every row's must render alike: a group shares its prompt)."""
        images = len(request.image_files or ())
        rows = [self.start_row(problem, images) for _ in range(request.n)]
        encoded = [self.render(row.messages, row.env.tool_schemas, True) for row in rows]
        if any(e != encoded[0] for e in encoded[1:]):
            raise EnvError(
                f"environment {self.factory.cls.__qualname__}: reset() gave different first messages for one problem; a group shares its prompt"
            )
        if images:
            if processor is None:
                raise EnvError(f"problem {problem.id} has images but the model is not a vision-language model (no image processor)")
            if request.images is None:
                request.images = processor.process_images(list(request.image_files))
            encoded[0] = widened_image_tokens(processor, encoded[0], request.images, images)
        request.prompt_ids = encoded[0]
        return rows

    def scored(self, played: list[tuple[_Row, TrajectoryTokens]], item: WorkItem, scorer: RewardScorer) -> tuple[list[Sample], dict[str, float]]:
        """One group's finished trajectories as scored samples, and the group's environment counts."""
        samples: list[Sample] = []
        stats: dict[str, float] = {}
        for row, tokens in played:
            finish = row.finish_reason or tokens.finish_reason
            trajectory = Trajectory(self.problem(item), row.messages, row.env.stats, finish)
            reward, parts = self.reward(row.env, trajectory, item, scorer)
            samples.append(
                Sample(
                    token_ids=np.asarray(tokens.token_ids, dtype=np.int32),
                    logprobs=np.asarray(tokens.logprobs, dtype=np.float32),
                    reward=reward,
                    finish_reason=finish,
                    reward_parts=parts,
                    correct=exact_match(trajectory.final_text, item.answer),
                    loss_mask=np.asarray(tokens.loss_mask, dtype=np.uint8),
                )
            )
            add_stats(stats, row, tokens.turns)
            record_steps(scorer.ledger, row)
        return samples, stats

    def first_prompt(self, item: WorkItem, processor=None, images: ImageInputs | None = None) -> list[int]:
        """The prompt tokens of `item`'s trajectories (one environment's first messages, rendered); with images,
        `processor` widens their image tokens to `images` (the item's, processed)."""
        count = len(item.images or ())
        row = self.start_row(self.problem(item), count)
        ids = self.render(row.messages, row.env.tool_schemas, True)
        return widened_image_tokens(processor, ids, images, count) if count else ids

    def problem(self, item: WorkItem) -> Problem:
        return self.framed(item.prompt_id, item.prompt, item.answer)

    def framed(self, prompt_id: int, prompt: str, answer: str) -> Problem:
        """A dataset problem as reset() gets it: the prompt through data.prompt_template."""
        return Problem(prompt_id, self.cfg.data.prompt_template.format(prompt=prompt), answer)

    def start_row(self, problem: Problem, images: int = 0) -> _Row:
        """A row's environment and first messages; `images` image parts go before the first user message's text."""
        env = self.factory()
        messages = list(env.reset(problem))
        system = self.cfg.data.system_prompt
        if system is not None and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        return _Row(env, with_images(messages, images, type(env).__qualname__) if images else messages)

    def reward(self, env: Environment, trajectory: Trajectory, item: WorkItem, scorer: RewardScorer) -> tuple[float, dict[str, float]]:
        """The environment's reward (a dict: named parts, summed), or else reward.functions on the
        final answer. An environment whose reward raises or is not a number scores 0, counted."""
        try:
            value: Any = env.reward(trajectory)
            if value is None:
                scorer.ledger.record(env_method(env, "reward"), failed=False)
                return scorer.score(trajectory.final_text, item.answer, item.prompt_id, item.prompt)
            if isinstance(value, dict):
                parts = {str(k): checked_reward(v) for k, v in value.items()}
                scorer.ledger.record(env_method(env, "reward"), failed=False)
                return sum(parts.values()), parts
            result = checked_reward(value), {"env": checked_reward(value)}
            scorer.ledger.record(env_method(env, "reward"), failed=False)
            return result
        except RewardFailingError:  # reward.functions failing too often: the run stops
            raise
        except Exception as err:  # noqa: BLE001 - user code: never let it take the worker down
            scorer.errors += 1
            scorer.last_error = f"environment reward: {type(err).__name__}: {err}"
            scorer.ledger.record(env_method(env, "reward"), failed=True, error=f"{type(err).__name__}: {err}")
            log.warning("environment %s reward() failed: %s (prompt %s; scored 0)", type(env).__qualname__, scorer.last_error, item.prompt_id)
            return 0.0, {}


def with_images(messages: list[dict], images: int, env_name: str) -> list[dict]:
    """`messages` with `images` image parts before the first user message's text (where a single-turn chat
    prompt has them); the messages given are not changed."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            content = m.get("content")
            parts = list(content) if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
            return [*messages[:i], {**m, "content": [{"type": "image"}] * images + parts}, *messages[i + 1 :]]
    raise EnvError(f"environment {env_name}: reset() gave no user message to hold the problem's {images} image(s)")


def widened_image_tokens(processor, ids: list[int], images: ImageInputs, count: int) -> list[int]:
    """A rendered prompt's image tokens, one per image, widened to each image's token count."""
    rendered = sum(1 for t in ids if t == processor.image_token_id)
    if rendered != count:
        raise EnvError(f"the chat template rendered {rendered} image tokens for the first messages' {count} image(s): it must render each image part")
    return processor.expand_image_tokens(ids, images)


def placeholder_ids(processor) -> frozenset[int]:
    """The tokens a vision-language model's prompt takes as image (or video) placeholders; none for a language model."""
    if processor is None:
        return frozenset()
    tokenizer = processor.tokenizer
    video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return frozenset({processor.image_token_id} | ({video} if isinstance(video, int) and video != tokenizer.unk_token_id else set()))


class EnvResponder:
    """The rows of one engine call and their environments, answering their turns (trajectory.Responder):
    the token ids to insert before a row's next turn, or None when its trajectory is over."""

    def __init__(self, agent: AgentLoop, placeholders: frozenset[int] = frozenset(), processor=None):
        self.agent, self.processor = agent, processor
        self.rows: list[_Row] = []
        self.prompt_lengths: list[int] = []
        self.started: list[float] = []  # each row's start: trajectory_timeout_seconds counts from it
        # a vision-language model's image placeholders: in a later turn's prompt no image stands behind them
        self.placeholders = placeholders

    def extend(self, problems: list[Problem], requests: list[GroupRequest]) -> None:
        """Rows for more problems (G each, after the rows already here), each request's prompt set."""
        for problem, request in zip(problems, requests, strict=True):
            self.rows += self.agent.group_rows(problem, request, self.processor)
            self.prompt_lengths += [len(request.prompt_ids)] * request.n
            self.started += [time.monotonic()] * request.n

    async def respond(self, index: int, turn: Turn) -> list[int] | None:
        """One row's answer, its environment step on a thread: the other rows decode meanwhile."""
        text = self.read(index, turn)
        if text is None:
            return None
        outcome = await asyncio.get_running_loop().run_in_executor(self.agent.env_pool(), self.step, index, text)
        return self.answer(index, outcome)

    def read(self, index: int, turn: Turn) -> str | None:
        """The turn as text, added to the row's messages; None when the trajectory ends before its step."""
        row = self.rows[index]
        row.length += len(turn.token_ids)
        text = self.agent.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        row.messages.append({"role": "assistant", "content": text})
        if turn.finish_reason != "stop":
            return None  # cut off mid-turn: what it meant to call is unknown
        if self.placeholders.intersection(turn.token_ids):
            row.finish_reason = "image_token"
            return None
        if turn.token_ids[-1] != self.agent.eos:
            # vLLM also stops on the generation config's other end tokens; the template's rendering of
            # what follows (inserted_tokens) starts after the tokenizer's EOS only
            row.finish_reason = "stop_token"
            return None
        if time.monotonic() - self.started[index] > self.agent.cfg.rollout.agent.trajectory_timeout_seconds:
            row.finish_reason = "timeout"
            return None
        return text

    def step(self, index: int, text: str) -> tuple[list[dict], bool] | None:
        """The environment's answer to the turn; None when it raised."""
        row = self.rows[index]
        try:
            outcome = row.env.step(text)
            row.steps += 1
            return outcome
        except Exception as err:  # noqa: BLE001 - user code: the trajectory ends, the worker goes on
            row.finish_reason, row.env_error = "env_error", f"{type(err).__name__}: {err}"
            log.warning("environment %s raised in step(): %s", self.agent.factory.cls.__qualname__, row.env_error)
            return None

    def answer(self, index: int, outcome: tuple[list[dict], bool] | None) -> list[int] | None:
        """The tokens that insert the environment's observations, if the trajectory goes on."""
        if outcome is None:
            return None
        observations, done = outcome
        if done:
            return None
        row, agent = self.rows[index], self.agent
        row.messages += observations
        tokens = agent.fit_observations(observations, row.env.tool_schemas, row)
        if tokens is None:
            row.finish_reason = "env_tokens"
            return None
        if self.placeholders.intersection(tokens):
            row.finish_reason = "image_token"
            return None
        if agent.context is not None and self.prompt_lengths[index] + row.length + len(tokens) + agent.cfg.rollout.max_new_tokens > agent.context:
            row.finish_reason = "context"
            return None
        row.length += len(tokens)
        return tokens


STAT_KEYS = (
    "trajectories",
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "tool_crashes",
    "tool_outputs_cut",
    "malformed_calls",
    "unparsable_turns",
    "refused_calls",
    "tool_using",
    "env_errors",
    "truncated_observations",
    "env_seconds",
)


def add_stats(stats: dict[str, float], row: _Row, turns: int) -> None:
    """A group's environment counts, summed over its trajectories (the trainer's metrics divide)."""
    s = row.env.stats
    values = {
        "trajectories": 1,
        "turns": turns,
        "tool_calls": s.tool_calls,
        "tool_errors": s.tool_errors,
        "tool_timeouts": s.tool_timeouts,
        "tool_crashes": s.tool_crashes,
        "tool_outputs_cut": s.tool_outputs_cut,
        "malformed_calls": s.malformed_calls,
        "unparsable_turns": s.unparsable_turns,
        "refused_calls": s.refused_calls,
        "tool_using": int(s.tool_calls + s.malformed_calls + s.refused_calls > 0),
        "env_errors": int(row.env_error is not None),
        "truncated_observations": row.truncated_observations,
        "env_seconds": s.env_seconds,
    }
    for k in STAT_KEYS:
        stats[k] = stats.get(k, 0.0) + float(values[k])

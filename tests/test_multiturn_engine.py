"""The HF engine continues a trajectory after inserted tokens on its KV cache: the behaviour
log-probs of the sampled tokens equal the trainer's forward over the assembled trajectory, nothing
before the inserted tokens is computed again, and the tokens kept are the tokens sampled."""

from __future__ import annotations

import asyncio
import copy
import time

import numpy as np
import pytest
import torch

from tests.conftest import eos_prone
from tidal.algo import token_logprobs_from_logits
from tidal.blocking import run_blocking
from tidal.config import TinyModelConfig, TrainerConfig
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import Group, GroupLimits, Sample, decode_group, pack
from tidal.rollout.decode_step import DecodeStep
from tidal.rollout.engine import GroupRequest, HFEngine, group_generator
from tidal.rollout.trajectory import RowFeed, Turn
from tidal.trainer.learner import Learner, as_packing_group, token_logprobs

MAX_NEW_TOKENS = 7


def tiny(eos_logit: float = 2.5):
    """The tiny model with an untied output layer whose EOS bias ends turns at different steps."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok).eval()
    return eos_prone(model, tok, eos_logit), tok


class ScriptedEnvironment:
    """Answers turn t of row r with a token string of its own length (unequal across rows), or with
    nothing for `silent` rows (the next turn follows the last at once), ends some rows early, and
    records what it saw."""

    def __init__(self, tok, ends_after: dict[int, int], silent: frozenset[int] = frozenset()):
        self.tok, self.ends_after, self.silent, self.seen = tok, ends_after, silent, {}

    def inserted(self, row: int, t: int) -> list[int]:
        return [] if row in self.silent else self.tok(f"<r{row}t{t}>" + "=" * (row % 3), add_special_tokens=False).input_ids

    def answer(self, row: int, turn: Turn) -> list[int] | None:
        self.seen.setdefault(row, []).append(turn)
        t = len(self.seen[row])
        if t >= self.ends_after.get(row, 99):
            return None
        return self.inserted(row, t)

    async def respond(self, row: int, turn: Turn) -> list[int] | None:  # the HF engine's turn loop asks this
        return self.answer(row, turn)


class EndsEveryTrajectory:
    """A responder that ends each trajectory after its first turn."""

    async def respond(self, row: int, turn: Turn) -> None:
        return None


def requests(tok, seed: int = 0):
    prompts = [tok(t).input_ids for t in ("12+3=", "45+678=", "9-1000+20=")]
    return [GroupRequest(p, n, group_generator(seed, 1, i)) for i, (p, n) in enumerate(zip(prompts, (3, 2, 4)))]


def trained_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs_from_logits(logits, ids[:, len(prompt) :], temperature)[0][0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_the_trainers_forward_over_the_assembled_trajectory(temperature):
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS, temperature)
    reqs = requests(tok)
    env = ScriptedEnvironment(tok, ends_after={0: 1, 3: 2, 6: 2}, silent=frozenset({1, 4, 7, 8}))
    trajectories = engine.play_blocking(reqs, env, max_turns=3)
    prompts = [r.prompt_ids for r in reqs for _ in range(r.n)]
    assert len(trajectories) == len(prompts) == 9
    assert {t.turns for t in trajectories} == {1, 2, 3} and {t.finish_reason for t in trajectories} >= {"stop", "max_turns"}
    lengths = [len(turn.token_ids) for turns in env.seen.values() for turn in turns]
    assert min(lengths) < MAX_NEW_TOKENS and max(lengths) == MAX_NEW_TOKENS  # turns ended at different steps: rows waited
    for row, (prompt, t) in enumerate(zip(prompts, trajectories)):
        mask = np.array(t.loss_mask, dtype=bool)
        assert len(t.token_ids) == len(t.logprobs) == mask.size and (~mask).any() == (t.turns > 1 and row not in env.silent)
        # the tokens kept are the ones sampled and the ones the environment gave, as given
        expected = []
        for k, turn in enumerate(env.seen[row]):
            expected += turn.token_ids
            if k + 1 < t.turns:
                expected += env.inserted(row, k + 1)
        assert t.token_ids == expected
        ref = trained_logprobs(model, prompt, t.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(t.logprobs)[mask], ref[torch.from_numpy(mask)], atol=1e-4, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask) if not m)


def test_the_trainer_sees_the_engines_logprobs_on_every_sampled_token():
    """Through the wire and the shared-prompt packed layout: the learner's log-probs of a group of
    trajectories match the engine's (its engine-vs-trainer mismatch metric is ~0)."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    req = requests(tok)[2]
    trajectories = engine.play_blocking([req], ScriptedEnvironment(tok, ends_after={1: 2}), max_turns=3)
    samples = [
        Sample(np.asarray(t.token_ids, np.int32), np.asarray(t.logprobs, np.float32), float(i % 2), loss_mask=np.asarray(t.loss_mask, np.uint8))
        for i, t in enumerate(trajectories)
    ]
    limits = GroupLimits(vocab_size=len(tok), max_new_tokens=MAX_NEW_TOKENS, max_turns=3, max_env_tokens_per_turn=16)
    group = decode_group(pack(Group(0, 0, 0, "w", np.asarray(req.prompt_ids, np.int32), samples)), limits)
    with torch.no_grad():
        out = token_logprobs(model, [as_packing_group(group)], 1.0, "segmented", "cpu")[0]
    for i, t in enumerate(trajectories):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert torch.equal(out.loss_mask[i, : mask.numel()], mask)
        torch.testing.assert_close(out.logprobs[i, : mask.numel()][mask], torch.tensor(t.logprobs)[mask], atol=1e-4, rtol=0)
    learner = Learner(TrainerConfig(), copy.deepcopy(model), tok.pad_token_id, max_new_tokens=MAX_NEW_TOKENS)
    learner.train_on_groups([group])
    assert learner.step()["logprob_mismatch"] < 1e-5


def test_inserted_tokens_extend_the_cache_without_recomputing_the_prefix():
    """After the prefill, every forward pass takes one token per row (a decode step) or the rows
    joining again, each with its last sampled token and its inserted tokens: never the prompt or an
    earlier turn again, and each turn boundary of each row once."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    reqs = requests(tok)
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        env = ScriptedEnvironment(tok, ends_after={})
        trajectories = engine.play_blocking(reqs, env, max_turns=3)
    finally:
        hook.remove()
    longest_insert = max(len(tok(f"<r{r}t2>" + "=" * (r % 3), add_special_tokens=False).input_ids) for r in range(9))
    assert widths[0] == (3, max(len(r.prompt_ids) for r in reqs))  # the prompts, once
    later = [w for _, w in widths[1:]]
    assert set(later) <= {1, *range(2, longest_insert + 2)} and max(later) == longest_insert + 1
    assert max(later) < min(len(r.prompt_ids) for r in reqs) + MAX_NEW_TOKENS  # no forward over a prefix
    assert sum(rows for rows, w in widths[1:] if w > 1) == 9 * 2  # each row's two turn boundaries, once each
    assert all(t.turns == 3 for t in trajectories)


def test_rows_joining_with_inserted_tokens_of_very_different_lengths_are_prefilled_apart(monkeypatch):
    """Rows joining together, some after 2 inserted tokens and some after 40, are prefilled in two forwards
    (the short ones not padded to 40), and each row's next turn samples with the log-probs of the trainer's
    forward over its whole trajectory."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    reqs = requests(tok)
    rows = engine.start(reqs, max_turns=2)
    first = {}
    while rows.decoding:
        first.update(rows.decode(MAX_NEW_TOKENS))
    short, long = tok("ab", add_special_tokens=False).input_ids, tok("x" * 40, add_special_tokens=False).input_ids
    inserted = {row: long if row % 3 == 0 else short for row in first}
    prefills = []
    join_logits = DecodeStep.join_logits  # the engine's own forward takes the joins of a model it covers
    monkeypatch.setattr(DecodeStep, "join_logits", lambda self, ids, *a: prefills.append(tuple(ids.shape)) or join_logits(self, ids, *a))
    rows.join(inserted)
    assert sorted(prefills, key=lambda shape: shape[1]) == [(6, len(short) + 1), (3, len(long) + 1)]
    second = {}
    while rows.decoding:
        second.update(rows.decode(MAX_NEW_TOKENS))
    prompts = [r.prompt_ids for r in reqs for _ in range(r.n)]
    for row, prompt in enumerate(prompts):
        tokens = [*first[row].token_ids, *inserted[row], *second[row].token_ids]
        ref = trained_logprobs(model, prompt, tokens, 1.0)[-len(second[row].token_ids) :]
        torch.testing.assert_close(torch.tensor(second[row].logprobs), ref, atol=1e-4, rtol=0)


def test_one_turn_is_the_single_turn_engine():
    """A trajectory the environment ends after its first turn is `generate`'s sample: the same tokens, and
    log-probs equal up to float rounding (the two paths run forward passes of other shapes, and a CPU
    kernel's summation order may follow the shape and the thread count)."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    single = [s for group in engine.generate(requests(tok, seed=4)) for s in group]
    trajectories = engine.play_blocking(requests(tok, seed=4), EndsEveryTrajectory(), max_turns=3)
    assert [t.token_ids for t in trajectories] == [s.token_ids for s in single]
    for t, s in zip(trajectories, single, strict=True):
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)
    assert all(t.loss_mask == [1] * len(t.token_ids) and t.turns == 1 for t in trajectories)
    assert [t.finish_reason for t in trajectories] == [s.finish_reason for s in single]


def test_trajectories_are_a_function_of_the_seed():
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    runs = [engine.play_blocking(requests(tok, seed=9), ScriptedEnvironment(tok, ends_after={2: 2}), max_turns=3) for _ in range(2)]
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]
    other = engine.play_blocking(requests(tok, seed=10), ScriptedEnvironment(tok, ends_after={2: 2}), max_turns=3)
    assert [t.token_ids for t in other] != [t.token_ids for t in runs[0]]


class SlowFirstCall(ScriptedEnvironment):
    """Row `slow`'s first answer is a blocking call that sleeps 5 s on a thread (as a tool call does);
    every other answer is instant. Records, in order, when each trajectory ended and when the slow
    call returned."""

    def __init__(self, tok, slow: int):
        super().__init__(tok, ends_after={})
        self.slow, self.events = slow, []

    async def respond(self, row: int, turn: Turn) -> list[int] | None:
        if row == self.slow and row not in self.seen:
            await asyncio.to_thread(time.sleep, 5)
            self.events.append(("slow call returned", row))
        tokens = self.answer(row, turn)
        if len(self.seen[row]) == 3:  # max_turns: the trajectory is over
            self.events.append(("trajectory done", row))
        return tokens


def test_a_slow_tool_call_holds_only_its_own_trajectory():
    """No turn barrier: while one row's first tool call sleeps, every other row plays all its turns."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    env = SlowFirstCall(tok, slow=4)
    trajectories = engine.play_blocking(requests(tok), env, max_turns=3)
    assert all(t.turns == 3 for t in trajectories)
    returned = env.events.index(("slow call returned", 4))
    done_before = {row for kind, row in env.events[:returned] if kind == "trajectory done"}
    assert done_before == set(range(9)) - {4}
    assert env.events[returned + 1 :] == [("trajectory done", 4)]


class Scheduled(ScriptedEnvironment):
    """Answers at once; with `odd_last`, the odd rows' answers only once every even row's trajectory
    is over; with `barrier`, each turn's answers only once every row still going has ended that turn
    (the old lockstep engine's schedule)."""

    def __init__(self, tok, odd_last: bool = False, barrier: bool = False):
        super().__init__(tok, ends_after={0: 1, 3: 2, 6: 2})
        self.odd_last, self.barrier = odd_last, barrier
        self.waiting: dict[int, list[tuple[int, asyncio.Future]]] = {}
        self.going = set(range(9))
        self.evens_done: asyncio.Event | None = None

    async def respond(self, row: int, turn: Turn) -> list[int] | None:
        t = len(self.seen.get(row, []))
        self.evens_done = self.evens_done or asyncio.Event()
        if self.odd_last and row % 2:
            await self.evens_done.wait()
        if self.barrier:
            ready = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(t, []).append((row, ready))
            if {r for r, _ in self.waiting[t]} == self.going:
                for _row, f in self.waiting.pop(t):
                    f.set_result(None)
            await ready
        tokens = self.answer(row, turn)
        if tokens is None or len(self.seen[row]) == 3:
            self.going.discard(row)
            if not any(r % 2 == 0 for r in self.going):
                self.evens_done.set()
        return tokens


def test_trajectories_do_not_depend_on_which_rows_share_a_decode_step():
    """Deterministic sampling: the same group played in lockstep (every row's turn waits for the
    others'), free-running, and with the odd rows answered only once the even rows are done gives the same tokens,
    and log-probs equal up to float rounding (forward passes of other batch shapes)."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    runs, shapes = [], []
    for env in (Scheduled(tok, barrier=True), Scheduled(tok), Scheduled(tok, odd_last=True)):
        shapes.append([])
        hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes[-1].append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            runs.append(engine.play_blocking(requests(tok, seed=5), env, max_turns=3))
        finally:
            hook.remove()
    assert len({tuple(s) for s in shapes}) == 3  # three schedules: the rows shared their forward passes differently
    reference = runs[0]
    assert {t.turns for t in reference} == {1, 2, 3}
    for run in runs[1:]:
        assert [t.token_ids for t in run] == [t.token_ids for t in reference]
        assert [t.loss_mask for t in run] == [t.loss_mask for t in reference]
        for t, r in zip(run, reference, strict=True):
            torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


class SameForEveryRow:
    """Answers every turn with the same tokens whichever row asks (so a row plays alike whatever number
    it has in its call), and records, in order, each answer as (row, turn)."""

    def __init__(self, tok):
        self.tokens = tok("<ok>", add_special_tokens=False).input_ids
        self.answered: list[tuple[int, int]] = []
        self.turns: dict[int, int] = {}

    async def respond(self, row: int, turn: Turn) -> list[int]:
        self.turns[row] = self.turns.get(row, 0) + 1
        self.answered.append((row, self.turns[row]))
        return self.tokens


def test_groups_fed_to_a_running_call_join_its_decode_batch_and_play_as_they_would_alone():
    """Continuous batching: the call starts with the first group; the other two are fed to it when its
    first trajectory ends, join the rows still playing (the first group's last turns and the fed rows'
    first turns interleave), and every trajectory is the one its group plays alone (same tokens; log-probs
    up to the rounding of other batch shapes)."""
    model, tok = tiny()
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, MAX_NEW_TOKENS)
    alone = []
    for request in requests(tok, seed=3):
        alone += engine.play_blocking([request], SameForEveryRow(tok), max_turns=3)
    grouped = requests(tok, seed=3)
    env, feed = SameForEveryRow(tok), RowFeed()

    def first_done(row: int, tokens) -> None:
        if not feed.closed:
            feed.put(grouped[1:])
            feed.close()

    together = run_blocking(engine.play(grouped[:1], env, 3, on_done=first_done, feed=feed))
    assert [t.token_ids for t in together] == [t.token_ids for t in alone]
    for t, a in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    first_fed = min(i for i, (row, _) in enumerate(env.answered) if row >= 3)
    assert any(row < 3 for row, _ in env.answered[first_fed:])  # a first-group row still played after the fed rows began

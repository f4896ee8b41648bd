"""The iteration object and what its plan admits: what becomes of each group, the order of receiving and
training (taking turns, or receiving beside a training call), what counts as idle, the receive a failed
iteration leaves, and iteration v+1 opening as soon as its weights are published. Real plans and groups;
the sources are played in this process, and the learner is real where the test steps and publishes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.protocol import Group, Sample, WorkItem
from tidal.roles import build_learner
from tidal.rundir import RunDir, latest_checkpoint
from tidal.trainer import iteration as iteration_module
from tidal.trainer.distributed import DistContext
from tidal.trainer.iteration import Iteration, LoopContext
from tidal.trainer.iteration_plan import Admission, IterationPlan, StalenessError
from tidal.trainer.sources import Arrivals, InProcessSource
from tidal.trainer.writer import BoundaryWriter
from tidal.weights import WeightStore

RECEIVE_SECONDS = 0.05  # how long each played receive waits for its groups
TRAIN_CALL_SECONDS = 0.3  # how long each training call of the recording learner takes: far longer than a receive


def group(item: WorkItem, rewards=(0.0, 1.0, 0.0, 1.0), policy_version: int | None = None) -> Group:
    samples = [Sample(np.array([7, 8], dtype=np.int32), np.array([-0.5, -0.5], dtype=np.float32), r) for r in rewards]
    version = item.iteration if policy_version is None else policy_version
    return Group(item.iteration, item.prompt_id, version, "w", np.array([5, 6], dtype=np.int32), samples)


def test_admit_trains_the_first_answer_to_an_expected_prompt_and_discards_every_other(tiny_config):
    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    plan, first = IterationPlan.for_iteration(tiny_config, dataset, 0)
    assert plan.admit(group(first[0]), 0) == (Admission.TRAIN, None)
    assert plan.admit(group(first[0]), 0) == (Admission.DISCARD, None)  # a duplicate
    assert plan.admit(group(WorkItem(1, first[1].prompt_id, "", "")), 0) == (Admission.DISCARD, None)  # another iteration's
    assert plan.admit(group(WorkItem(0, plan.spare[0].id, "", "")), 0) == (Admission.DISCARD, None)  # a prompt not asked for
    assert (plan.discarded, plan.missing) == (3, len(first) - 1)


def test_admit_replaces_a_group_without_signal_while_the_budget_lasts(tiny_config):
    tiny_config.trainer.dynamic_sampling = True
    tiny_config.trainer.max_replacements = 1
    plan, first = IterationPlan.for_iteration(tiny_config, load_dataset(tiny_config.data, tiny_config.seed), 0)
    spare = plan.spare[0]
    admission, replacement = plan.admit(group(first[0], rewards=(1.0,) * 4), 0)
    assert admission is Admission.REPLACE and (replacement.iteration, replacement.prompt_id) == (0, spare.id)
    assert spare.id in plan.expected and first[0].prompt_id not in plan.expected and plan.filtered == 1
    assert plan.admit(group(first[1], rewards=(1.0,) * 4), 0) == (Admission.TRAIN, None)  # the budget is spent


def test_admit_fails_on_a_group_older_than_the_mode_allows(tiny_config):
    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    plan, first = IterationPlan.for_iteration(tiny_config, dataset, 1)
    with pytest.raises(StalenessError, match="staleness 1, allowed 0"):
        plan.admit(group(first[0], policy_version=0), 0)
    assert plan.admit(group(first[0], policy_version=0), 1) == (Admission.TRAIN, None)


class PlayedSource:
    """Answers the items asked for, `per_receive` at a time, each receive RECEIVE_SECONDS after it
    starts, and at most `answers` of them; with none left to answer, a receive waits until it is cancelled."""

    def __init__(self, per_receive: int, events: list, receives_while_training: bool, generates_on_receive: bool = False, answers: int = 1000):
        self.per_receive, self.events, self.answers = per_receive, events, answers
        self.receives_while_training, self.generates_on_receive = receives_while_training, generates_on_receive
        self.items: list[WorkItem] = []
        self.cancelled = 0

    async def begin_iteration(self, version: int) -> tuple[float, bool]:
        return 0.0, False

    async def request(self, items: list[WorkItem]) -> None:
        self.items += items

    async def reissue(self, items) -> None:
        self.items += [item for item, _ in items]

    async def receive(self, version: int, wanted: int, timeout: float) -> Arrivals:
        if not self.items or self.answers == 0:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        await asyncio.sleep(RECEIVE_SECONDS)
        take = min(self.per_receive, self.answers)
        answered, self.items, self.answers = self.items[:take], self.items[take:], self.answers - take
        self.events.append("received")
        return Arrivals(groups=[group(item) for item in answered])

    async def commit(self, version: int) -> None:
        pass

    async def queue_depth(self) -> int:
        return 0

    async def finish(self, next_version: int) -> None:
        pass

    async def describe_generators(self) -> str:
        return ""


class RecordingLearner:
    """Records each training call (it takes TRAIN_CALL_SECONDS), and fails it when told to."""

    ctx = DistContext()

    def __init__(self, events: list, fail: bool = False):
        self.events, self.fail, self.calls = events, fail, []

    def begin_iteration(self, version: int) -> None:
        pass

    def train_on_groups(self, groups: list[Group]) -> None:
        self.calls.append([g.prompt_id for g in groups])
        time.sleep(TRAIN_CALL_SECONDS)
        if self.fail:
            raise RuntimeError("the training call failed")
        self.events.append("trained")


def collect_one(cfg, source, learner) -> Iteration:
    async def scenario() -> Iteration:
        run = LoopContext.start(cfg, learner, source, load_dataset(cfg.data, cfg.seed), None, None, None, 1)
        iteration = await Iteration.open(run, 0)
        await iteration.collect()
        return iteration

    return asyncio.run(scenario())


def test_without_overlap_receiving_and_training_take_turns_and_every_wait_is_idle(tiny_config):
    events: list[str] = []
    half = tiny_config.trainer.prompts_per_iteration // 2
    learner = RecordingLearner(events)
    iteration = collect_one(tiny_config, PlayedSource(half, events, receives_while_training=False), learner)
    assert events == ["received", "trained", "received", "trained"] and [len(c) for c in learner.calls] == [half, half]
    assert 2 * RECEIVE_SECONDS <= iteration.timer["idle"] < TRAIN_CALL_SECONDS  # the two receives, never a training call
    assert len(iteration.records) == 2 * half and iteration.trained == 2 * half


def test_a_receive_that_generates_in_this_process_is_not_idle_time(tiny_config):
    events: list[str] = []
    source = PlayedSource(tiny_config.trainer.prompts_per_iteration, events, receives_while_training=False, generates_on_receive=True)
    iteration = collect_one(tiny_config, source, RecordingLearner(events))
    assert events == ["received", "trained"] and iteration.timer["idle"] == 0.0


def test_with_overlap_the_next_groups_are_received_while_the_learner_trains(tiny_config):
    events: list[str] = []
    half = tiny_config.trainer.prompts_per_iteration // 2
    learner = RecordingLearner(events)
    iteration = collect_one(tiny_config, PlayedSource(half, events, receives_while_training=True), learner)
    assert events == ["received", "received", "trained", "trained"]  # the second half came in during the first call
    assert [len(c) for c in learner.calls] == [half, half]
    assert RECEIVE_SECONDS <= iteration.timer["idle"] < 2 * RECEIVE_SECONDS + TRAIN_CALL_SECONDS / 3  # only the first receive
    assert iteration.timer["train"] >= 2 * TRAIN_CALL_SECONDS


def test_a_receive_in_flight_when_the_iteration_fails_is_cancelled(tiny_config):
    events: list[str] = []
    prompts = tiny_config.trainer.prompts_per_iteration
    source = PlayedSource(prompts, events, receives_while_training=True, answers=prompts - 1)
    cancelled_on_failure = []

    async def scenario() -> None:
        run = LoopContext.start(
            tiny_config, RecordingLearner(events, fail=True), source, load_dataset(tiny_config.data, tiny_config.seed), None, None, None, 1
        )
        iteration = await Iteration.open(run, 0)
        try:
            await iteration.collect()
        finally:
            await asyncio.sleep(0)  # a cancelled task ends at its next turn (asyncio.run would cancel it later anyway)
            cancelled_on_failure.append(source.cancelled)

    with pytest.raises(RuntimeError, match="the training call failed"):
        asyncio.run(scenario())
    assert cancelled_on_failure == [1]  # the receive for the last group, pending beside the failed call


def test_the_next_iteration_opens_once_its_weights_are_published_and_before_the_last_is_made_durable(tmp_path, tiny_config, monkeypatch):
    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    base = prepare_base_model(tiny_config, dataset)
    learner, _ = build_learner(tiny_config, str(base))
    store, files = WeightStore(tmp_path / "w", base), RunDir(tmp_path)
    events: list = []

    class WatchedSource(InProcessSource):
        async def begin_iteration(self, version: int) -> tuple[float, bool]:
            events.append(("open", version, store.latest_version()))
            return await super().begin_iteration(version)

        async def commit(self, version: int) -> None:
            events.append(("commit", version, (tmp_path / "groups.jsonl").exists()))

    snapshot = iteration_module.optimizer_snapshot
    monkeypatch.setattr(iteration_module, "optimizer_snapshot", lambda learner: events.append("snapshot") or snapshot(learner))

    async def scenario() -> tuple[Iteration, Iteration, Iteration | None]:
        source = WatchedSource(lambda items, version: [group(item) for item in items])
        run = LoopContext.start(tiny_config, learner, source, dataset, store, files, None, 2)
        run.writer = BoundaryWriter(background=False)  # each boundary written when handed over: its place in the order shows
        first = await Iteration.open(run, 0)
        await first.collect()
        second = await first.close()
        await second.collect()
        return first, second, await second.close()

    first, second, after_the_last = asyncio.run(scenario())
    # weights 1 published, then iteration 1 opened, and only then iteration 0's snapshot, records, checkpoint and acks
    assert events == [("open", 0, None), ("open", 1, 1), "snapshot", ("commit", 0, True), "snapshot", ("commit", 1, True)]
    assert (second.version, after_the_last, latest_checkpoint(files.checkpoint).next_version) == (1, None, 2)
    assert first.metrics()["iteration"] == 0 and first.metrics()["samples"] == tiny_config.trainer.prompts_per_iteration * 4

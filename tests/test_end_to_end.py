"""`tidal run` as a user runs it: real nats-server, real MLflow store, real model passes."""

import asyncio
import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import background_run, embedded_nats_url, read_jsonl, run_and_kill, run_cli, start_run, trained_in, wait_until
from tidal.tracking import mlflow_metric_name

REQUIRED_METRICS = [
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length_mean",
    "response_length_max",
    "response_length_p50",
    "response_length_p99",
    "generation_tail_seconds",
    "policy_loss",
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "learning_rate",
    "generated_tokens_per_s",
    "trained_tokens_per_s",
    "samples_per_s",
    "iteration_seconds",
    "generate_seconds",
    "train_seconds",
    "sync_seconds",
    "trainer_idle_seconds",
    "rollout_idle_seconds",
    "queue_depth",
    "staleness_max",
    "reward_errors",
    "groups_filtered",
    "logprob_mismatch",
    "tis_truncated_fraction",
    "messages_rejected",
    "staleness_mean",
    "zero_advantage_group_fraction",
    "pass_at_group_size",
    "response_length_correct_mean",
    "response_length_incorrect_mean",
    "pipeline_efficiency",
    "generation_tail_seconds",
]
SUMMARY_KEYS = [
    "mode",
    "iterations",
    "accuracy_before",
    "accuracy_after",
    "sampled_accuracy_before",
    "sampled_accuracy_after",
    "iteration_seconds_mean",
    "generate_seconds_mean",
    "train_seconds_mean",
    "sync_seconds_mean",
    "idle_seconds_mean",
    "staleness_max",
    "groups_generated",
    "groups_trained",
    "groups_discarded",
    "final_weights",
    "mlflow_run_id",
]


@pytest.fixture(scope="module")
def periodic_run(tmp_path_factory, tiny_config_dict):
    """One periodic run shared by the assertions below; one reward function always raises."""
    import copy

    import yaml

    data = copy.deepcopy(tiny_config_dict)
    # slow_exact_match (weight 0) makes an engine call last ~0.4 s, so the trainer's overlap with
    # generation is a property of the pipeline, not of how fast the tiny model happens to generate
    functions = [{"name": "exact_match"}, {"name": "tests.test_data_rewards:broken_reward", "weight": 0.5}]
    # broken_reward raises on every sample: max_error_rate 1 trains on regardless (it is logged and counted)
    data["reward"] = {"functions": [*functions, {"name": "tests.rewards:slow_exact_match", "weight": 0.0}], "max_error_rate": 1.0}
    # The barely warm-started model solves nothing: every group has all-equal rewards, so DAPO
    # dynamic sampling replaces exactly `max_replacements` groups per iteration, then accepts.
    data["trainer"].update({"dynamic_sampling": True, "max_replacements": 2})
    root = tmp_path_factory.mktemp("periodic")
    (root / "config.yaml").write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(root / "config.yaml"), "--run-dir", str(root / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run", proc


def test_summary_has_every_field_and_staleness_zero(periodic_run):
    run_dir, proc = periodic_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["mode"] == "periodic" and summary["iterations"] == 3
    assert summary["staleness_max"] == 0
    # staleness alone cannot see workers running other weights; the log-prob mismatch can (HF engine: ~0)
    mismatches = [m["logprob_mismatch"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert summary["logprob_mismatch_max"] == max(mismatches) < 1e-3
    assert f"log-prob mismatch max {summary['logprob_mismatch_max']:.2g}" in proc.stdout
    assert summary["groups_trained"] == 3 * 6
    assert summary["groups_filtered"] == 3 * 2
    assert summary["groups_generated"] == summary["groups_trained"] + summary["groups_filtered"] + summary["groups_discarded"]
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert 0.0 <= summary["sampled_accuracy_before"] <= 1.0 and 0.0 <= summary["sampled_accuracy_after"] <= 1.0
    assert Path(summary["final_weights"]).name == "v000003" and (Path(summary["final_weights"]) / "manifest.json").is_file()
    assert "held-out accuracy" in proc.stdout and "generate" in proc.stdout and "weight-sync" in proc.stdout


def test_every_metric_is_in_mlflow_for_every_iteration(periodic_run):
    run_dir, _ = periodic_run
    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.iterations"] == "3" and run.data.params["mode"] == "periodic"
    for name in REQUIRED_METRICS:
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, mlflow_metric_name(name)))
        assert steps == [0, 1, 2], name
    staleness = client.get_metric_history(run.info.run_id, "rollout/staleness_max")
    assert all(m.value == 0 for m in staleness)


def test_a_raising_reward_function_is_logged_and_counted(periodic_run):
    run_dir, proc = periodic_run
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward_errors"] == (6 + 2) * 4 for m in metrics)  # every sample generated, every iteration
    assert "broken_reward raised RuntimeError: user bug" in (run_dir / "logs" / "worker-0.log").read_text()
    # named in the end-of-run table with every call failed, and the run still exits 0: max_error_rate 1 tolerates it
    broken, calls = "tests.test_data_rewards:broken_reward", 3 * (6 + 2) * 4
    assert json.loads((run_dir / "summary.json").read_text())["failures"][broken] == [calls, calls, "RuntimeError: user bug"]
    assert f"{broken}: {calls} of {calls} calls failed; first: RuntimeError: user bug" in proc.stdout


def test_trainer_starts_before_the_last_group_of_the_iteration_is_generated(periodic_run):
    run_dir, _ = periodic_run
    records = [json.loads(l) for l in (run_dir / "groups.jsonl").read_text().splitlines()]
    for v in range(3):
        groups = [r for r in records if r["iteration"] == v]
        assert len(groups) == 6 and all(r["policy_version"] == v for r in groups)
        if v == 0:
            continue  # iteration 0 also holds the trainer's own start-up, which a loaded machine can stretch past generation
        first_train = min(r["train_start"] for r in groups)
        last_generated = max(r["gen_end"] for r in groups)
        assert first_train < last_generated, f"iteration {v}: no overlap"


def test_sync_periodic_and_bounded_k0_give_the_same_weights(tmp_path, write_config):
    """The on-policy equivalence claim, through the one loop: with deterministic rollouts, sync,
    periodic and bounded with max_staleness 0 make the same update."""
    config = write_config(
        {
            "rollout.deterministic": True,
            "trainer.iterations": 2,
            "eval.enabled": False,
            "reward.functions": [{"name": "exact_match"}, {"name": "tests.rewards:digit_count", "weight": 0.1}],
        }
    )
    finals = {}
    for mode in ("sync", "periodic", "bounded"):
        proc = run_cli(
            "run", str(config), "--run-dir", str(tmp_path / mode), "--set", f"mode={mode}", "--set", "rollout.max_staleness=0", "--no-progress"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        finals[mode] = load_file(str(tmp_path / mode / "weights" / "v000002" / "model.safetensors"))
    start = load_file(str(tmp_path / "sync" / "weights" / "v000000" / "model.safetensors"))
    moved = max((finals["sync"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4  # the check means something: training changed the weights
    for name, tensor in finals["sync"].items():
        torch.testing.assert_close(finals["periodic"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(finals["bounded"][name], finals["periodic"][name], atol=1e-5, rtol=1e-4, msg=name)


def test_bad_config_is_a_clear_error(write_config):
    config = write_config({"trainer.iteratons": 3})
    proc = run_cli("run", str(config), "--run-dir", str(config.parent / "run"))
    assert proc.returncode == 2
    assert "trainer.iteratons: unknown key" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_dataset_file_is_a_clear_error(write_config):
    config = write_config({"data.task": "jsonl", "data.path": "/nonexistent/train.jsonl"})
    proc = run_cli("run", str(config), "--run-dir", str(config.parent / "run"))
    assert proc.returncode == 2
    assert "dataset file not found: /nonexistent/train.jsonl" in proc.stderr and "Traceback" not in proc.stderr


def test_periodic_trainer_fails_loudly_on_a_stale_group(tmp_path, tiny_config, nats_server):
    """A group from another policy version must never be trained on in periodic mode."""
    import numpy as np

    from tidal.data import load_dataset, prompts_for_iteration
    from tidal.demo.warm_start import prepare_base_model
    from tidal.protocol import Group, Sample
    from tidal.roles import build_learner, group_limits
    from tidal.rundir import RunDir
    from tidal.trainer.loop import StalenessError, train
    from tidal.trainer.sources import QueueSource
    from tidal.transport import Transport
    from tidal.weights import WeightStore

    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    base = prepare_base_model(tiny_config, dataset)
    learner, _ = build_learner(tiny_config, str(base))
    store = WeightStore(tmp_path / "w", base)

    class NoTracker:
        def log(self, metrics, step):
            pass

    async def scenario():
        transport = await Transport.connect(nats_server.url, "stale", tiny_config.transport)
        problem = prompts_for_iteration(dataset, tiny_config.seed, 1, tiny_config.trainer.prompts_per_iteration)[0]
        sample = Sample(np.array([7], dtype=np.int32), np.array([-0.5], dtype=np.float32), 1.0)
        # iteration 1 generated by version 0: one version stale
        await transport.publish_group(Group(1, problem.id, 0, "rogue", np.array([5, 6], dtype=np.int32), [sample] * 4))
        source = QueueSource(transport, group_limits(tiny_config, learner, transport.max_message_bytes), lambda v: str(store.path(v)))
        files = RunDir(tmp_path)
        from tidal.trainer.checkpoint import save_checkpoint

        save_checkpoint(files, learner, 1)  # resume at iteration 1
        store.publish(1, learner.model.state_dict())
        try:
            with pytest.raises(StalenessError, match="generated by version 0 \\(staleness 1, allowed 0\\)"):
                await train(tiny_config, learner, source, dataset, store, files, NoTracker(), iterations=1)
        finally:
            await transport.close()

    asyncio.run(scenario())


def test_a_rejected_group_of_an_expected_prompt_is_asked_for_again_and_the_iteration_completes(tmp_path, tiny_config, nats_server):
    """a worker's group that fails validation (here a token id outside the vocabulary)
    is terminated, counted, and its prompt's work item goes out again under a new message id, so
    the iteration neither hangs nor trains on it. The test plays the worker; NATS, the trainer
    loop and the learner are real."""
    import numpy as np

    from tidal.data import load_dataset
    from tidal.demo.warm_start import prepare_base_model
    from tidal.protocol import Group, Sample, decode_work_item
    from tidal.roles import build_learner, group_limits
    from tidal.rundir import RunDir
    from tidal.trainer.loop import train
    from tidal.trainer.sources import QueueSource
    from tidal.transport import Transport
    from tidal.weights import WeightStore

    dataset = load_dataset(tiny_config.data, tiny_config.seed)
    base = prepare_base_model(tiny_config, dataset)
    learner, _ = build_learner(tiny_config, str(base))
    store = WeightStore(tmp_path / "w", base)
    vocab = learner.model.config.vocab_size
    seen: list[int] = []

    async def play_the_worker(transport: Transport) -> None:
        sub = await transport.work_subscription()
        while True:
            for m in await transport.fetch(sub, 8, timeout=0.5):
                item = decode_work_item(m.data)
                seen.append(item.prompt_id)
                token = vocab + 5 if seen.count(item.prompt_id) == 1 and item.prompt_id == seen[0] else 7
                sample = Sample(np.array([token], dtype=np.int32), np.array([-0.5], dtype=np.float32), float(len(seen) % 2))
                group = Group(item.iteration, item.prompt_id, 0, "w", np.array([5, 6], dtype=np.int32), [sample] * 4)
                await transport.publish_group(group, answering=m)  # message ids as a rollout worker's
                await m.ack()

    async def scenario():
        transport = await Transport.connect(nats_server.url, "reissue", tiny_config.transport)
        worker = asyncio.create_task(play_the_worker(transport))
        try:
            source = QueueSource(transport, group_limits(tiny_config, learner, transport.max_message_bytes), lambda v: str(store.path(v)))
            return await asyncio.wait_for(train(tiny_config, learner, source, dataset, store, RunDir(tmp_path), None, iterations=1), 120)
        finally:
            worker.cancel()
            await transport.close()

    (metrics,) = asyncio.run(scenario())
    first = seen[0]
    assert seen.count(first) == 2 and len(seen) == tiny_config.trainer.prompts_per_iteration + 1  # only the rejected one again
    assert metrics["messages_rejected"] == 1 and metrics["samples"] == tiny_config.trainer.prompts_per_iteration * 4


def test_a_killed_rollout_worker_loses_no_group(tmp_path, write_config):
    """SIGKILL a worker mid-iteration: its unacked work is redelivered, the launcher restarts it,
    and every group of every iteration is trained exactly once."""
    config = write_config({"transport.ack_wait_seconds": 2.0, "trainer.iterations": 2, "eval.enabled": False, "rollout.groups_per_batch": 1})
    run_dir = tmp_path / "run"
    proc = run_and_kill(config, run_dir, "worker-0.pid", when=lambda run_dir: trained_in(run_dir, 0))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run_dir / "groups.jsonl")
    keys = [(r["iteration"], r["prompt_id"]) for r in records]
    assert len(keys) == len(set(keys)) == 2 * 6
    assert "restarting" in (run_dir / "logs" / "launcher.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["groups_trained"] == 12 and summary["staleness_max"] == 0


def test_the_single_strategy_on_several_ranks_is_a_clear_error(write_config):
    config = write_config({"trainer.strategy": "single"})
    (config.parent / "run").mkdir()
    (config.parent / "run" / "run.json").write_text(json.dumps({"run_id": "x", "base_model": "m", "tracking_uri": "", "mlflow_run_id": ""}))
    proc = run_cli("train", str(config), "--run-dir", str(config.parent / "run"), "--nats-url", "nats://127.0.0.1:1", env={"WORLD_SIZE": "4"})
    assert proc.returncode == 2
    assert "trainer.strategy 'single' cannot run on 4 ranks: use 'fsdp2'" in proc.stderr and "Traceback" not in proc.stderr


def test_sync_mode_dynamic_sampling_replaces_groups_without_signal(tmp_path, write_config):
    config = write_config(
        {"mode": "sync", "trainer.iterations": 2, "trainer.dynamic_sampling": True, "trainer.max_replacements": 2, "eval.enabled": False}
    )
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the barely warm-started model solves nothing: every group is all-zero, so the cap is hit
    assert summary["groups_filtered"] == 2 * 2 and summary["groups_trained"] == 2 * 6
    assert summary["groups_generated"] == 2 * (6 + 2)


# a group at a time with a slow reward: a kill lands in the middle of an iteration
SLOW_GROUP_AT_A_TIME = {
    "transport.ack_wait_seconds": 2.0,
    "eval.enabled": False,
    "rollout.groups_per_batch": 1,
    "reward.functions": [{"name": "tests.rewards:slow_exact_match"}],
}


def test_a_killed_trainer_resumes_and_loses_no_group(tmp_path, write_config):
    """SIGKILL the trainer mid-iteration: groups are acked only after the step, so the restarted
    trainer gets the interrupted iteration's groups again and resumes from the last checkpoint."""
    config = write_config(SLOW_GROUP_AT_A_TIME)
    run_dir = tmp_path / "run"
    proc = run_and_kill(config, run_dir, "trainer.pid", when=lambda run_dir: trained_in(run_dir, 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert all(m["samples"] == 6 * 4 and m["staleness_max"] == 0 for m in metrics)
    # iteration 1 was interrupted after some of its groups were trained, then trained again in full:
    # groups.jsonl records each trained group once (it used to repeat the interrupted ones)
    records = read_jsonl(run_dir / "groups.jsonl")
    keys = [(r["iteration"], r["prompt_id"]) for r in records]
    assert len(keys) == len(set(keys)) == 3 * 6
    assert "restarting from the last checkpoint" in (run_dir / "logs" / "launcher.log").read_text()
    assert "resumed from checkpoint: version 1" in (run_dir / "logs" / "trainer.log").read_text()


def test_workers_that_left_on_a_dying_trainers_failed_state_are_started_again(tmp_path, write_config):
    """A trainer rank whose peer dies sees an error in a collective and records "failed" before torchrun
    ends it; the workers exit on that state. The launcher reopens the run with the restarted trainer and
    starts the workers again (it once restarted the trainer alone, which then waited for ever)."""
    import os
    import signal

    from tidal.config import load_config
    from tidal.rundir import RunDir
    from tidal.transport import RunNats

    config = write_config(SLOW_GROUP_AT_A_TIME)
    run_dir = tmp_path / "run"
    with background_run(config, run_dir) as proc:
        wait_until(lambda: trained_in(run_dir, 1), proc)
        run = RunDir(run_dir)
        # what the dying trainer rank writes, with the run's own credentials
        token = {"token": (run_dir / "nats-token").read_text()}
        RunNats(run, embedded_nats_url(run_dir), load_config(config).transport, token).record_run_state("failed")
        wait_until(lambda: "the run or round is over" in run.log("worker-0").read_text(), proc)
        os.kill(int(run.pid_file("trainer").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert [m["iteration"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]
    keys = [(r["iteration"], r["prompt_id"]) for r in read_jsonl(run_dir / "groups.jsonl")]
    assert len(keys) == len(set(keys)) == 3 * 6
    assert "exited on the interrupted trainer's run state; starting it again" in (run_dir / "logs" / "launcher.log").read_text()


def test_forged_and_malformed_groups_are_rejected_and_counted_and_the_run_finishes(tmp_path, write_config):
    """Bad messages injected into the ROLLOUTS stream mid-run: each is terminated, counted in
    messages_rejected and logged with its reason; none is trained on and the run completes."""
    import math
    import time

    import msgpack
    import nats
    import numpy as np

    from tidal.protocol import Group, Sample, pack
    from tidal.rundir import RunDir
    from tidal.transport import stream_names

    config = write_config({"eval.enabled": False, "reward.functions": [{"name": "tests.rewards:slow_exact_match"}]})
    run_dir = tmp_path / "run"
    proc = start_run(config, run_dir)
    groups_file = run_dir / "groups.jsonl"
    deadline = time.time() + 600
    while not (groups_file.is_file() and groups_file.read_text().strip()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]

    def sample(tokens, reward=1.0, logprob=-0.5):
        t = np.asarray(tokens, dtype=np.int32)
        return Sample(t, np.full(t.size, logprob, dtype=np.float32), reward)

    def forged(**kw):
        fields = dict(
            iteration=0, prompt_id=0, policy_version=0, worker_id="rogue", prompt_ids=np.array([5, 6], dtype=np.int32), samples=[sample([7])] * 4
        )
        return pack(Group(**{**fields, **kw}))

    bad = [
        b"\xc1 not msgpack",
        msgpack.packb({"iteration": 0, "prompt_id": 3}),  # missing fields
        forged(samples=[sample([7, 10**6])] * 4),  # a token id outside the vocabulary: once crashed the embedding lookup
        forged(samples=[sample([7], reward=math.nan)] * 4),
        forged(samples=[sample([7], logprob=-math.inf)] * 4),
        forged(samples=[sample(range(1, 40))] * 4),  # more than max_new_tokens
        forged(iteration=50, policy_version=50),  # a version from the future
        forged(samples=[sample([7])] * 3),  # not group_size samples
    ]

    async def inject():
        info = RunDir(run_dir).info()
        nc = await nats.connect(embedded_nats_url(run_dir), token=(run_dir / "nats-token").read_text())  # the run's own credentials
        js = nc.jetstream()
        for i, payload in enumerate(bad):
            await js.publish(stream_names(info.run_id)["rollouts_subject"], payload, headers={"Nats-Msg-Id": f"forged-{i}"})
        await nc.close()

    asyncio.run(inject())
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["messages_rejected"] == len(bad)
    assert summary["groups_trained"] == 3 * 6 and summary["iterations"] == 3
    records = [json.loads(l) for l in groups_file.read_text().splitlines()]
    assert len({(r["iteration"], r["prompt_id"]) for r in records}) == len(records) == 3 * 6
    assert all(r["worker_id"] != "rogue" for r in records)
    log = (run_dir / "logs" / "trainer.log").read_text()
    for reason in (
        "not a msgpack message",
        "missing field",
        "outside the vocabulary",
        "reward is not finite",
        "logprobs: not finite",
        "more than max_new_tokens",
        "from the future",
        "expected group_size",
    ):
        assert reason in log, reason
    assert "rejected a message on tidal." in log
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["messages_rejected"] for m in metrics) == len(bad) and metrics[-1]["messages_rejected_total"] == len(bad)


def test_bounded_mode_trains_stale_groups_within_the_bound_and_records_the_histogram(tmp_path, write_config):
    config = write_config({"mode": "bounded", "rollout.max_staleness": 2, "trainer.iterations": 4, "eval.enabled": False})
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "bounded" and summary["groups_trained"] == 4 * 6 and summary["staleness_max"] <= 2
    records = [json.loads(l) for l in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert len({(r["iteration"], r["prompt_id"]) for r in records}) == len(records) == 4 * 6
    assert all(0 <= r["trained_version"] - r["policy_version"] <= 2 for r in records)
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        fractions = [m[f"staleness_fraction_{s}"] for s in range(3)]
        assert abs(sum(fractions) - 1.0) < 1e-9
        stale = [r for r in records if r["iteration"] == m["iteration"] and r["policy_version"] < r["iteration"]]
        assert m["staleness_fraction_0"] == pytest.approx(1.0 - len(stale) / 6)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    history = client.get_metric_history(summary["mlflow_run_id"], "rollout/staleness_fraction_1")
    assert sorted(h.step for h in history) == [0, 1, 2, 3]


def test_a_finished_run_directory_can_be_extended(tmp_path, write_config):
    """Re-running a run directory whose state says "done" (more iterations asked for) must not
    start workers that read the old state and exit: the trainer would wait for groups forever."""
    config = write_config({"trainer.iterations": 2, "eval.enabled": False, "trainer.group_timeout_seconds": 60})
    run_dir = tmp_path / "run"
    assert run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress").returncode == 0
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.iterations=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert "run state was done" in (run_dir / "logs" / "launcher.log").read_text()


def test_weight_retention_keeps_what_workers_and_a_resume_need(tmp_path, write_config):
    """weights.keep_last=1 on a real run: the store holds only the final version and the one before it (a
    worker may still be loading it), and extending the run resumes from the checkpoint's snapshot."""
    from tidal.weights import WeightStore

    config = write_config({"weights.keep_last": 1, "eval.enabled": False, "trainer.group_timeout_seconds": 60})
    run_dir = tmp_path / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = WeightStore(run_dir / "weights")
    assert store.versions() == [2, 3] and store.latest_version() == 3
    assert "weight retention: deleted snapshot(s) v0" in (run_dir / "logs" / "trainer.log").read_text()
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.iterations=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from checkpoint: version 3" in (run_dir / "logs" / "trainer.log").read_text()
    assert store.versions() == [3, 4]


def test_a_restarted_trainer_forgets_the_records_of_iterations_it_redoes(tmp_path):
    """metrics.jsonl is appended before the background writer makes the boundary durable: a trainer
    stopped in between leaves a line for an iteration it redoes, which must not appear twice."""
    from tidal.rundir import RunDir
    from tidal.trainer.loop import forget_unfinished
    from tidal.weights import WeightStore

    files = RunDir(tmp_path)
    files.checkpoint.mkdir()
    for v in range(3):
        files.metrics.append({"iteration": v})
        files.groups.append_many([{"iteration": v, "prompt_id": p} for p in range(2)])
    forget_unfinished(files, WeightStore(tmp_path / "weights"), start=1)
    assert [m["iteration"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [0]
    assert [(r["iteration"], r["prompt_id"]) for r in read_jsonl(tmp_path / "groups.jsonl")] == [(0, 0), (0, 1)]

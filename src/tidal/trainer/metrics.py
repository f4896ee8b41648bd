"""What an iteration reports: a timer for its phases, its metrics line and one record per trained group."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import numpy as np

from tidal.protocol import Group, tool_use_rates
from tidal.token_versions import token_staleness


class Timer:
    """Seconds per named phase: `with timer("train"): ...` adds the block's wall time to `timer["train"]`."""

    def __init__(self) -> None:
        self.start = time.time()
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def __getitem__(self, phase: str) -> float:
        return self.seconds.get(phase, 0.0)

    def elapsed(self) -> float:
        return time.time() - self.start


def generation_span(groups: list[Group]) -> float:
    """From the first group's generation start to the last one's end: the iteration's generate time."""
    if not groups:
        return 0.0
    return max(g.gen_end for g in groups) - min(g.gen_start for g in groups)


def group_stats(groups: list[Group]) -> dict[str, float]:
    """Reward/accuracy/length statistics over every sample of an iteration."""
    rewards = np.array([s.reward for g in groups for s in g.samples], dtype=np.float64)
    correct = np.array([s.correct for g in groups for s in g.samples], dtype=np.float64)
    lengths = np.array([len(s.token_ids) for g in groups for s in g.samples], dtype=np.float64)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(correct.mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "response_length_p50": float(np.percentile(lengths, 50)),
        "response_length_p99": float(np.percentile(lengths, 99)),
        "generated_tokens": float(lengths.sum()),
        "samples": float(len(rewards)),
        "reward_errors": float(sum(g.reward_errors for g in groups)),
        **learning_diagnostics(groups),
        **agent_stats(groups),
        **scoring_stats(groups),
    }


def scoring_stats(groups: list[Group]) -> dict[str, float]:
    """Seconds the workers spent scoring (beside generation: a worker scores one engine call's groups
    while the engine runs the next), and for served rewards the requests, their mean batch (samples
    per request), retries, requests failed after their retries and seconds spent in requests."""
    totals: dict[str, float] = {"reward_seconds": 0.0}
    for g in groups:
        for k, v in (g.reward_stats or {}).items():
            totals[k] = totals.get(k, 0.0) + v
    if totals.get("reward_server_requests"):
        totals["reward_server_batch_size_mean"] = totals["reward_server_samples"] / totals["reward_server_requests"]
    return totals


def agent_stats(groups: list[Group]) -> dict[str, float]:
    """Multi-turn rollouts (groups that carry environment counts): turns and tool calls per
    trajectory, the share of tool calls that failed (ran and failed, unreadable, or over the limit),
    the isolated tool calls that timed out or crashed their process and the results cut to size,
    the environment's seconds, the share of trajectory tokens the environment and template inserted
    (not trained on), and trajectory length percentiles. Nothing for single-turn iterations."""
    agent = [g for g in groups if g.env_stats]
    if not agent:
        return {}
    totals: dict[str, float] = {}
    for g in agent:
        for k, v in g.env_stats.items():
            totals[k] = totals.get(k, 0.0) + v
    trajectories = max(1.0, totals.get("trajectories", 0.0))
    rates = tool_use_rates(totals)
    lengths = np.array([len(s.token_ids) for g in agent for s in g.samples], dtype=np.float64)
    sampled = float(sum(s.sampled_tokens for g in agent for s in g.samples))
    return {
        "agent_turns_mean": rates["turns_mean"],
        "agent_tool_calls_mean": totals.get("tool_calls", 0.0) / trajectories,
        "agent_tool_use_rate": rates["tool_use_rate"],
        "agent_tool_error_rate": rates["tool_error_rate"],
        "agent_tool_timeouts": totals.get("tool_timeouts", 0.0),
        "agent_tool_crashes": totals.get("tool_crashes", 0.0),
        "agent_tool_outputs_cut": totals.get("tool_outputs_cut", 0.0),
        "agent_unparsable_turns": totals.get("unparsable_turns", 0.0),
        "agent_env_errors": totals.get("env_errors", 0.0),
        "agent_truncated_observations": totals.get("truncated_observations", 0.0),
        "agent_env_seconds": totals.get("env_seconds", 0.0),
        "agent_masked_token_fraction": 1.0 - sampled / lengths.sum() if lengths.sum() else 0.0,
        "agent_trajectory_length_p50": float(np.percentile(lengths, 50)),
        "agent_trajectory_length_p90": float(np.percentile(lengths, 90)),
        "agent_trajectory_length_max": float(lengths.max()),
    }


def learning_diagnostics(groups: list[Group]) -> dict[str, float]:
    """What a user checks first when a run does not learn: how many groups carry no signal (all
    rewards equal: zero advantage), how often G samples find the answer at all (pass@G on the
    training prompts), and whether correct answers are shorter or longer than wrong ones."""
    no_signal = [len(set(g.rewards)) == 1 for g in groups]
    solved = [any(s.correct > 0 for s in g.samples) for g in groups]
    right = [len(s.token_ids) for g in groups for s in g.samples if s.correct > 0]
    wrong = [len(s.token_ids) for g in groups for s in g.samples if s.correct <= 0]
    return {
        "zero_advantage_group_fraction": float(np.mean(no_signal)),
        "pass_at_group_size": float(np.mean(solved)),
        "response_length_correct_mean": float(np.mean(right)) if right else 0.0,
        "response_length_incorrect_mean": float(np.mean(wrong)) if wrong else 0.0,
    }


def staleness_stats(groups: list[Group], version: int, max_staleness: int) -> dict[str, float]:
    """Staleness (version trained minus version that generated) of the iteration's groups: max,
    mean, and the fraction of groups at each staleness 0..max_staleness (a histogram per iteration)."""
    staleness = np.array([version - g.policy_version for g in groups], dtype=np.float64)
    out = {"staleness_max": float(staleness.max()), "staleness_mean": float(staleness.mean())}
    for s in range(max_staleness + 1):
        out[f"staleness_fraction_{s}"] = float((staleness == s).mean())
    return out


def token_staleness_stats(groups: list[Group], version: int, max_staleness: int) -> dict[str, float]:
    """Staleness per sampled token (partial rollouts: a sample's tokens may come from several versions): the
    mean, the fraction of tokens at each staleness 0..max_staleness, and the fraction of samples whose
    tokens span more than one version."""
    tokens: Counter[int] = Counter()  # staleness -> sampled tokens
    mixed = samples = 0
    for g in groups:
        for s in g.samples:
            samples += 1
            if s.versions is None:  # every sampled token is the group's version: no per-token array to build
                tokens[version - g.policy_version] += s.sampled_tokens
                continue
            values, counts = np.unique(token_staleness(s.versions, version), return_counts=True)
            tokens.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))
            mixed += values.size > 1
    total = sum(tokens.values())
    out = {
        "token_staleness_mean": sum(k * n for k, n in tokens.items()) / total if total else 0.0,
        "mixed_version_sample_fraction": mixed / samples if samples else 0.0,
    }
    for s in range(max_staleness + 1):
        out[f"token_staleness_fraction_{s}"] = tokens[s] / total if total else 0.0
    return out


def iteration_metrics(version: int, groups: list[Group], update: dict, timer: Timer, max_staleness: int, extra: dict) -> dict:
    stats = group_stats(groups)
    elapsed = timer.elapsed()
    generate = generation_span(groups)
    return {
        "iteration": version,
        **stats,
        **update,
        **staleness_stats(groups, version, max_staleness),
        **token_staleness_stats(groups, version, max_staleness),
        "iteration_seconds": elapsed,
        "generate_seconds": generate,
        "train_seconds": timer["train"],
        "sync_seconds": timer["sync"],
        "trainer_idle_seconds": timer["idle"],
        "rollout_idle_seconds": float(sum(g.worker_idle_seconds for g in groups)),
        "generated_tokens_per_s": stats["generated_tokens"] / generate if generate > 0 else 0.0,
        "trained_tokens_per_s": update["trained_tokens"] / timer["train"] if timer["train"] > 0 else 0.0,
        "samples_per_s": stats["samples"] / elapsed if elapsed > 0 else 0.0,
        "pipeline_efficiency": pipeline_efficiency(generate, timer["train"], timer["sync"], elapsed),
        "generation_tail_seconds": generation_tail(groups),
        "wall_time": time.time(),  # when the iteration ended (Unix seconds): benchmarks time the loop end to end
        **extra,
    }


def pipeline_efficiency(generate: float, train: float, sync: float, iteration: float) -> float:
    """(max(generate, train) + sync) / iteration time: 1 when the iteration takes no longer than
    its slower phase plus the weight sync, i.e. generation and training overlap perfectly."""
    return (max(generate, train) + sync) / iteration if iteration > 0 else 0.0


def generation_tail(groups: list[Group]) -> float:
    """From the first group finished to the last: how long the iteration waits on stragglers."""
    if not groups:
        return 0.0
    return max(g.gen_end for g in groups) - min(g.gen_end for g in groups)


def group_record(group: Group, version: int, train_start: float, train_end: float) -> dict:
    return {
        "iteration": group.iteration,
        "prompt_id": group.prompt_id,
        "policy_version": group.policy_version,
        "trained_version": version,
        "worker_id": group.worker_id,
        "gen_start": group.gen_start,
        "gen_end": group.gen_end,
        "train_start": train_start,
        "train_end": train_end,
        "reward_mean": float(np.mean(group.rewards)),
        **({} if group.images is None else {"images": len(group.images.image_grid_thw)}),  # a text group's record is unchanged
    }

"""A run's result from its records: the summary `tidal run` writes (summary.json), the table it
prints, and the figures the HTML report (tidal report) shares with them."""

from __future__ import annotations

from pathlib import Path

from tidal.rundir import RunDir, RunInfo

# (label, summary key, per-iteration metric): the split of an iteration, in the order it is shown
TIME_SPLIT = (
    ("iteration", "iteration_seconds_mean", "iteration_seconds"),
    ("generate", "generate_seconds_mean", "generate_seconds"),
    ("train", "train_seconds_mean", "train_seconds"),
    ("weight-sync", "sync_seconds_mean", "sync_seconds"),
    ("idle", "idle_seconds_mean", "trainer_idle_seconds"),
)


def mean_of(history: list[dict], key: str) -> float:
    """The mean of a per-iteration metric over the iterations (a missing value counts as 0)."""
    return sum(m.get(key, 0.0) for m in history) / len(history) if history else 0.0


def pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def sparkline(values: list[float]) -> str:
    """A held-out curve in one line of text."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(bars[min(len(bars) - 1, int((v - low) / span * (len(bars) - 1) + 0.5))] for v in values)


def at_k_before_after(before: dict | None, after: dict | None) -> dict[str, float]:
    """pass_at_k / maj_at_k of the held-out eval before and after, as `pass_at_4_before` etc."""
    if not (before and after):
        return {}
    keys = [k for k in before if k.startswith(("pass_at_", "maj_at_")) and k in after]
    return {f"{k}_{when}": scores[k] for k in keys for when, scores in (("before", before), ("after", after))}


def summarize(
    mode: str,
    group_size: int,
    eval_samples_per_prompt: int,
    history: list[dict],
    before: dict | None,
    after: dict | None,
    final_weights: Path,
    info: RunInfo,
    extra: dict,
) -> dict:
    """summary.json's record of a run (`mode`, rollout.group_size and eval.samples_per_prompt: the config's part)."""

    def mean(key: str) -> float:
        return mean_of(history, key)

    trained = sum(int(m["samples"]) // group_size for m in history)
    filtered = int(sum(m.get("groups_filtered", 0) for m in history))
    return {
        "mode": mode,
        "iterations": len(history),
        "accuracy_before": before and before["accuracy"],
        "accuracy_after": after and after["accuracy"],
        "sampled_accuracy_before": before and before["sampled_accuracy"],
        "sampled_accuracy_after": after and after["sampled_accuracy"],
        "iteration_seconds_mean": mean("iteration_seconds"),
        "generate_seconds_mean": mean("generate_seconds"),
        "train_seconds_mean": mean("train_seconds"),
        "sync_seconds_mean": mean("sync_seconds"),
        "idle_seconds_mean": mean("trainer_idle_seconds"),
        "rollout_idle_seconds_mean": mean("rollout_idle_seconds"),
        "pipeline_efficiency_mean": mean("pipeline_efficiency"),
        "generation_tail_seconds_mean": mean("generation_tail_seconds"),
        "reward_seconds_mean": mean("reward_seconds"),
        **served_reward_totals(history),
        "eval_samples_per_prompt": eval_samples_per_prompt,
        "staleness_max": max((m["staleness_max"] for m in history), default=0.0),
        "reward_errors": sum(m["reward_errors"] for m in history),
        "failures": run_failures(history),
        "groups_generated": extra.get("groups_generated", trained + filtered),
        "groups_trained": trained,
        "groups_discarded": int(sum(m["groups_discarded"] for m in history)),
        "messages_rejected": int(sum(m.get("messages_rejected", 0) for m in history)),
        "staleness_mean": mean("staleness_mean"),
        # how far the rollouts' log-probs are from the trainer's own at the version they claim: near 0
        # for the HF engine; a rise with staleness 0 means the workers ran other weights (or another dtype)
        "logprob_mismatch_mean": mean("logprob_mismatch"),
        "logprob_mismatch_max": max((m.get("logprob_mismatch", 0.0) for m in history), default=0.0),
        "groups_filtered": int(sum(m.get("groups_filtered", 0) for m in history)),
        **agent_training(history),
        "final_weights": str(final_weights),
        "mlflow_run_id": info.mlflow_run_id,
        "tracking_uri": info.tracking_uri,
    }


SERVED_COUNTS = ("reward_server_requests", "reward_server_samples", "reward_server_retries", "reward_server_failed_requests")


def served_reward_totals(history: list[dict]) -> dict:
    """The served rewards' requests over the run (reward_model / judge entries); {} without them."""
    if not any("reward_server_requests" in m for m in history):
        return {}
    totals = {k: int(sum(m.get(k, 0.0) for m in history)) for k in SERVED_COUNTS}
    totals["reward_server_seconds_mean"] = mean_of(history, "reward_server_seconds")
    return totals


def served_lines(summary: dict) -> list[str]:
    if "reward_server_requests" not in summary:
        return []
    requests = summary["reward_server_requests"]
    batch = summary["reward_server_samples"] / requests if requests else 0.0
    return [
        f"  reward server        {requests} requests (mean batch {batch:.1f} samples), {summary['reward_server_retries']} retries, "
        f"{summary['reward_server_failed_requests']} failed after retries; {summary['reward_server_seconds_mean']:.2f}s/iteration in requests"
    ]


def run_failures(history: list[dict]) -> dict[str, list]:
    """Each reward's and environment method's [calls, failed, first error] over the run (metrics' `failures`)."""
    from tidal.rewards.failures import merge_tallies

    totals: dict[str, list] = {}
    for m in history:
        merge_tallies(totals, m.get("failures"))
    return totals


def reward_error_lines(summary: dict) -> list[str]:
    """Every reward and environment method that failed, by name: how often, and its first error. A run
    whose reward fails on every sample learns nothing, and says why here."""
    failing = {name: t for name, t in (summary.get("failures") or {}).items() if t[1]}
    errors = int(summary.get("reward_errors") or 0)
    if not failing and not errors:
        return []
    lines = [
        f"  {'errors' if i == 0 else '':<21}{name}: {failed} of {calls} calls failed; first: {error}"
        for i, (name, (calls, failed, error)) in enumerate(sorted(failing.items()))
    ]
    logs = "the run's logs have each one (logs/worker-*.log; sync mode: logs/launcher.log)"
    return lines + [f"  reward errors        {errors} reward(s) scored 0: {logs}"] if errors else lines


def at_k_lines(summary: dict) -> list[str]:
    ks = sorted({int(k.split("_")[2]) for k in summary if k.startswith(("pass_at_", "maj_at_")) and k.endswith("_before")})
    parts = [
        f"{name}@{k} {pct(summary[f'{name}_at_{k}_before'])} -> {pct(summary[f'{name}_at_{k}_after'])}"
        for name in ("pass", "maj")
        for k in ks
        if f"{name}_at_{k}_before" in summary
    ]
    return [f"                       {', '.join(parts)}"] if parts else []


AGENT_EVAL_KEYS = ("tool_use_rate", "tool_success_rate", "turns_mean")


def agent_before_after(before: dict | None, after: dict | None) -> dict:
    """The held-out tool use before and after (rollout.agent runs), greedy and `sampled_`."""
    if not (before and after):
        return {}
    keys = [f"{prefix}{k}" for prefix in ("", "sampled_") for k in AGENT_EVAL_KEYS]
    return {f"{k}_{when}": scores[k] for k in keys if k in before and k in after for when, scores in (("before", before), ("after", after))}


def agent_training(history: list[dict]) -> dict:
    """The trajectories' shape over the run (rollout.agent): first and last tenth of the iterations."""
    agent = [m for m in history if "agent_turns_mean" in m]
    if not agent:
        return {}
    tenth = max(1, len(agent) // 10)

    def early_late(key: str) -> tuple[float, float]:
        return mean_of(agent[:tenth], key), mean_of(agent[-tenth:], key)

    return {
        "agent_turns": early_late("agent_turns_mean"),
        "agent_tool_calls": early_late("agent_tool_calls_mean"),
        "agent_tool_error_rate": early_late("agent_tool_error_rate"),
        "agent_env_seconds_mean": mean_of(agent, "agent_env_seconds"),
        "agent_masked_token_fraction_mean": mean_of(agent, "agent_masked_token_fraction"),
        "agent_trajectory_length_p90_max": max(m["agent_trajectory_length_p90"] for m in agent),
    }


def agent_lines(summary: dict) -> list[str]:
    lines = []
    if "agent_turns" in summary:
        turns, calls, errors = summary["agent_turns"], summary["agent_tool_calls"], summary["agent_tool_error_rate"]
        lines.append(
            f"  trajectories         turns {turns[0]:.2f} -> {turns[1]:.2f}, tool calls {calls[0]:.2f} -> {calls[1]:.2f}, "
            f"tool errors {pct(errors[0])} -> {pct(errors[1])} (first -> last tenth); env {summary['agent_env_seconds_mean']:.2f}s/iteration, "
            f"{pct(summary['agent_masked_token_fraction_mean'])} of tokens inserted, length p90 <= {summary['agent_trajectory_length_p90_max']:.0f}"
        )
    if "tool_use_rate_before" not in summary:
        return lines

    def pair(key: str) -> str:
        return f"{pct(summary.get(key + '_before'))} -> {pct(summary.get(key + '_after'))}"

    lines.append(f"  tool use             calls the tool {pair('tool_use_rate')}, calls that work {pair('tool_success_rate')}  (greedy, held out)")
    if "sampled_tool_use_rate_before" in summary:
        lines.append(
            f"                       calls the tool {pair('sampled_tool_use_rate')}, calls that work {pair('sampled_tool_success_rate')}  (sampled)"
        )
    return lines


def curve_lines(summary: dict) -> list[str]:
    curve = summary.get("eval_curve") or []
    key = "sampled_accuracy" if curve and curve[0].get("sampled_accuracy") is not None else "accuracy"
    values = [point[key] for point in curve]
    if not values:
        return []
    versions = f"v{curve[0]['version']}..v{curve[-1]['version']}"
    return [f"  held-out curve       {sparkline(values)}  {pct(values[0])} -> {pct(values[-1])} ({key}, {versions}, {len(values)} points)"]


def time_line(summary: dict) -> str:
    """Where an iteration's seconds went. The trainer's parts (train, weight sync, idle, the rest) add up to
    the iteration; generation runs on the rollout workers beside them (in periodic and bounded mode it
    overlaps training), so it is shown apart rather than as one more term of the sum."""
    total = summary["iteration_seconds_mean"]
    parts = {label: summary[key] for label, key, _ in TIME_SPLIT[2:]}
    parts["other"] = max(0.0, total - sum(parts.values()))
    return (
        f"  seconds / iteration  {total:.2f}  =  "
        + " + ".join(f"{label} {seconds:.2f}" for label, seconds in parts.items())
        + f" (trainer); generate {summary['generate_seconds_mean']:.2f} beside it (rollout workers), "
        f"scoring {summary.get('reward_seconds_mean', 0.0):.2f}; "
        f"pipeline efficiency {summary['pipeline_efficiency_mean']:.2f}, generation tail {summary['generation_tail_seconds_mean']:.2f}s"
    )


def result_table(summary: dict, run_dir: Path, wall: float) -> str:
    return "\n".join(
        [
            f"Tidal run finished: {run_dir}  (mode {summary['mode']}, {summary['iterations']} iterations, {wall:.0f}s wall)",
            f"  held-out accuracy    before {pct(summary['accuracy_before'])}  ->  after {pct(summary['accuracy_after'])}  (greedy)",
            f"                       before {pct(summary['sampled_accuracy_before'])}  ->  after {pct(summary['sampled_accuracy_after'])}  "
            f"(sampled at the rollout temperature, {summary['eval_samples_per_prompt']} per prompt: what RL optimises)",
            *at_k_lines(summary),
            *agent_lines(summary),
            *curve_lines(summary),
            time_line(summary),
            *served_lines(summary),
            f"  groups               generated {summary['groups_generated']}, trained {summary['groups_trained']}, "
            f"filtered {summary['groups_filtered']}, discarded {summary['groups_discarded']}; staleness max {summary['staleness_max']:.0f}, "
            f"log-prob mismatch max {summary.get('logprob_mismatch_max', 0.0):.2g}",
            *reward_error_lines(summary),
            f"  final weights        {summary['final_weights']}",
            f"  MLflow               run {summary['mlflow_run_id']} in {summary['tracking_uri']}",
            f"  summary              {RunDir(run_dir).summary}",
        ]
    )

"""Verifiable rewards, looked up by name; user functions as `module:function`.

A reward function is `fn(completion: str, answer: str) -> float`.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import time
from dataclasses import dataclass, field

from tidal.config import RewardConfig
from tidal.rewards.builtin import REGISTRY, RewardFn, exact_match, extract_final_answer, format_reward, math_verify_reward, register  # noqa: F401
from tidal.rewards.failures import FailureLedger, FailureWindow, RewardFailingError, over_their_rate
from tidal.rewards.pool import RewardError

log = logging.getLogger(__name__)


def resolve(name: str) -> RewardFn:
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        raise RewardError(f"unknown reward function {name!r}: registered are {sorted(REGISTRY)}, or give module:function")
    module_name, fn_name = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise RewardError(f"reward function {name!r}: cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {name!r}: {module_name} has no callable {fn_name!r}")
    return fn


def is_user_function(name: str) -> bool:
    return name not in REGISTRY and ":" in name


def check_reward_names(cfg: RewardConfig) -> None:
    """Every reward.functions name resolves and can be called as fn(completion, answer): the launcher's
    check before any process of the run starts. User modules are imported in a sandboxed reward process
    (the one a worker starts), never in the launcher. A RewardError names the function."""
    from pathlib import Path

    from tidal.hosted import HostStartError
    from tidal.rewards.pool import reward_process

    user = [f.name for f in cfg.functions if f.type == "function" and is_user_function(f.name)]
    for f in cfg.functions:
        if f.type == "function" and not is_user_function(f.name):
            check_reward_signature(f.name, resolve(f.name))
        elif f.type == "function":
            continue
        elif f.type == "reward_model" and f.serve is not None and f.serve.model is not None:
            from tidal.rewards.score_head import architecture_without_score_head

            if not Path(f.serve.model, "config.json").is_file():
                raise RewardError(f"reward.functions[{f.label}].serve.model: {f.serve.model} is not a model directory (no config.json)")
            architecture = architecture_without_score_head(f.serve.model)
            if architecture is not None:
                raise RewardError(
                    f"reward.functions[{f.label}].serve.model: {f.serve.model} is a {architecture}, not a reward model "
                    "(no ForSequenceClassification architecture in its config.json: no trained score head)"
                )
    if user:
        process = reward_process(user, cfg.timeout_seconds, cfg.memory_mb, cfg.cpu_seconds)
        try:
            process.load()
        except HostStartError as err:
            raise RewardError(str(err)) from None
        finally:
            process.close()


def reward_error_rates(cfg: RewardConfig) -> dict[str, float]:
    """Each reward's label -> the max_error_rate it tolerates (reward.max_error_rate for functions, the entry's own for served ones)."""
    return {f.label: cfg.max_error_rate if f.type == "function" else f.max_error_rate for f in cfg.functions}


def check_failure_rates(cfg: RewardConfig, failures: dict[str, list]) -> None:
    """At the end of a run: RewardFailingError naming the first reward or environment method (those at
    reward.max_error_rate) that failed more than its max_error_rate of the calls it made, however few:
    the run finished, but on scores of 0."""
    rates = reward_error_rates(cfg)
    over = over_their_rate(failures, lambda name: rates.get(name, cfg.max_error_rate))
    if over:
        name = over[0]
        calls, failed, error = failures[name]
        raise RewardFailingError(
            f"{name}: {failed} of its {calls} calls failed, over its max_error_rate {rates.get(name, cfg.max_error_rate):g} "
            f"(the run trained on their scores of 0); first error: {error}"
        )


def check_reward_signature(name: str, fn: RewardFn) -> None:
    """A function that cannot be called as fn(completion, answer) would raise on every sample (each scoring 0):
    a RewardError naming it, e.g. for TRL's `fn(completions, **kwargs) -> list[float]`."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature to read: its calls will tell
        return
    try:
        signature.bind("completion", "answer")
    except TypeError as err:
        raise RewardError(f"reward function {name!r}{signature} cannot be called as fn(completion: str, answer: str) -> float: {err}") from None


@dataclass
class RewardScorer:
    """Weighted sum of reward functions and served rewards (tidal.rewards.served). A function that
    raises, hangs past reward.timeout_seconds or kills its process scores 0 and is counted; so does a
    served reward whose request failed after its retries. Built-ins run in this process; user
    functions (`module:function`) in a process of their own (tidal.rewards.pool), replaced when it
    fails; served rewards from a loop on a thread of their own, batched over every sample scored at once."""

    functions: list[tuple[str, RewardFn, float]]
    errors: int = 0
    last_error: str | None = field(default=None, repr=False)
    process: object = field(default=None, repr=False)  # the user functions' HostProcess, if any
    served: object = field(default=None, repr=False)  # ServedRewards, if any entry is served
    served_weights: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # spent scoring since the last take_stats
    windows: dict[str, FailureWindow] = field(default_factory=dict, repr=False)  # per function: reward.max_error_rate
    ledger: FailureLedger = field(default_factory=FailureLedger, repr=False)  # calls and failures per reward, for the groups

    @classmethod
    def from_config(
        cls, cfg: RewardConfig, prestart: bool = False, seed: int | None = None, served_urls: dict[str, str] | None = None
    ) -> RewardScorer:
        """`prestart`: the user functions' process starts now, not at the first score. `seed`: the
        judge's seed (rollout.deterministic). `served_urls`: the reward servers `tidal run` started
        (RunDir.reward_server_urls), for `serve:` entries."""
        from tidal.rewards.pool import remote_reward, reward_process
        from tidal.rewards.served import ServedRewards

        local = [f for f in cfg.functions if f.type == "function"]
        user = [f.name for f in local if is_user_function(f.name)]
        process = reward_process(user, cfg.timeout_seconds, cfg.memory_mb, cfg.cpu_seconds) if user else None
        if process is not None and prestart:
            process.prestart()
        fns = [(f.name, remote_reward(process, f.name) if is_user_function(f.name) else resolve(f.name), f.weight) for f in local]
        served = [f for f in cfg.functions if f.type != "function"]
        return cls(
            fns,
            process=process,
            served=ServedRewards.from_config(served, seed, served_urls) if served else None,
            served_weights={f.label: f.weight for f in served},
            windows={f.name: FailureWindow(cfg.error_window, cfg.max_error_rate) for f in local},
        )

    def score(self, completion: str, answer: str, prompt_id: int | None = None, prompt: str = "") -> tuple[float, dict[str, float]]:
        from tidal.rewards.served import Row

        reward, parts, _ = self.score_many([Row(prompt, completion, answer)], [prompt_id])[0]
        return reward, parts

    def score_many(self, rows: list, prompt_ids: list[int | None]) -> list[tuple[float, dict[str, float], int]]:
        """(reward, parts, errors: the parts that failed and scored 0) per row (tidal.rewards.served.Row);
        the served rewards get every row at once, in batches. Raises RewardFailingError when a function
        or a served reward fails too often."""
        t0 = time.perf_counter()
        try:
            served = self.served.score(rows) if self.served is not None else {}
            served_errors = self.served.last_errors() if self.served is not None else {}
            out = []
            for i, (row, prompt_id) in enumerate(zip(rows, prompt_ids)):
                parts: dict[str, float] = {}
                before = self.errors
                for name, fn, _ in self.functions:
                    try:
                        parts[name] = checked_reward(fn(row.completion, row.answer))
                        self.ledger.record(name, failed=False)
                        self.record(name, failed=False)
                    except Exception as err:  # user code: never let it take the worker down
                        kind = getattr(err, "kind", type(err).__name__)
                        self.errors += 1
                        self.last_error = f"{name}: {kind}: {err}"
                        log.warning("reward function %s raised %s: %s (prompt %s; scored 0)", name, kind, err, prompt_id)
                        parts[name] = 0.0
                        self.ledger.record(name, failed=True, error=f"{kind}: {err}")
                        self.record(name, failed=True)
                for name, scores in served.items():
                    if scores[i] is None:
                        self.errors += 1
                        self.last_error = f"{name}: its request failed"
                    self.ledger.record(name, failed=scores[i] is None, error=served_errors.get(name))
                    parts[name] = 0.0 if scores[i] is None else scores[i]
                total = sum(w * parts[name] for name, _, w in self.functions) + sum(w * parts[name] for name, w in self.served_weights.items())
                out.append((total, parts, self.errors - before))
            return out
        finally:
            self.seconds += time.perf_counter() - t0

    def record(self, name: str, failed: bool) -> None:
        """One call's outcome; raises RewardFailingError once the function fails more than reward.max_error_rate
        of its last reward.error_window calls (a whole window: a few early failures are not a rate)."""
        window = self.windows.get(name)
        if window is None:
            return
        window.record(failed)
        if failed and len(window.outcomes) == window.size and window.too_many():
            raise RewardFailingError(
                f"reward function {name}: {window.failures} of its last {len(window.outcomes)} calls failed, over reward.max_error_rate "
                f"{window.rate:g} of reward.error_window {window.size} (reward.max_error_rate 1 trains on regardless); last: {self.last_error}"
            )

    def take_stats(self) -> dict[str, float]:
        """Seconds spent scoring and the served rewards' request counts since the last call."""
        stats = {"reward_seconds": self.seconds, **(self.served.take_stats() if self.served is not None else {})}
        self.seconds = 0.0
        return stats

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
        if self.served is not None:
            self.served.close()


def checked_reward(value: object) -> float:
    """A reward must be a finite real number: NaN or inf would turn every weight into NaN, and a
    string ("0.5") or None is a bug in the function, not a score. Anything else raises (and is
    counted as a reward error, scoring 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"returned {result}, not a finite number")
    return result

"""The built-in reward functions, registered by name: the registry the config checks `reward.functions` names
against (this module imports nothing of the config, so the config can read it).

A reward function is `fn(completion: str, answer: str) -> float`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

RewardFn = Callable[[str, str], float]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn

    return deco


_FINAL_ANSWER = re.compile(r"(?:A:|####)\s*(-?[\d,]*\.?\d+)")


def extract_final_answer(completion: str) -> str | None:
    matches = _FINAL_ANSWER.findall(completion)
    return matches[-1].replace(",", "") if matches else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip() == b.strip()


@register("exact_match")
def exact_match(completion: str, answer: str) -> float:
    got = extract_final_answer(completion)
    return 1.0 if got is not None and _same_number(got, answer) else 0.0


_FORMAT = re.compile(r"^\s*(?:A:|####) -?[\d,]*\.?\d+\s*$")


@register("format")
def format_reward(completion: str, answer: str) -> float:
    """1 when the completion's last line is exactly a final-answer line."""
    lines = completion.strip().splitlines()
    return 1.0 if lines and _FORMAT.match(lines[-1]) else 0.0


@register("math_verify")
def math_verify_reward(completion: str, answer: str) -> float:
    """1 when the completion's final answer equals `answer` mathematically, by the math-verify
    package: \\boxed{}, `####`, fractions, LaTeX, units and thousands separators are understood
    (`exact_match` reads only `A:` / `####` numbers). math-verify's timeouts use SIGALRM, which
    works only on a process's main thread; rewards are scored on worker threads, so there they run
    without one."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=timeout)
    return 1.0 if verify(gold, parse(completion, parsing_timeout=timeout), timeout_seconds=timeout) else 0.0

"""The CI gate of ``tidal submit --wait``: requirements on a run's final metrics, and its outcome as JSON
and Markdown. Pure functions; submit.py talks to KFP and MLflow."""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

OPERATORS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}
REQUIREMENT = re.compile(r"\s*([\w./-]+)\s*(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")
SUCCEEDED = "SUCCEEDED"
FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "ERROR"})
"""KFP runtime states a run does not leave (ERROR: what KFP v1 backends report for FAILED)."""
NOT_FOLLOWED = "SUBMITTED"
"""The outcome's state when ``--wait`` was not given: the run exists, nobody watched it end."""
RESULT_PREFIX = "eval/"
"""The metrics of the result table: the held-out metrics of the last evaluated round, as the pipeline's
evaluate step logs them to the MLflow run (training logs its own metrics there too, many more)."""


class RequirementError(ValueError):
    """A ``--require`` expression that does not parse; the message quotes it."""


@dataclass(frozen=True)
class Requirement:
    metric: str
    op: str
    threshold: float
    text: str = field(default="", compare=False)  # as the user wrote it

    def __str__(self) -> str:
        return self.text or f"{self.metric}{self.op}{self.threshold!r}"


@dataclass(frozen=True)
class Check:
    requirement: Requirement
    value: float | None  # None: the run has no such metric
    passed: bool

    def describe(self) -> str:
        if self.value is None:
            return f"{self.requirement}: no metric {self.requirement.metric} in the run"
        return f"{self.requirement}: {self.value:g}, {'met' if self.passed else 'NOT met'}"


def parse_requirement(text: str) -> Requirement:
    """``METRIC OP NUMBER``, e.g. ``eval/accuracy>=0.6``; OP is one of >=, <=, >, <, ==, !=."""
    match = REQUIREMENT.fullmatch(text)
    if not match:
        raise RequirementError(f"--require {text!r}: expected METRIC OP NUMBER with OP one of {', '.join(OPERATORS)}, e.g. eval/accuracy>=0.6")
    metric, op, number = match.groups()
    return Requirement(metric, op, float(number), text.strip())


def check_requirements(requirements: list[Requirement], metrics: dict[str, float]) -> list[Check]:
    """Each requirement against the run's metrics; a missing or NaN metric fails it."""
    checks = []
    for r in requirements:
        value = metrics.get(r.metric)
        passed = value is not None and not math.isnan(value) and OPERATORS[r.op](value, r.threshold)
        checks.append(Check(r, value, passed))
    return checks


@dataclass(frozen=True)
class Outcome:
    """What CI needs to know of a submitted run."""

    run_id: str
    state: str  # the KFP run's last state seen; NOT_FOLLOWED without --wait
    kfp_run_url: str
    mlflow_run_id: str = ""
    mlflow_run_url: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    timed_out: bool = False
    error: str = ""  # why the run failed (KFP's message), or why it could not be followed to its end
    notes: list[str] = field(default_factory=list)  # what is missing from the outcome without failing it

    @property
    def followed(self) -> bool:
        return self.state != NOT_FOLLOWED

    @property
    def ok(self) -> bool:
        if not self.followed:
            return not self.error
        return self.state == SUCCEEDED and not self.timed_out and not self.error and all(c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        """The gate, in a few words."""
        if not self.followed:
            return "not checked (submitted without --wait)"
        return "**passed**" if self.ok else f"**FAILED**: {self.failure()}"

    def failure(self) -> str:
        """One line: why the gate failed; empty when it passed."""
        if self.ok:
            return ""
        if self.timed_out:
            return f"run {self.run_id} still {self.state} when --timeout ran out; it keeps running: {self.kfp_run_url}"
        if self.state in FINAL_STATES and self.state != SUCCEEDED:
            return f"run {self.run_id} ended {self.state}" + (f": {self.error}" if self.error else "") + f" ({self.kfp_run_url})"
        if self.error:
            return f"run {self.run_id} ({self.state}): {self.error}"
        failed = [c for c in self.checks if not c.passed]
        return f"run {self.run_id} {self.state}, but {len(failed)} of {len(self.checks)} requirement(s) failed: " + "; ".join(
            c.describe() for c in failed
        )


def result_metrics(outcome: Outcome) -> dict[str, float]:
    """The result table: the held-out metrics, and every metric a requirement names."""
    named = {c.requirement.metric for c in outcome.checks}
    return {k: v for k, v in sorted(outcome.metrics.items()) if k.startswith(RESULT_PREFIX) or k in named}


def outcome_dict(outcome: Outcome) -> dict:
    return {
        "run_id": outcome.run_id,
        "state": outcome.state,
        "ok": outcome.ok,
        "timed_out": outcome.timed_out,
        "error": outcome.error,
        "kfp_run_url": outcome.kfp_run_url,
        "mlflow_run_id": outcome.mlflow_run_id,
        "mlflow_run_url": outcome.mlflow_run_url,
        "results": result_metrics(outcome),
        "metrics": dict(sorted(outcome.metrics.items())),
        "requirements": [
            {
                "requirement": str(c.requirement),
                "metric": c.requirement.metric,
                "op": c.requirement.op,
                "threshold": c.requirement.threshold,
                "value": c.value,
                "passed": c.passed,
            }
            for c in outcome.checks
        ],
        "notes": list(outcome.notes),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _link(text: str, url: str) -> str:
    return f"[{_cell(text)}]({url})" if url else f"`{_cell(text)}`"


def outcome_markdown(outcome: Outcome) -> str:
    """The outcome for a CI job summary (GitHub's $GITHUB_STEP_SUMMARY renders it)."""
    lines = [f"## Tidal run {_link(outcome.run_id, outcome.kfp_run_url)}: {outcome.state}", "", f"Gate: {_cell(outcome.verdict)}", ""]
    if outcome.mlflow_run_id:
        lines += [f"MLflow run: {_link(outcome.mlflow_run_id, outcome.mlflow_run_url)}", ""]
    results = result_metrics(outcome)
    if results:
        lines += ["| metric | value |", "| --- | --- |", *(f"| {_cell(k)} | {v:.6g} |" for k, v in results.items()), ""]
    if outcome.checks:
        lines += ["| requirement | value | result |", "| --- | --- | --- |"]
        for c in outcome.checks:
            value = "missing" if c.value is None else f"{c.value:.6g}"
            lines.append(f"| `{_cell(str(c.requirement))}` | {value} | {'pass' if c.passed else '**FAIL**'} |")
        lines.append("")
    lines += [f"- {_cell(note)}" for note in outcome.notes]
    return "\n".join(lines).rstrip() + "\n"

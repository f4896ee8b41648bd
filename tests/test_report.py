"""`tidal report RUN_DIR`: a self-contained report.html next to summary.json, built from a real short run."""

from __future__ import annotations

import copy
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from tests.conftest import read_jsonl, run_cli
from tidal.report import build_report


class Elements(HTMLParser):
    """Tags (with attributes) and text of a page."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> Elements:
    parser = Elements()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_config_dict) -> Path:
    """A finished 3-iteration periodic run, held-out eval before and after."""
    tmp = tmp_path_factory.mktemp("report-run")
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(copy.deepcopy(tiny_config_dict)))
    run_dir = tmp / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_report_of_a_real_run_has_the_curves_the_time_split_and_the_summary(finished_run):
    proc = run_cli("report", str(finished_run))
    assert proc.returncode == 0, proc.stderr
    path = finished_run / "report.html"
    assert proc.stdout.strip() == str(path) and path.is_file()
    page = path.read_text()
    doc = parse(page)
    text = " ".join(doc.text)
    summary = json.loads((finished_run / "summary.json").read_text())
    metrics = read_jsonl(finished_run / "metrics.jsonl")

    # Self-contained: nothing to fetch, nothing to run.
    tags = {t for t, _ in doc.tags}
    assert "script" not in tags and "link" not in tags and "img" not in tags and "iframe" not in tags
    assert not any(k in ("src", "href") for _, attrs in doc.tags for k in attrs)
    assert not re.search(r"url\(|@import", page)

    # The curves: reward per iteration (one point per iteration) and held-out accuracy before/after.
    assert "Reward (training samples, per iteration)" in text and "Held-out accuracy" in text
    series = {attrs["data-name"]: attrs["points"] for t, attrs in doc.tags if t == "polyline"}
    assert len(series["reward_mean"].split()) == len(metrics) == 3
    assert len(series["greedy"].split()) == 2 and len(series["sampled"].split()) == 2  # before and after
    assert "before and after the run" in text

    # The time split: one stacked bar per phase per iteration, and the generation span as a line.
    phases = [attrs["data-phase"] for t, attrs in doc.tags if t == "rect" and "data-phase" in attrs]
    assert {"train", "weight-sync"} <= set(phases)
    assert phases.count("train") == sum(1 for m in metrics if m["train_seconds"] > 0)
    assert len(series["generate"].split()) == 3
    bars = re.findall(r"iteration (\d+): train ([0-9.]+)s of ([0-9.]+)s", page)
    assert [int(b[0]) for b in bars] == [0, 1, 2]
    assert all(abs(float(b[1]) - round(m["train_seconds"], 3)) < 1e-3 for b, m in zip(bars, metrics))

    # The summary table: every scalar of summary.json, with its value.
    rows = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", page))
    for key, value in summary.items():
        if not isinstance(value, list | dict):
            assert key in rows, key
    assert rows["mode"] == "periodic" and rows["groups_trained"] == str(summary["groups_trained"])
    assert rows["accuracy_after"] == f"{summary['accuracy_after']:.1%}"
    assert summary["mlflow_run_id"] in text


def test_report_draws_the_held_out_curve_from_eval_jsonl_and_writes_where_asked(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [
        {
            "iteration": i,
            "reward_mean": 0.1 * i,
            "accuracy": 0.1 * i,
            "iteration_seconds": 1.0,
            "generate_seconds": 0.8,
            "train_seconds": 0.5,
            "sync_seconds": 0.1,
            "trainer_idle_seconds": 0.3,
        }
        for i in range(5)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    evals = [{"version": v, "accuracy": 0.1 + v / 10, "sampled_accuracy": 0.05 + v / 10} for v in (0, 2, 4, 5)]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    page = build_report(run_dir)  # no summary.json yet: a running job's report
    series = {attrs["data-name"]: attrs["points"] for t, attrs in parse(page).tags if t == "polyline"}
    assert len(series["greedy"].split()) == 4 and len(series["sampled"].split()) == 4
    assert "4 evaluations while training" in page and "the run has not finished" in page
    out = tmp_path / "elsewhere.html"
    proc = run_cli("report", str(run_dir), "--out", str(out))
    assert proc.returncode == 0 and out.is_file() and not (run_dir / "report.html").exists()


def test_report_of_a_directory_that_is_not_a_run_is_a_clear_error(tmp_path):
    proc = run_cli("report", str(tmp_path))
    assert proc.returncode == 2 and "is it a Tidal run directory" in proc.stderr


def test_the_end_of_run_table_says_how_many_rewards_failed_and_where_to_look(tmp_path):
    from tidal.summary import result_table

    summary = {
        "mode": "periodic",
        "iterations": 2,
        "accuracy_before": 0.5,
        "accuracy_after": 0.5,
        "sampled_accuracy_before": None,
        "sampled_accuracy_after": None,
        "eval_samples_per_prompt": 0,
        "iteration_seconds_mean": 1.0,
        "generate_seconds_mean": 0.5,
        "train_seconds_mean": 0.5,
        "sync_seconds_mean": 0.0,
        "idle_seconds_mean": 0.0,
        "pipeline_efficiency_mean": 1.0,
        "generation_tail_seconds_mean": 0.0,
        "groups_generated": 4,
        "groups_trained": 4,
        "groups_filtered": 0,
        "groups_discarded": 0,
        "staleness_max": 0.0,
        "final_weights": str(tmp_path / "weights" / "v000002"),
        "mlflow_run_id": "r",
        "tracking_uri": "sqlite:///x.db",
        "reward_errors": 0,
    }
    assert "reward errors" not in result_table(summary, tmp_path, 1.0)
    (line,) = [line for line in result_table({**summary, "reward_errors": 32}, tmp_path, 1.0).splitlines() if "reward errors" in line]
    assert "32 reward(s) scored 0" in line and "logs/worker-*.log" in line


def test_the_report_names_every_failing_reward_with_its_counts_and_first_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "reward_mean": 0.0}) + "\n")
    summary = {"mode": "sync", "iterations": 1, "reward_errors": 0, "failures": {"exact_match": [64, 0, None]}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert "Failures" not in build_report(run_dir)  # a reward that never failed: no section
    failing = {"mymod:score": [64, 64, "ValueError: <b>no answer</b>"], "exact_match": [64, 0, None], "Env.step": [10, 2, "KeyError: 'x'"]}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "reward_errors": 64, "failures": failing}))
    page = build_report(run_dir)
    assert "64 reward(s) scored 0" in page and "logs/worker-*.log" in page
    rows = [attrs for tag, attrs in parse(page).tags if tag == "table" and attrs.get("class") == "failures"]
    assert len(rows) == 1
    assert "<th>mymod:score</th><td>64</td><td>64</td>" in page and "<th>Env.step</th><td>10</td><td>2</td>" in page
    assert "exact_match</th>" not in page.split('class="failures"')[1].split("</table>")[0]
    assert "&lt;b&gt;no answer&lt;/b&gt;" in page and "<b>no answer</b>" not in page  # user text is escaped


def test_the_time_line_adds_the_trainers_parts_up_to_the_iteration_and_shows_generation_beside_them():
    import re

    from tidal.summary import time_line

    summary = {
        "iteration_seconds_mean": 0.74,
        "generate_seconds_mean": 0.28,
        "train_seconds_mean": 0.59,
        "sync_seconds_mean": 0.02,
        "idle_seconds_mean": 0.09,
        "pipeline_efficiency_mean": 0.77,
        "generation_tail_seconds_mean": 0.22,
    }
    line = time_line(summary)
    total, terms = re.search(r"seconds / iteration\s+([\d.]+)\s+=\s+(.*?) \(trainer\)", line).groups()
    parts = dict((name, float(value)) for name, value in (term.rsplit(" ", 1) for term in terms.split(" + ")))
    assert set(parts) == {"train", "weight-sync", "idle", "other"}
    assert abs(sum(parts.values()) - float(total)) < 0.011
    assert "generate 0.28 beside it" in line and "generate" not in terms

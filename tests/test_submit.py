"""`tidal submit` as a CI step: one line when the KFP API cannot be reached or refuses, and `--wait`
following the run to its end, gating on `--require` over its final metrics, writing `--json` and
`--summary`.

The real kfp.Client talks over HTTP to a stand-in for the KFP API server (named so in the test
names). Creating a run there plays what the pipeline does to MLflow with the pipeline's own
functions (prepare stages the submitted config and opens the parent run tagged with the KFP run
id; each round logs its policy version and held-out metrics; finalize ends the MLflow run), in a
real sqlite store; the run's states are the stand-in's script."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tidal.kube.steps.parent_run import RunLinks, end_parent_run, log_to_parent_run, open_parent_run
from tidal.kube.steps.records import StepRecords
from tidal.kube.steps.staging import PipelineKnobs, stage_config
from tidal.kube.submit import gate
from tidal.kube.submit.client import KfpApiError, api_status_error, follow_run, unreachable_reason
from tidal.kube.submit.gate import (
    Check,
    Outcome,
    Requirement,
    RequirementError,
    check_requirements,
    outcome_dict,
    outcome_markdown,
    parse_requirement,
)
from tidal.rundir import RunDir

# ---------------------------------------------------------------- requirements (pure)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("eval/sampled_accuracy>=0.6", Requirement("eval/sampled_accuracy", ">=", 0.6)),
        (" eval/accuracy <= 1 ", Requirement("eval/accuracy", "<=", 1.0)),
        ("round/policy_version==8", Requirement("round/policy_version", "==", 8.0)),
        ("train/loss!=-0.5", Requirement("train/loss", "!=", -0.5)),
        ("a.b-c>1e-3", Requirement("a.b-c", ">", 0.001)),
        ("x<.5", Requirement("x", "<", 0.5)),
    ],
)
def test_a_requirement_is_metric_operator_number(text, expected):
    assert parse_requirement(text) == expected


@pytest.mark.parametrize(
    "text", ["eval/accuracy=>0.6", "eval/accuracy", ">=0.6", "eval/accuracy>=", "a>=b", "a>=0.6x", "a>=nan", "a>>1", "a b>=1", ""]
)
def test_a_malformed_requirement_is_refused_naming_it(text):
    with pytest.raises(RequirementError) as refused:
        parse_requirement(text)
    message = str(refused.value)
    assert message.startswith(f"--require {text!r}: expected METRIC OP NUMBER") and "\n" not in message


def test_requirements_hold_or_fail_and_a_missing_or_nan_metric_fails():
    metrics = {"eval/accuracy": 0.75, "eval/sampled_accuracy": float("nan"), "round/policy_version": 8.0}
    requirements = [
        parse_requirement(t)
        for t in ("eval/accuracy>=0.6", "eval/accuracy<0.7", "eval/sampled_accuracy!=0", "eval/recall>0", "round/policy_version==8")
    ]
    assert [(c.value, c.passed) for c in check_requirements(requirements, metrics)][:2] == [(0.75, True), (0.75, False)]
    nan, missing, exact = check_requirements(requirements, metrics)[2:]
    assert not nan.passed and (missing.value, missing.passed) == (None, False) and exact.passed
    assert missing.describe() == "eval/recall>0: no metric eval/recall in the run"


# ---------------------------------------------------------------- the outcome (pure)


def outcome(**kw) -> Outcome:
    checks = check_requirements([parse_requirement("eval/accuracy>=0.6"), parse_requirement("eval/recall>0")], {"eval/accuracy": 0.75})
    base = dict(
        run_id="run-1",
        state="SUCCEEDED",
        kfp_run_url="https://kf.example/pipeline/#/runs/details/run-1",
        mlflow_run_id="abc",
        mlflow_run_url="https://kf.example/mlflow/#/experiments/1/runs/abc",
        metrics={"eval/accuracy": 0.75, "train/loss": 0.1, "round/policy_version": 4.0},
        checks=checks[:1],
    )
    return Outcome(**{**base, **kw})


def test_the_outcome_passes_only_when_the_run_succeeded_in_time_and_met_every_requirement():
    assert outcome().ok and outcome().failure() == ""
    failed = outcome(state="FAILED", error="task train failed")
    assert not failed.ok
    assert failed.failure() == "run run-1 ended FAILED: task train failed (https://kf.example/pipeline/#/runs/details/run-1)"
    timed_out = outcome(state="RUNNING", timed_out=True)
    assert not timed_out.ok and timed_out.failure().startswith("run run-1 still RUNNING when --timeout ran out; it keeps running")
    lost = outcome(state="RUNNING", error="stopped following it: cannot reach the KFP API")
    assert lost.failure() == "run run-1 (RUNNING): stopped following it: cannot reach the KFP API"
    missed = outcome(
        checks=check_requirements([parse_requirement("eval/accuracy>=0.6"), parse_requirement("eval/recall>0")], {"eval/accuracy": 0.75})
    )
    assert missed.failure() == "run run-1 SUCCEEDED, but 1 of 2 requirement(s) failed: eval/recall>0: no metric eval/recall in the run"
    submitted = outcome(state=gate.NOT_FOLLOWED, checks=[])
    assert submitted.ok and submitted.verdict == "not checked (submitted without --wait)"


def test_the_json_outcome_has_links_results_and_each_requirement():
    data = outcome_dict(outcome(checks=[Check(Requirement("eval/accuracy", ">=", 0.8), 0.75, False)]))
    assert data["ok"] is False and data["state"] == "SUCCEEDED"
    assert data["kfp_run_url"].endswith("/runs/details/run-1") and data["mlflow_run_url"].endswith("/runs/abc")
    assert data["results"] == {"eval/accuracy": 0.75}  # held-out metrics and required ones; all metrics under "metrics"
    assert data["metrics"]["train/loss"] == 0.1
    assert data["requirements"] == [
        {"requirement": "eval/accuracy>=0.8", "metric": "eval/accuracy", "op": ">=", "threshold": 0.8, "value": 0.75, "passed": False}
    ]


def test_the_markdown_outcome_links_both_runs_and_tables_results_and_requirements():
    text = outcome_markdown(outcome(checks=[Check(Requirement("eval/accuracy", ">=", 0.8), 0.75, False)], notes=["a|b"]))
    assert text.startswith("## Tidal run [run-1](https://kf.example/pipeline/#/runs/details/run-1): SUCCEEDED\n")
    assert "\nGate: **FAILED**: run run-1 SUCCEEDED, but 1 of 1 requirement(s) failed: eval/accuracy>=0.8: 0.75, NOT met\n" in text
    assert "MLflow run: [abc](https://kf.example/mlflow/#/experiments/1/runs/abc)" in text
    assert "| eval/accuracy | 0.75 |" in text and "train/loss" not in text
    assert "| `eval/accuracy>=0.8` | 0.75 | **FAIL** |" in text
    assert "- a\\|b" in text
    plain = outcome_markdown(outcome(mlflow_run_id="", kfp_run_url=""))
    assert plain.startswith("## Tidal run `run-1`: SUCCEEDED\n\nGate: **passed**\n") and "MLflow run" not in plain and "| pass |" in plain


# ---------------------------------------------------------------- following a run (a scripted clock, no waiting)


class Script:
    """The states a run answers in turn, and a clock that moves only when the follower sleeps."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.now = 0.0
        self.slept: list[float] = []
        self.said: list[str] = []

    def read(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    def follow(self, timeout_s=None, poll_s=10.0):
        return follow_run(self.read, timeout_s, poll_s, self.said.append, clock=lambda: self.now, sleep=self.sleep)


def test_following_says_each_state_once_and_stops_at_a_final_one():
    script = Script([("PENDING", ""), ("RUNNING", ""), ("RUNNING", ""), ("FAILED", "task train failed")])
    followed = script.follow()
    assert (followed.state, followed.error, followed.timed_out) == ("FAILED", "task train failed", False)
    assert script.said == ["PENDING", "RUNNING", "FAILED"] and script.slept == [10.0, 10.0, 10.0]


def test_following_stops_at_the_timeout_with_a_last_look_at_the_deadline():
    script = Script([("RUNNING", "")])
    followed = script.follow(timeout_s=25.0)
    assert (followed.state, followed.timed_out) == ("RUNNING", True)
    assert script.slept == [10.0, 10.0, 5.0]


def test_a_transient_api_failure_is_asked_again_and_a_lasting_one_ends_the_following():
    blip = KfpApiError("cannot reach the KFP API at http://kfp (connection refused): check ...", transient=True)
    script = Script([("RUNNING", ""), blip, blip, ("SUCCEEDED", "")])
    assert script.follow().state == "SUCCEEDED"
    assert script.said[1].startswith("cannot reach the KFP API") and script.said[-1] == "SUCCEEDED"
    down = Script([("RUNNING", ""), blip])
    followed = down.follow()
    assert followed.state == "RUNNING" and followed.error.startswith("stopped following it: cannot reach the KFP API")
    assert len(down.slept) == 1 + 4  # five failed polls in a row
    refused = Script([("RUNNING", ""), KfpApiError("the KFP API at http://kfp answered HTTP 404 Not Found when reading run x")])
    assert "HTTP 404" in refused.follow().error and len(refused.slept) == 1


# ---------------------------------------------------------------- KFP API errors as one line (pure)


@pytest.mark.parametrize(
    ("status", "reason", "says", "transient"),
    [
        (401, "Unauthorized", "HTTP 401 Unauthorized when creating the run (token expired): check KFP_TOKEN or KF_PIPELINES_SA_TOKEN_PATH", False),
        (403, "Forbidden", "HTTP 403 Forbidden when creating the run (token expired): check that the token's identity may use", False),
        (404, "Not Found", "HTTP 404 Not Found when creating the run (token expired): check --host / KFP_HOST: the API's base URL", False),
        (503, "Service Unavailable", "HTTP 503 Service Unavailable when creating the run (token expired): the KFP API server failed", True),
        (
            0,
            "SSLError(certificate verify failed)",
            "cannot reach the KFP API at http://kfp (SSLError(certificate verify failed)): check --host",
            False,
        ),
    ],
)
def test_an_http_error_of_the_kfp_api_is_one_line_with_its_status(status, reason, says, transient):
    err = api_status_error("http://kfp", "creating the run", status, reason, b'{"error": "x", "code": 16, "message": "token\\nexpired"}')
    assert says in str(err) and "\n" not in str(err) and err.transient is transient


def test_the_reason_a_host_is_unreachable_is_the_sockets_own():
    import urllib3

    try:
        urllib3.PoolManager(retries=False).request("GET", f"http://127.0.0.1:{free_port()}/")
    except urllib3.exceptions.HTTPError as err:
        assert unreachable_reason(err) == "connection refused"
    else:
        pytest.fail("a port with nothing listening answered")


# ---------------------------------------------------------------- the stand-in KFP API server


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInKfpApi:
    """Stands in for the KFP API server (v2beta1): health, experiments, creating a run from a pipeline
    package, reading a run. ``states``: what each read of a run answers in turn, then the last again;
    ``rounds``: the held-out metrics each round's evaluate logs; ``refuse``: answer every call with this
    HTTP status instead."""

    def __init__(self, root: Path, states=("PENDING", "RUNNING", "SUCCEEDED"), rounds=(), error="", refuse=0):
        self.root, self.states, self.rounds, self.error, self.refuse = root, list(states), list(rounds), error, refuse
        self.reads: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.failures: list[str] = []

    def play(self, run_id: str, body: dict) -> None:
        """What the pipeline does to MLflow, with its own functions, from the parameters the run was created with."""
        spec = body["pipeline_spec"]["pipeline_spec"]
        defaults = {k: p.get("defaultValue") for k, p in spec["root"]["inputDefinitions"]["parameters"].items()}
        params = {**defaults, **body["runtime_config"]["parameters"]}
        run = RunDir(self.root / run_id)
        StepRecords(run).create()
        knobs = PipelineKnobs(
            rounds=int(params["rounds"]),
            iterations_per_round=int(params["iterations_per_round"]),
            rollout_workers=int(params["rollout_workers"]),
            tracking_uri=params["tracking_uri"],
        )
        staged = stage_config(run, params["config_yaml"], "", knobs.config_overrides())
        links = RunLinks(kfp_ui_url=params["kfp_ui_url"], mlflow_ui_url=params["mlflow_ui_url"])
        open_parent_run(run, staged, run_id, links)
        for round_index, metrics in enumerate(self.rounds):
            log_to_parent_run(run, metrics={"round/policy_version": float(round_index + 1)}, step=round_index)
            log_to_parent_run(run, metrics={f"eval/{k}": v for k, v in metrics.items()}, step=round_index)
        end_parent_run(run, succeeded=self.states[-1] == "SUCCEEDED")

    def answer(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        self.calls.append((method, path))
        if self.refuse:
            return self.refuse, {"error": "refused", "code": 16, "message": "the stand-in refuses every call"}
        if path == "/apis/v2beta1/healthz":
            return 200, {"commit_sha": "0123abc", "tag_name": "2.17.0", "multi_user": False}  # as KFP 2.x answers
        if method == "GET" and path == "/apis/v2beta1/experiments":
            return 200, {"experiments": []}
        if method == "POST" and path == "/apis/v2beta1/experiments":
            return 200, {"experiment_id": "exp-1", "display_name": body["display_name"]}
        if method == "POST" and path == "/apis/v2beta1/runs":
            run_id = str(uuid.uuid4())
            self.play(run_id, body)
            self.reads[run_id] = 0
            return 200, {"run_id": run_id, "experiment_id": body["experiment_id"], "display_name": body["display_name"], "state": "PENDING"}
        run_id = path.removeprefix("/apis/v2beta1/runs/")
        if method == "GET" and run_id in self.reads:
            state = self.states[min(self.reads[run_id], len(self.states) - 1)]
            self.reads[run_id] += 1
            run = {"run_id": run_id, "experiment_id": "exp-1", "display_name": "tidal", "state": state}
            if state == "FAILED" and self.error:
                run["error"] = {"code": 2, "message": self.error}
            return 200, run
        return 404, {"error": "not found", "code": 5, "message": f"no {path}"}

    def handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                try:
                    status, payload = stand_in.answer(self.command, self.path.split("?")[0], body)
                except Exception as err:  # the test names it instead of a silent 500
                    stand_in.failures.append(f"{type(err).__name__}: {err}")
                    status, payload = 500, {"message": str(err)}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args):
                pass

        return Handler


@pytest.fixture
def stand_in(tmp_path):
    """Start a stand-in with the given behaviour; yields (its URL, it)."""
    servers = []

    def start(**behaviour):
        api = StandInKfpApi(tmp_path / "volume", **behaviour)
        server = ThreadingHTTPServer(("127.0.0.1", 0), api.handler())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}", api

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """One sqlite store for the module's runs, each found by its own KFP run id."""
    from tidal.tracking import seed_sqlite_store

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    seed_sqlite_store(db)
    return f"sqlite:///{db}"


@pytest.fixture
def config(tmp_path, tiny_config_dict) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**tiny_config_dict, "tracking": {"experiment": "ci-gate"}}))
    return path


def submit(*args, env_extra=None, drop=("KFP_HOST", "KFP_TOKEN", "KFP_NAMESPACE", "MLFLOW_TRACKING_URI", "GITHUB_STEP_SUMMARY")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tidal.cli", "submit", *map(str, args)], capture_output=True, text=True, env=env, timeout=600)


TWO_ROUNDS = ({"accuracy": 0.25, "sampled_accuracy": 0.375}, {"accuracy": 0.75, "sampled_accuracy": 0.625})


# ---------------------------------------------------------------- refusals: one line


def test_an_unreachable_kfp_api_is_one_line_naming_the_host(config):
    host = f"http://127.0.0.1:{free_port()}"
    result = submit(config, "--host", host)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tidal submit: cannot reach the KFP API at {host} (connection refused): check --host / KFP_HOST and that the API is reachable"
    ]
    assert result.stdout == ""


@pytest.mark.parametrize(("namespace", "when"), [("", "checking its health"), ("team-a", "reading its version")])
def test_a_kfp_api_that_refuses_is_one_line_with_the_status_with_a_stand_in_api_server(stand_in, config, namespace, when):
    host, api = stand_in(refuse=401)
    result = submit(config, "--host", host, env_extra={"KFP_NAMESPACE": namespace, "KFP_TOKEN": "stale"} if namespace else {})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"tidal submit: the KFP API at {host} answered HTTP 401 Unauthorized when {when} (the stand-in refuses every call): "
        "check KFP_TOKEN or KF_PIPELINES_SA_TOKEN_PATH (a valid, unexpired token)"
    ]
    assert len(api.calls) == 1  # asked once, not retried


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--wait", "--require", "eval/accuracy=>0.6"], "--require 'eval/accuracy=>0.6': expected METRIC OP NUMBER"),
        (["--require", "eval/accuracy>=0.6"], "--require need(s) --wait"),
        (["--wait", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["--wait", "--require", "eval/accuracy>=0.6"], "--require reads the run's final metrics from its MLflow run: pass --tracking-uri"),
    ],
)
def test_gate_options_are_checked_before_anything_is_submitted_with_a_stand_in_api_server(stand_in, config, args, says, monkeypatch, capsys):
    from tidal import cli

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    host, api = stand_in()
    assert cli.main(["submit", str(config), "--host", host, *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"tidal submit: {says}")
    assert api.calls == []


# ---------------------------------------------------------------- --wait: the gate


def test_wait_with_met_requirements_exits_0_and_writes_the_outcome_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in(rounds=TWO_ROUNDS)
    out, step_summary = tmp_path / "out" / "outcome.json", tmp_path / "step-summary.md"
    step_summary.write_text("earlier step\n")
    result = submit(
        config, "--host", host, "-p", "rounds=2", "-p", "iterations_per_round=1", "-p", f"tracking_uri={mlflow_store}",
        "-p", "mlflow_ui_url=https://kf.example/mlflow/",
        "--wait", "--poll-seconds", "0.05", "--tracking-uri", mlflow_store, "--json", out,
        "--require", "eval/accuracy>=0.5", "--require", "eval/sampled_accuracy > 0.6", "--require", "round/policy_version==2",
        env_extra={"GITHUB_STEP_SUMMARY": str(step_summary)},
    )  # fmt: skip
    assert api.failures == []
    assert result.returncode == 0, result.stdout + result.stderr
    (run_id,) = api.reads
    lines = result.stdout.splitlines()
    assert lines[0] == f"{host}/#/runs/details/{run_id}"
    assert lines[1:4] == [f"run {run_id}: PENDING", f"run {run_id}: RUNNING", f"run {run_id}: SUCCEEDED"]
    assert "eval/accuracy>=0.5: 0.75, met" in lines and lines[-1] == f"tidal submit: run {run_id} SUCCEEDED; 3 requirement(s) met"

    data = json.loads(out.read_text())
    assert (data["run_id"], data["state"], data["ok"]) == (run_id, "SUCCEEDED", True)
    assert data["results"] == {"eval/accuracy": 0.75, "eval/sampled_accuracy": 0.625, "round/policy_version": 2.0}  # the last round's
    assert [(r["requirement"], r["passed"]) for r in data["requirements"]] == [
        ("eval/accuracy>=0.5", True), ("eval/sampled_accuracy > 0.6", True), ("round/policy_version==2", True)
    ]  # fmt: skip
    assert data["kfp_run_url"] == f"{host}/#/runs/details/{run_id}"
    assert data["mlflow_run_url"].startswith("https://kf.example/mlflow/#/experiments/") and data["mlflow_run_url"].endswith(
        f"/runs/{data['mlflow_run_id']}?workflowType=machine_learning"
    )

    summary = step_summary.read_text()  # appended to, not replaced
    assert summary.startswith("earlier step\n## Tidal run [") and ": SUCCEEDED\n\nGate: **passed**\n" in summary
    assert "| eval/accuracy | 0.75 |" in summary and "| `eval/sampled_accuracy > 0.6` | 0.625 | pass |" in summary


def test_wait_with_a_missed_requirement_exits_1_and_the_outcome_names_it_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in(rounds=TWO_ROUNDS)
    out, summary = tmp_path / "outcome.json", tmp_path / "summary.md"
    step_summary = tmp_path / "step-summary.md"
    result = submit(
        config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--wait", "--poll-seconds", "0.05",
        "--json", out, "--summary", summary, "--require", "eval/accuracy>=0.5", "--require", "eval/sampled_accuracy>=0.7",
        env_extra={"MLFLOW_TRACKING_URI": mlflow_store, "GITHUB_STEP_SUMMARY": str(step_summary)},
    )  # fmt: skip
    assert api.failures == []
    assert result.returncode == 1, result.stdout + result.stderr
    (run_id,) = api.reads
    assert result.stderr.splitlines() == [
        f"tidal submit: run {run_id} SUCCEEDED, but 1 of 2 requirement(s) failed: eval/sampled_accuracy>=0.7: 0.625, NOT met"
    ]
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["state"] == "SUCCEEDED"
    assert [(r["requirement"], r["value"], r["passed"]) for r in data["requirements"]] == [
        ("eval/accuracy>=0.5", 0.75, True), ("eval/sampled_accuracy>=0.7", 0.625, False)
    ]  # fmt: skip
    text = summary.read_text()
    assert "| `eval/sampled_accuracy>=0.7` | 0.625 | **FAIL** |" in text and "| `eval/accuracy>=0.5` | 0.75 | pass |" in text
    assert not step_summary.exists()  # --summary given: the step summary is left alone


def test_a_metric_the_run_does_not_have_fails_naming_it_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in(rounds=TWO_ROUNDS[:1])
    result = submit(
        config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--wait", "--poll-seconds", "0.05",
        "--tracking-uri", mlflow_store, "--require", "eval/recall>=0.5",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (run_id,) = api.reads
    assert result.stderr.splitlines() == [
        f"tidal submit: run {run_id} SUCCEEDED, but 1 of 1 requirement(s) failed: eval/recall>=0.5: no metric eval/recall in the run"
    ]


def test_requirements_on_a_store_without_the_run_fail_naming_the_store_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    from tidal.tracking import seed_sqlite_store

    elsewhere = tmp_path / "other.db"
    seed_sqlite_store(elsewhere)
    host, api = stand_in(rounds=TWO_ROUNDS)
    result = submit(
        config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--wait", "--poll-seconds", "0.05",
        "--tracking-uri", f"sqlite:///{elsewhere}", "--require", "eval/accuracy>=0.5",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (run_id,) = api.reads
    assert result.stderr.splitlines() == [
        f"tidal submit: run {run_id} (SUCCEEDED): no MLflow run tagged kfp.run_id={run_id} at sqlite:///{elsewhere}: the run's metrics were not read"
    ]


def test_a_failed_run_exits_1_with_kfps_message_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in(states=["RUNNING", "FAILED"], rounds=TWO_ROUNDS[:1], error="task 'train' failed: OOMKilled")
    out = tmp_path / "outcome.json"
    result = submit(
        config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--wait", "--poll-seconds", "0.05",
        "--tracking-uri", mlflow_store, "--json", out, "--require", "eval/accuracy>=0.1",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (run_id,) = api.reads
    assert result.stderr.splitlines() == [f"tidal submit: run {run_id} ended FAILED: task 'train' failed: OOMKilled ({host}/#/runs/details/{run_id})"]
    data = json.loads(out.read_text())
    assert (data["state"], data["ok"], data["error"]) == ("FAILED", False, "task 'train' failed: OOMKilled")
    assert data["requirements"][0]["passed"] is True  # the metrics are read all the same: they say how far it got


def test_a_run_that_outlives_the_timeout_exits_1_and_keeps_running_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in(states=["RUNNING"])
    out = tmp_path / "outcome.json"
    result = submit(
        config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--wait", "--timeout", "0.2", "--poll-seconds", "0.05", "--json", out
    )
    assert result.returncode == 1, result.stdout + result.stderr
    (run_id,) = api.reads
    assert result.stderr.splitlines() == [
        f"tidal submit: run {run_id} still RUNNING when --timeout ran out; it keeps running: {host}/#/runs/details/{run_id}"
    ]
    data = json.loads(out.read_text())
    assert (data["state"], data["timed_out"], data["ok"]) == ("RUNNING", True, False)
    assert data["notes"] == ["no MLflow tracking URI (--tracking-uri or MLFLOW_TRACKING_URI): the run's metrics were not read"]


def test_without_wait_the_outcome_is_the_submitted_run_with_a_stand_in_api_server(stand_in, config, mlflow_store, tmp_path):
    host, api = stand_in()
    out = tmp_path / "outcome.json"
    result = submit(config, "--host", host, "-p", f"tracking_uri={mlflow_store}", "--json", out)
    assert result.returncode == 0, result.stderr
    assert api.reads == {next(iter(api.reads)): 0}  # created, never read
    data = json.loads(out.read_text())
    assert (data["state"], data["ok"], data["requirements"]) == ("SUBMITTED", True, [])

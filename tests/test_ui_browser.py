"""`tidal ui` on a finished short run, as a user opens it: the MLflow server answers, its REST API
holds every per-iteration metric of metrics.jsonl at its iteration's step, and the run page renders
the metric charts in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium), in the UI's model-training view (not its GenAI one). Screenshots land in the pytest tmp
dir and in test-artifacts/ (git-ignored) at the repo root.

A missing browser is a failure, not a skip: .ci/run installs it; as root with apt-get the test
installs it itself."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, read_jsonl, run_cli
from tidal.tracking import NOT_LOGGED, mlflow_metric_name

ARTIFACTS = ROOT / "test-artifacts"
BROWSER_PACKAGES = ["chromium", "chromium-driver"]


def find_browser() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def ensure_browser() -> tuple[str, str]:
    chromium, driver = find_browser()
    if not (chromium and driver) and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *BROWSER_PACKAGES]
        if subprocess.run(cmd, capture_output=True, env=env, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
            subprocess.run(cmd, capture_output=True, env=env, timeout=900)
        chromium, driver = find_browser()
    if not (chromium and driver):
        pytest.fail("the browser test needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver (.ci/run does)")
    return chromium, driver


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_config_dict) -> Path:
    """A finished 3-iteration periodic run without held-out eval."""
    tmp = tmp_path_factory.mktemp("ui-run")
    data = copy.deepcopy(tiny_config_dict)
    data["eval"]["enabled"] = False
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp / "run"
    proc = run_cli("run", str(config), "--run-dir", str(run_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


class UiServer:
    """`tidal ui RUN_DIR` in a subprocess: its printed URLs, stopped like Ctrl-C at the end."""

    def __init__(self, args: list[str], log: Path):
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "ui", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def url(self, label: str, timeout: float = 180) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in self.lines:
                if line.strip().startswith(label + " "):
                    return line.split()[-1]
            assert self.proc.poll() is None, f"tidal ui exited with {self.proc.returncode}: {self.lines}"
            time.sleep(0.2)
        raise AssertionError(f"tidal ui printed no `{label}` URL within {timeout}s: {self.lines}")

    def stop(self) -> int:
        self.proc.send_signal(2)  # SIGINT, as Ctrl-C
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def ui(finished_run, tmp_path_factory):
    server = UiServer([str(finished_run)], tmp_path_factory.mktemp("ui-log") / "tidal-ui.log")
    try:
        yield server
    finally:
        assert server.stop() == 0
        assert server.proc.returncode == 0


def rest(base: str, endpoint: str, **params) -> dict:
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}", timeout=30) as resp:
        return json.loads(resp.read())


def test_ui_prints_the_run_page_on_loopback(ui, finished_run):
    summary = json.loads((finished_run / "summary.json").read_text())
    url = ui.url("open")
    parsed = urllib.parse.urlsplit(url)
    assert parsed.scheme == "http" and parsed.hostname == "127.0.0.1" and parsed.port
    page, _, query = parsed.fragment.partition("?")
    assert page.startswith("/experiments/") and page.endswith(f"/runs/{summary['mlflow_run_id']}")
    assert query == "workflowType=machine_learning"  # the UI's model-training view
    with urllib.request.urlopen(f"http://127.0.0.1:{parsed.port}/health", timeout=10) as resp:
        assert resp.status == 200


def test_every_per_iteration_metric_is_in_the_store_at_its_step(ui, finished_run):
    """Through the server's REST API, as any MLflow client would read it."""
    summary = json.loads((finished_run / "summary.json").read_text())
    parsed = urllib.parse.urlsplit(ui.url("open"))
    base = f"http://127.0.0.1:{parsed.port}"
    run = rest(base, "runs/get", run_id=summary["mlflow_run_id"])["run"]
    assert run["info"]["status"] == "FINISHED"
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    assert tags["mode"] == "periodic" and tags["tidal.run_dir"] == str(finished_run.resolve()) and tags["model"] == "tiny"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["trainer.iterations"] == "3" and params["mode"] == "periodic"
    experiment = rest(base, "experiments/get", experiment_id=run["info"]["experiment_id"])["experiment"]
    assert {t["key"]: t["value"] for t in experiment.get("tags", [])}.get("mlflow.experimentKind") == "custom_model_development"
    lines = read_jsonl(finished_run / "metrics.jsonl")
    assert [line["iteration"] for line in lines] == [0, 1, 2]
    keys = sorted({k for line in lines for k in line} - NOT_LOGGED)
    assert "reward_mean" in keys and "generate_seconds" in keys
    missing = []
    for key in keys:
        history = rest(base, "metrics/get-history", run_id=summary["mlflow_run_id"], metric_key=mlflow_metric_name(key)).get("metrics", [])
        stored = {m["step"]: m["value"] for m in history}
        for line in lines:
            value = line.get(key)
            if value is None or not math.isfinite(float(value)):
                continue
            step = line["iteration"]
            if step not in stored or not math.isclose(float(stored[step]), float(value), rel_tol=1e-9, abs_tol=1e-12):
                missing.append(f"{key}@{step}: file {value}, store {stored.get(step)}")
    assert not missing, missing


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = ensure_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1200"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=options)
    drv.set_page_load_timeout(120)
    try:
        yield drv
    finally:
        drv.quit()


def save_screenshot(drv, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    assert drv.save_screenshot(str(path)), f"no screenshot {path}"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(path, ARTIFACTS / name)
    return path


GENAI_PAGES = ("Evaluations", "Evaluation runs", "Judges", "Prompts & versions")
"""What MLflow's GenAI view shows (a run page under "Evaluations", the GenAI pages in the sidebar) and its
model-training view does not. The view is the sidebar's GenAI / Model training switch, which starts on
GenAI unless the page's address names the other."""


def assert_model_training_view(drv) -> None:
    from selenium.webdriver.common.by import By

    body = drv.find_element(By.TAG_NAME, "body").text
    shown = [page for page in GENAI_PAGES if page in body]
    assert not shown, f"the GenAI view: {shown}"
    assert "Model registry" in body  # the sidebar's model-training pages: Runs, Models, Traces, Model registry
    assert "workflowType=machine_learning" in drv.current_url, drv.current_url  # and it stays so as the user clicks on


def test_the_run_page_renders_the_reward_chart_in_chromium(ui, browser, finished_run, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 90, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,))
    # The run page's overview: status, tags, and the table of metrics with their names.
    browser.get(ui.url("open"))
    wait.until(lambda d: "reward_mean" in d.find_element(By.TAG_NAME, "body").text)
    body = browser.find_element(By.TAG_NAME, "body").text
    for name in ("reward_mean", "accuracy", "generate_seconds", "train_seconds", "staleness_max"):
        assert name in body, name
    assert "Finished" in body and "periodic" in body
    assert "rollout/reward_mean" in body and "time/generate_seconds" in body and "train/policy_loss" in body  # grouped names
    assert_model_training_view(browser)
    save_screenshot(browser, tmp_path, "ui-run-overview.png")

    # The metric charts: filtered to the reward, wait until plotly has drawn its line.
    browser.get(ui.url("charts"))
    search = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[placeholder*='Search metric']")))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"))
    search.send_keys("reward_mean")

    def reward_chart_drawn(d) -> bool:  # in the page (JS): the charts re-render while the filter applies
        drawn = d.execute_script(
            "return Array.from(document.querySelectorAll('.js-plotly-plot'))"
            ".filter(c => c.offsetParent !== null && c.querySelector('g.scatterlayer path.js-line, g.scatterlayer path.point'))"
            ".map(c => (c.closest('[data-testid]') || c.parentElement.parentElement.parentElement).innerText).join(' ')"
        )
        return "reward_mean" in drawn

    wait.until(reward_chart_drawn)
    time.sleep(1)  # let the chart's transition finish before the screenshot
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "reward_mean" in body and "Step" in body
    assert_model_training_view(browser)
    path = save_screenshot(browser, tmp_path, "ui-run-reward-chart.png")
    assert path.stat().st_size > 10_000


@pytest.fixture(scope="module")
def bench_store(tmp_path_factory, tiny_config_dict) -> str:
    """`tidal bench modes` (sync and periodic, 2 iterations) logging both runs to one experiment."""
    tmp = tmp_path_factory.mktemp("bench-modes")
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(copy.deepcopy(tiny_config_dict)))
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    args = ["--config", str(config), "--iterations", "2", "--warmup", "1", "--no-eval", "--systems", "sync,periodic", "--tracking-uri", uri]
    proc = run_cli("bench", "modes", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"tidal ui --tracking-uri {uri} --experiment tidal-bench-modes" in proc.stdout
    return uri


def test_bench_modes_runs_sit_side_by_side_in_the_compare_view(bench_store, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = UiServer(["--tracking-uri", bench_store, "--experiment", "tidal-bench-modes"], tmp_path / "tidal-ui.log")
    try:
        base = "http://127.0.0.1:" + str(urllib.parse.urlsplit(server.url("open")).port)
        exp_id = rest(base, "experiments/get-by-name", experiment_name="tidal-bench-modes")["experiment"]["experiment_id"]
        runs = rest_post(base, "runs/search", {"experiment_ids": [exp_id]})["runs"]
        tags = [{t["key"]: t["value"] for t in r["data"]["tags"]} for r in runs]
        assert sorted(t["system"] for t in tags) == ["periodic", "sync"]
        assert all(t["mode"] == t["system"] and t["bench"] == "modes" for t in tags)
        assert len({t["bench.invocation"] for t in tags}) == 1

        wait = WebDriverWait(browser, 90, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,))
        browser.get(server.url("compare"))

        def both_runs_charted(d) -> bool:
            drawn = d.execute_script(
                "return Array.from(document.querySelectorAll('.js-plotly-plot'))"
                ".filter(c => c.querySelectorAll('g.scatterlayer g.trace').length >= 2).length"
            )
            text = d.find_element(By.TAG_NAME, "body").text
            return drawn > 0 and "sync" in text and "periodic" in text  # a chart with both runs' lines

        wait.until(both_runs_charted)
        search = browser.find_element(By.CSS_SELECTOR, "input[placeholder*='Search metric']")
        search.send_keys("seconds")
        wait.until(lambda d: "periodic (time/iteration_seconds)" in d.find_element(By.TAG_NAME, "body").text)
        time.sleep(1)
        body = browser.find_element(By.TAG_NAME, "body").text
        assert "sync (time/iteration_seconds)" in body and "2 matching runs" in body
        assert_model_training_view(browser)
        save_screenshot(browser, tmp_path, "ui-bench-modes-compare.png")
    finally:
        assert server.stop() == 0


def rest_post(base: str, endpoint: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())

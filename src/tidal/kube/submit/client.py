"""Submit the pipeline to Kubeflow Pipelines with ``kfp.Client`` (CI-triggered runs).

Where the client finds the server and its credentials (nothing is ever read from code or config files):

- ``--host`` or ``KFP_HOST``: the KFP API endpoint, e.g. ``https://kubeflow.example.com/pipeline``.
- ``KFP_TOKEN``: a bearer token (an OIDC ID token, or ``kubectl create token``), sent as ``Authorization``.
- ``KF_PIPELINES_SA_TOKEN_PATH``: a projected service-account token file, re-read when it rotates
  (in-cluster CI runners; KFP's own convention).
- ``KFP_NAMESPACE``: the Kubeflow profile namespace to run in (multi-user KFP).
- ``KFP_SSL_CA_CERT``: a CA bundle for a private TLS endpoint.
- ``KFP_UI_HOST``: where the run's link should point, if the UI is not at ``host``.

``--wait`` follows the run to its end and reads its final metrics from its MLflow parent run (found by
its ``kfp.run_id`` tag) on ``--tracking-uri`` or ``MLFLOW_TRACKING_URI`` (MLflow's own variables, such as
``MLFLOW_TRACKING_TOKEN``, give its credentials). MLflow, not KFP, because KFP's API does not serve
the values of a run's metrics artifact, and the run directory lies on the cluster's volume.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.kube import cluster
from tidal.kube.pipeline.definition import compile_pipeline
from tidal.kube.submit.gate import FINAL_STATES, NOT_FOLLOWED, Outcome, Requirement, check_requirements, outcome_dict, outcome_markdown


class SubmitError(RuntimeError):
    """Submission cannot start: what is missing is named in the message."""


class KfpApiError(SubmitError):
    """A call to the KFP API failed; ``transient``: worth asking again (unreachable, or a 5xx)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


CHECK_HOST = "check --host / KFP_HOST and that the API is reachable"
STATUS_HINTS = {
    401: "check KFP_TOKEN or KF_PIPELINES_SA_TOKEN_PATH (a valid, unexpired token)",
    403: "check that the token's identity may use the profile namespace (KFP_NAMESPACE)",
    404: "check --host / KFP_HOST: the API's base URL, e.g. https://kubeflow.example.com/pipeline",
}


@contextlib.contextmanager
def kfp_api_calls(host: str, what: str) -> Iterator[None]:
    """The KFP client's errors (a traceback chain through urllib3, or an ApiException whose text holds the
    response headers and body) become one :class:`KfpApiError` line naming the host and what to check."""
    import kfp_server_api
    import urllib3

    try:
        yield
    except kfp_server_api.ApiException as err:
        raise api_status_error(host, what, err.status, err.reason, err.body) from None
    except (urllib3.exceptions.HTTPError, ConnectionError) as err:
        raise KfpApiError(f"cannot reach the KFP API at {host} ({unreachable_reason(err)}): {CHECK_HOST}", transient=True) from None


def api_status_error(host: str, what: str, status: int | None, reason: str | None, body: Any = None) -> KfpApiError:
    if not status:  # the client's own failure before any answer (TLS, a bad URL)
        return KfpApiError(f"cannot reach the KFP API at {host} ({one_line(reason)}): {CHECK_HOST}")
    said = api_message(body)
    answer = f"the KFP API at {host} answered HTTP {status} {reason or ''}".rstrip() + f" when {what}" + (f" ({said})" if said else "")
    if status >= 500:
        return KfpApiError(f"{answer}: the KFP API server failed; see its logs", transient=True)
    return KfpApiError(f"{answer}: {STATUS_HINTS.get(status, CHECK_HOST)}")


def api_message(body: Any) -> str:
    """The ``message`` of a KFP error body (JSON), on one line; empty if there is none."""
    try:
        text = body.decode() if isinstance(body, bytes) else str(body or "")
        message = json.loads(text).get("message", "") if text.lstrip().startswith("{") else ""
    except (ValueError, AttributeError):
        return ""
    return one_line(message)


def unreachable_reason(err: BaseException) -> str:
    """The socket's own words (``connection refused``, ``name or service not known``) from urllib3's chain of errors."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        reason = getattr(current, "reason", None)
        current = reason if isinstance(reason, BaseException) else current.__cause__ or current.__context__
    for link in chain:
        if isinstance(link, OSError) and link.strerror:
            return link.strerror.lower()
    return one_line(chain[-1]) or type(chain[-1]).__name__


def one_line(text: Any, limit: int = 300) -> str:
    words = " ".join(str(text or "").split())
    return words if len(words) <= limit else words[: limit - 3] + "..."


@dataclass(frozen=True)
class SubmittedRun:
    run_id: str
    url: str
    client: Any = field(default=None, repr=False, compare=False)  # the kfp.Client that submitted it, to follow it


def kfp_host(host: str | None) -> str:
    resolved = host or os.environ.get("KFP_HOST", "")
    if not resolved:
        raise SubmitError("no KFP endpoint: pass --host URL or set KFP_HOST")
    return resolved.rstrip("/")


def kfp_client_from_env(host: str | None = None) -> Any:
    """A ``kfp.Client`` for ``host`` with credentials taken only from the environment."""
    import kfp
    from kfp.client import ServiceAccountTokenVolumeCredentials

    token = os.environ.get("KFP_TOKEN") or None
    token_path = os.environ.get("KF_PIPELINES_SA_TOKEN_PATH")
    credentials = None
    if token is None and token_path:
        if not Path(token_path).is_file():
            raise SubmitError(f"KF_PIPELINES_SA_TOKEN_PATH={token_path} does not exist")
        credentials = ServiceAccountTokenVolumeCredentials(path=token_path)
    resolved = kfp_host(host)

    class Client(kfp.Client):
        """Asks the API's health once: kfp.Client retries an HTTP error five times, five seconds apart, logging
        a traceback each time, before it raises."""

        def get_kfp_healthz(self, sleep_duration: int = 5):
            return self._healthz_api.healthz_service_get_healthz()

    with warnings.catch_warnings(), kfp_api_calls(resolved, "checking its health"):
        warnings.filterwarnings("ignore", message="This client only works with Kubeflow Pipeline", category=FutureWarning)
        return Client(
            host=resolved,
            existing_token=token,
            credentials=credentials,
            namespace=os.environ.get("KFP_NAMESPACE") or "kubeflow",
            ssl_ca_cert=os.environ.get("KFP_SSL_CA_CERT") or None,
        )


def pipeline_arguments(config_path: str, params: dict[str, Any]) -> dict[str, Any]:
    """The config file's text, with its data paths as the pipeline's pods see them, becomes
    ``config_yaml``; ``params`` set any other pipeline parameter."""
    path = Path(config_path)
    if not path.is_file():
        raise SubmitError(f"config file not found: {path}")
    from tidal.config import ConfigError, load_config

    try:
        config = load_config(path)
    except ConfigError as err:
        raise SubmitError(str(err)) from None
    from tidal.kube import cluster
    from tidal.kube.steps.staging import served_reward_problem

    problem = served_reward_problem(config, set(cluster.REWARD_SECRET_ENV.values()))  # what prepare would refuse, before submitting
    if problem:
        raise SubmitError(problem)
    return {"config_yaml": config_text_for_pods(path), **params}


IMAGE_PROJECT_ROOT = "/opt/tidal"
"""Where the images copy the project (images/*/Dockerfile: ``COPY examples /opt/tidal/examples``)."""
IMAGE_FOLDERS = ("examples",)
DATA_PATH_KEYS = ("path", "eval_path")


def config_text_for_pods(path: Path) -> str:
    """The config's text with each relative data path replaced by where the pods find that file.

    Config text has no folder on the cluster: a relative ``data.path`` would resolve against the
    prepare pod's working directory. A relative path names a file next to the config on this
    machine; if that file is in one of the project folders the image carries (``examples/``), it
    becomes the image's path (``/opt/tidal/examples/...``). Any other local file cannot reach the
    pods, so submission stops with what to do instead. Absolute paths are left as they are: they
    must exist in the image or on the data volume, which the prepare step checks.
    """
    import yaml

    text = path.read_text()
    document = yaml.safe_load(text) or {}
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, dict):
        return text
    changed = {}
    for key in DATA_PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str) and not Path(value).is_absolute():
            changed[key] = image_path_of(path.parent / value, f"data.{key}", value)
    if not changed:
        return text
    return yaml.safe_dump({**document, "data": {**data, **changed}}, sort_keys=False)


def image_path_of(local: Path, key: str, value: str) -> str:
    """The path in the image of a local project file; :class:`SubmitError` if the image does not carry it."""
    local = local.resolve()
    if not local.is_file():
        raise SubmitError(f"{key}: {value!r} resolves to {local}, which does not exist")
    for root in local.parents:
        if (root / "pyproject.toml").is_file():
            relative = local.relative_to(root)
            if relative.parts[0] in IMAGE_FOLDERS:
                return f"{IMAGE_PROJECT_ROOT}/{relative.as_posix()}"
            break
    raise SubmitError(
        f"{key}: {value!r} is a file on this machine ({local}), which the pipeline's pods cannot read. "
        f"Copy it onto the data volume and give its absolute path there (e.g. {cluster.DATA_MOUNT_PATH}/data/{local.name}), "
        "or build it into the image and give that absolute path"
    )


def parse_params(items: list[str]) -> dict[str, Any]:
    """``name=value`` pipeline parameters; integers are passed as integers."""
    params: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SubmitError(f"pipeline parameter {item!r} must look like name=value")
        params[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value
    return params


def ui_base(host: str) -> str:
    return os.environ.get("KFP_UI_HOST", host).rstrip("/")


def run_url(host: str, run_id: str) -> str:
    return f"{ui_base(host)}/#/runs/details/{run_id}"


def submit_run(
    config_path: str,
    host: str | None = None,
    experiment: str = "tidal",
    params: dict[str, Any] | None = None,
    accelerator: str = "nvidia",
    image: str = "",
    run_name: str | None = None,
    client: Any = None,
    queue_name: str = "",
    backend_version: str | None = None,
) -> SubmittedRun:
    """Compile for ``accelerator``, submit with ``config_path``'s text, return the run's id and URL. The run's
    ``kfp_ui_url`` defaults to the KFP UI (``$KFP_UI_HOST`` or the host), so its MLflow run links back to it.
    ``backend_version``: the KFP backend's release, for a backend whose API does not report it."""
    resolved_host = kfp_host(host)
    arguments = {"kfp_ui_url": ui_base(resolved_host), **pipeline_arguments(config_path, params or {})}
    client = client or kfp_client_from_env(resolved_host)
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(Path(tmp) / "tidal-pipeline.yaml", accelerator=accelerator, image=image, queue_name=queue_name)
        check_backend_of(client, resolved_host, package, backend_version)
        # kfp prints its own "Experiment details: / Run details:" links (to the API host, not KFP_UI_HOST): the
        # caller prints the run's link, so stdout starts with it
        with kfp_api_calls(resolved_host, "creating the run"), contextlib.redirect_stdout(io.StringIO()):
            result = client.create_run_from_pipeline_package(
                str(package),
                arguments=arguments,
                run_name=run_name or f"tidal-{Path(config_path).stem}",
                experiment_name=experiment,
                namespace=os.environ.get("KFP_NAMESPACE") or None,
                enable_caching=False,
            )
    return SubmittedRun(run_id=result.run_id, url=run_url(resolved_host, result.run_id), client=client)


def check_backend_of(client: Any, host: str, package: Path, stated: str | None = None) -> None:
    """Before anything is created: the backend's version (its healthz, else ``stated``) against the floor."""
    import yaml

    from tidal.kube.submit.backend import BackendTooOld, check_backend, healthz, parse_version, version_of

    if stated is not None and parse_version(stated) is None:
        raise SubmitError(f"--backend-version {stated!r} is not a KFP release (like 2.5.0)")
    with kfp_api_calls(host, "reading its version"):
        version, notes = version_of(healthz(client), stated)
    try:
        if parse_version(version) is not None:
            notes += check_backend(version, list(yaml.safe_load_all(package.read_text())))
    except BackendTooOld as err:
        raise SubmitError(str(err)) from None
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- --wait: follow the run, read its final metrics

POLL_SECONDS = 15.0
POLL_FAILURES_ALLOWED = 5
"""Polls that fail transiently in a row (the API unreachable, or a 5xx) before following the run gives up."""
UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class Followed:
    state: str  # the last state seen
    error: str = ""  # KFP's message for a failed run, or why following it stopped
    timed_out: bool = False


def run_state(client: Any, host: str, run_id: str) -> tuple[str, str]:
    """The run's KFP runtime state and, when it failed, KFP's message."""
    with kfp_api_calls(host, f"reading run {run_id}"):
        run = client.get_run(run_id)
    error = one_line(getattr(run.error, "message", "")) if run.error else ""
    return str(run.state or UNKNOWN), error


def follow_run(
    read_state: Callable[[], tuple[str, str]],
    timeout_s: float | None,
    poll_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Followed:
    """Read the run's state every ``poll_s`` seconds until it is final or ``timeout_s`` has passed, saying each
    new state. A transient failure is said and asked again; a lasting one ends the following, in ``error``."""
    start = clock()
    state, error, failures = UNKNOWN, "", 0
    while True:
        try:
            seen, error = read_state()
        except KfpApiError as err:
            failures += 1
            if not err.transient or failures >= POLL_FAILURES_ALLOWED:
                return Followed(state, f"stopped following it: {err}")
            say(f"{err}; asking again in {poll_s:g} s")
        else:
            failures = 0
            if seen != state:
                say(seen)
            state = seen
            if state in FINAL_STATES:
                return Followed(state, error)
        left = None if timeout_s is None else timeout_s - (clock() - start)
        if left is not None and left <= 0:
            return Followed(state, timed_out=True)
        sleep(poll_s if left is None else min(poll_s, left))


@dataclass(frozen=True)
class MlflowRun:
    run_id: str
    url: str  # empty when no MLflow UI is known
    metrics: dict[str, float]  # the last value of each metric


def pipeline_mlflow_run(tracking_uri: str, kfp_run_id: str, mlflow_ui_url: str = "") -> MlflowRun | None:
    """The MLflow parent run that the pipeline's prepare step opened for this KFP run (``parent_run.open_parent_run``
    tags it ``kfp.run_id`` and ``tidal.role=pipeline``); None when there is none."""
    from tidal.kube.steps.parent_run import RunLinks, mlflow_ui_base
    from tidal.tracking import find_run, run_page_url

    if not re.fullmatch(r"[\w.-]+", kfp_run_id):
        raise ValueError(f"KFP run id {kfp_run_id!r} cannot be searched for")
    found = find_run(tracking_uri, {"kfp.run_id": kfp_run_id, "tidal.role": "pipeline"})
    if found is None:
        return None
    ui = mlflow_ui_base(RunLinks(mlflow_ui_url=mlflow_ui_url), tracking_uri)
    url = run_page_url(ui, found.experiment_id, found.run_id) if ui else ""
    return MlflowRun(found.run_id, url, found.metrics)


@dataclass(frozen=True)
class GateOptions:
    requirements: list[Requirement]
    tracking_uri: str  # empty: no metrics
    timeout_s: float | None
    poll_s: float = POLL_SECONDS
    mlflow_ui_url: str = ""


def follow_submitted(run: SubmittedRun, host: str, options: GateOptions, say: Callable[[str], None]) -> Outcome:
    """``--wait``: follow the run to its end, then check the requirements on its MLflow run's metrics."""
    followed = follow_run(lambda: run_state(run.client, host, run.run_id), options.timeout_s, options.poll_s, lambda s: say(f"run {run.run_id}: {s}"))
    mlflow, notes = None, []
    if not options.tracking_uri:
        notes.append("no MLflow tracking URI (--tracking-uri or MLFLOW_TRACKING_URI): the run's metrics were not read")
    else:
        try:
            mlflow = pipeline_mlflow_run(options.tracking_uri, run.run_id, options.mlflow_ui_url)
        except Exception as err:  # noqa: BLE001 - the outcome says what went wrong instead of a traceback
            notes.append(f"could not read the run's metrics from MLflow at {options.tracking_uri}: {type(err).__name__}: {one_line(err)}")
        else:
            if mlflow is None:
                notes.append(f"no MLflow run tagged kfp.run_id={run.run_id} at {options.tracking_uri}: the run's metrics were not read")
    metrics = mlflow.metrics if mlflow else {}
    unread = notes[-1] if options.requirements and mlflow is None else ""  # then every requirement fails for this reason
    return Outcome(
        run_id=run.run_id,
        state=followed.state,
        kfp_run_url=run.url,
        mlflow_run_id=mlflow.run_id if mlflow else "",
        mlflow_run_url=mlflow.url if mlflow else "",
        metrics=metrics,
        checks=check_requirements(options.requirements, metrics),
        timed_out=followed.timed_out,
        error=followed.error or unread,
        notes=notes,
    )


def submitted_only(run: SubmittedRun) -> Outcome:
    return Outcome(run_id=run.run_id, state=NOT_FOLLOWED, kfp_run_url=run.url)


STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def write_outcome(outcome: Outcome, json_path: str | None, summary_path: str | None) -> list[Path]:
    """``--json`` and ``--summary`` (Markdown); without ``--summary``, appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    written = []
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(outcome_dict(outcome), indent=1) + "\n")
        written.append(path)
    markdown = outcome_markdown(outcome)
    if summary_path:
        path = Path(summary_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown)
        written.append(path)
    elif os.environ.get(STEP_SUMMARY_ENV):
        path = Path(os.environ[STEP_SUMMARY_ENV])
        with path.open("a") as summary:
            summary.write(markdown + "\n")
        written.append(path)
    return written

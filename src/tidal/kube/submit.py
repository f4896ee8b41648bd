"""Submit the pipeline to Kubeflow Pipelines with ``kfp.Client`` (CI-triggered runs).

Where the client finds the server and its credentials (nothing is ever read from code or config files):

- ``--host`` or ``KFP_HOST``: the KFP API endpoint, e.g. ``https://kubeflow.example.com/pipeline``.
- ``KFP_TOKEN``: a bearer token (an OIDC ID token, or ``kubectl create token``), sent as ``Authorization``.
- ``KF_PIPELINES_SA_TOKEN_PATH``: a projected service-account token file, re-read when it rotates
  (in-cluster CI runners; KFP's own convention).
- ``KFP_NAMESPACE``: the Kubeflow profile namespace to run in (multi-user KFP).
- ``KFP_SSL_CA_CERT``: a CA bundle for a private TLS endpoint.
- ``KFP_UI_HOST``: where the run's link should point, if the UI is not at ``host``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.kube import cluster
from tidal.kube.pipeline import compile_pipeline


class SubmitError(RuntimeError):
    """Submission cannot start: what is missing is named in the message."""


@dataclass(frozen=True)
class SubmittedRun:
    run_id: str
    url: str


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
    return kfp.Client(
        host=kfp_host(host),
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
        load_config(path)
    except ConfigError as err:
        raise SubmitError(str(err)) from None
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
) -> SubmittedRun:
    """Compile for ``accelerator``, submit with ``config_path``'s text, return the run's id and URL. The run's
    ``kfp_ui_url`` defaults to the KFP UI (``$KFP_UI_HOST`` or the host), so its MLflow run links back to it."""
    resolved_host = kfp_host(host)
    arguments = {"kfp_ui_url": ui_base(resolved_host), **pipeline_arguments(config_path, params or {})}
    client = client or kfp_client_from_env(resolved_host)
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(Path(tmp) / "tidal-pipeline.yaml", accelerator=accelerator, image=image, queue_name=queue_name)
        result = client.create_run_from_pipeline_package(
            str(package),
            arguments=arguments,
            run_name=run_name or f"tidal-{Path(config_path).stem}",
            experiment_name=experiment,
            namespace=os.environ.get("KFP_NAMESPACE") or None,
            enable_caching=False,
        )
    return SubmittedRun(run_id=result.run_id, url=run_url(resolved_host, result.run_id))

"""What every step checks of its pod's environment before it starts: a required credential that is empty.

On KFP backends before 2.15 the driver drops ``optional`` from a task's Secret keys, so every key a step reads
must exist; the platform's Secrets therefore hold every key, empty where unset, and Tidal treats an empty value
as unset (MLflow's basic auth, the UI link, a served reward's API key). A credential the step cannot work
without, though, must not be empty: that fails here, in one line naming the Secret and key to fill in, instead
of later and elsewhere (an empty ``MLFLOW_TRACKING_URI`` would make MLflow log to the pod's own disk).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tidal.kube import cluster
from tidal.kube.steps.records import PipelineStepError

REQUIRED_CREDENTIALS = {
    **{env: (cluster.MLFLOW_SECRET, key) for key, env in cluster.MLFLOW_SECRET_REQUIRED_ENV.items()},
    cluster.NATS_PASSWORD_ENV: (cluster.NATS_SECRET, "<role>-password"),
}
"""Variables a step gets from a required Secret key: present, they must not be empty. (The snapshot keys are files,
which the role reading them checks: an empty or malformed one is an error naming the file.)"""


def empty_credential_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line naming the first required credential this pod got empty; None when all it got are set."""
    for env, (source, key) in REQUIRED_CREDENTIALS.items():
        if env in environ and not environ[env].strip():
            where = source if source.startswith("ConfigMap") else f"Secret {source}"
            return f"{env} is empty: set key {key!r} of {where} (the step cannot run without it)"
    return None


def check_pod_env(environ: Mapping[str, str] = os.environ) -> None:
    problem = empty_credential_problem(environ)
    if problem:
        raise PipelineStepError(problem)

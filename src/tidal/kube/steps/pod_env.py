"""What every step checks of its pod before it starts: that it is not root, and no required credential is empty.

The compiled pipeline carries only what KFP backend 2.5.0 knows (tidal.kube.submit.backend), so no optional Secret
keys and no security context:

- every key a step reads must exist; the platform's Secrets therefore hold every key, empty where unset, and Tidal
  treats an empty value as unset (MLflow's basic auth, the UI link, a served reward's API key). A credential the
  step cannot work without, though, must not be empty: that fails here, in one line naming the Secret and key to
  fill in, instead of later and elsewhere (an empty ``MLFLOW_TRACKING_URI`` would make MLflow log to the pod's disk);
- the images run as USER 1000, and a step in a KFP pod (``KFP_POD_NAME``, which every KFP backend sets in the
  task's container) refuses to run as root: an image built on Tidal's that switched to root, or a cluster policy
  that runs it so, is stopped in one line instead of running model-written code as root.
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


KFP_POD_ENV = "KFP_POD_NAME"
"""Set by every KFP backend in a task's container (its Argo template's env): the step runs in a KFP pod."""


def root_problem(environ: Mapping[str, str], uid: int) -> str | None:
    """One line when this process runs as root in a KFP pod; None otherwise (kfp-local steps are not pods)."""
    if uid == 0 and environ.get(KFP_POD_ENV):
        return (
            f"this step runs as root (uid 0) in pod {environ[KFP_POD_ENV]}: Tidal's steps run as uid {cluster.RUN_AS_USER} "
            "(the images' USER; the pipeline sets no security context, which KFP 2.5.0 does not know), so run the image as a non-root user"
        )
    return None


def check_pod_env(environ: Mapping[str, str] = os.environ, uid: int | None = None) -> None:
    problem = root_problem(environ, os.geteuid() if uid is None else uid) or empty_credential_problem(environ)
    if problem:
        raise PipelineStepError(problem)

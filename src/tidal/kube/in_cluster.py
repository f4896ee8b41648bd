"""The Kubernetes API as a step's pod reaches it: its service account's client and namespace, its own pod's name,
and what a 404 looks like through the SDKs."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client as k8s


def cluster_api_client() -> k8s.ApiClient:
    """The pod's service account on a cluster, else ``~/.kube/config`` (as ``TrainerClient`` connects)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return k8s.ApiClient()


def current_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "tidal"


POD_NAME_ENV = ("TIDAL_POD_NAME", "KFP_POD_NAME")
POD_UID_ENV = ("TIDAL_POD_UID", "KFP_POD_UID")
"""Where a step finds its own pod (the downward API: set by the pipeline on the steps that need it)."""


def is_not_found(err: BaseException) -> bool:
    """A Kubernetes 404, also when an SDK wrapped it (TrainingClient and TrainerClient raise RuntimeError from the ApiException)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if getattr(err, "status", None) == 404:
            return True
        err = err.__cause__ or err.__context__
    return False

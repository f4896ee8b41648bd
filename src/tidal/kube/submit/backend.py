"""Which KFP backends run the compiled pipeline: the floor, what each release's driver does with the executor-config
fields Tidal's IR uses, and the backend's version as its API reports it.

The KFP driver parses each task's Kubernetes executor config (kfp-kubernetes' ``KubernetesExecutorConfig``) before
the task's pod exists. Up to 2.4.x it parses strictly: a field its proto does not know fails the task. From 2.5.0 it
drops unknown fields, so a field only a later release knows is silently ignored. :data:`FIELD_SINCE` says from which
release each field Tidal uses is read (``tests/data/kfp_protos/`` holds the protos it is checked against), and
:data:`NOT_LOAD_BEARING` why dropping the later ones is harmless.
"""

from __future__ import annotations

import json
import re
from typing import Any

BACKEND_FLOOR = (2, 5, 0)
"""The oldest KFP backend the compiled pipeline runs on (Kubeflow 1.10 ships 2.5.0)."""

FIELD_SINCE = {
    "activeDeadlineSeconds": (2, 0, 0),
    "configMapAsEnv": (2, 0, 0),
    "configMapAsEnv[].configMapName": (2, 0, 0),
    "configMapAsEnv[].keyToEnv": (2, 0, 0),
    "configMapAsEnv[].configMapNameParameter": (2, 5, 0),
    "configMapAsEnv[].optional": (2, 15, 0),
    "configMapAsVolume": (2, 0, 0),
    "configMapAsVolume[].configMapName": (2, 0, 0),
    "configMapAsVolume[].mountPath": (2, 0, 0),
    "configMapAsVolume[].optional": (2, 0, 0),
    "configMapAsVolume[].configMapNameParameter": (2, 5, 0),
    "emptyDirMounts": (2, 0, 0),
    "fieldPathAsEnv": (2, 0, 0),
    "nodeSelector": (2, 0, 0),
    "podMetadata": (2, 0, 0),
    "pvcMount": (2, 0, 0),
    "pvcMount[].constant": (2, 0, 0),
    "pvcMount[].mountPath": (2, 0, 0),
    "pvcMount[].pvcNameParameter": (2, 5, 0),
    "secretAsEnv": (2, 0, 0),
    "secretAsEnv[].secretName": (2, 0, 0),
    "secretAsEnv[].keyToEnv": (2, 0, 0),
    "secretAsEnv[].secretNameParameter": (2, 5, 0),
    "secretAsEnv[].optional": (2, 15, 0),
    "secretAsVolume": (2, 0, 0),
    "secretAsVolume[].secretName": (2, 0, 0),
    "secretAsVolume[].mountPath": (2, 0, 0),
    "secretAsVolume[].optional": (2, 0, 0),
    "secretAsVolume[].secretNameParameter": (2, 5, 0),
    "securityContext": (2, 16, 0),
    "tolerations": (2, 0, 0),
}
"""Each executor-config field (a path of JSON names) Tidal's IR may use: the first KFP backend whose driver reads it."""

NOT_LOAD_BEARING = {
    "configMapAsEnv[].configMapNameParameter": "configMapName, which every release reads, names the same ConfigMap",
    "pvcMount[].pvcNameParameter": "constant, which every release reads, names the same PVC",
    "secretAsEnv[].secretNameParameter": "secretName, which every release reads, names the same Secret",
    "configMapAsVolume[].configMapNameParameter": "configMapName, which every release reads, names the same ConfigMap",
    "secretAsVolume[].secretNameParameter": "secretName, which every release reads, names the same Secret",
    "configMapAsEnv[].optional": "Tidal's ConfigMap keys are all required (optional: false, the old driver's rule too)",
    "secretAsEnv[].optional": "the platform's Secrets hold every key, empty where unset, and Tidal treats empty as unset",
    "securityContext": "the images run as USER 1000 (tests/test_kube_images.py), so pods are non-root without it",
}
"""Why a driver that drops a field still runs Tidal's pipeline as intended."""


class BackendTooOld(ValueError):
    """The KFP backend is below :data:`BACKEND_FLOOR`; one line."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"2.5.0"``, ``"v2.14.3"``, ``"2.15.0-rc.1"`` → a tuple; None for anything else (``"unknown"``, a commit)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.].*)?", text.strip())
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def executor_config_fields(pipeline_documents: list[dict]) -> set[str]:
    """The executor-config field paths (JSON names, ``[]`` for list items; map keys not included) the compiled IR uses."""
    platform = next((d for d in pipeline_documents[1:] if "platforms" in d), {})
    executors = platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
    found: set[str] = set()
    for config in executors.values():
        for name, value in config.items():
            found.add(name)
            for item in value if isinstance(value, list) else []:
                found.update(f"{name}[].{child}" for child in (item if isinstance(item, dict) else {}))
    return found


def driver_view(version: tuple[int, int, int], fields: set[str]) -> tuple[set[str], set[str]]:
    """``(read, dropped)``: which of ``fields`` a driver of ``version`` reads, and which it drops (unknown to it)."""
    known = {f for f in fields if f in FIELD_SINCE or f.split("[]")[0] in FIELD_SINCE}
    dropped = {f for f in known if version < FIELD_SINCE.get(f, FIELD_SINCE.get(f.split("[]")[0], (0, 0, 0)))}
    return known - dropped, dropped


def check_backend(version_text: str, pipeline_documents: list[dict]) -> list[str]:
    """Raise :class:`BackendTooOld` (one line) below the floor; else notes on what this backend drops and why that is fine."""
    version = parse_version(version_text)
    if version is None:
        return [f"the KFP backend reports version {version_text!r}, not a release: Tidal needs {dotted(BACKEND_FLOOR)} or later"]
    fields = executor_config_fields(pipeline_documents)
    _, dropped = driver_view(version, fields)
    if version < BACKEND_FLOOR:
        refused = ", ".join(sorted(dropped)) or "none"
        raise BackendTooOld(
            f"KFP backend {dotted(version)} is below Tidal's floor {dotted(BACKEND_FLOOR)} (Kubeflow 1.10): its driver refuses "
            f"executor-config fields the pipeline uses ({refused}); upgrade the KFP backend to {dotted(BACKEND_FLOOR)} or later"
        )
    return [f"KFP backend {dotted(version)} drops {field}: harmless, {NOT_LOAD_BEARING[field]}" for field in sorted(dropped)]


def reported_version(client: Any) -> str:
    """``tag_name`` of the KFP API's ``/apis/v2beta1/healthz`` (every 2.x release reports it; ``"unknown"`` when the
    server was built without it). kfp's client model keeps only ``multi_user``, so the raw answer is read."""
    response = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    body = response.data.decode() if isinstance(response.data, bytes) else str(response.data)
    try:
        payload = json.loads(body or "{}")
    except json.JSONDecodeError:
        return "unknown"
    return str(payload.get("tag_name") or "unknown") if isinstance(payload, dict) else "unknown"
